"""The checkpoint layer: ``files`` (atomic writes, safe loads, which file to resume), ``state``
(what a run saves and how a resume restores it), ``rng`` (every rank's random streams)."""
