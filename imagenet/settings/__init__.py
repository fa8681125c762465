"""Settings: the command line, a recipe file and the launcher's environment, resolved once.

  flags     the flags -> a frozen ``Config`` (the flag table: every field declares its classic
            flag); ``choices`` checks -a, --log-to and --time-limit (and finds its end) and
            reads SLURM's variables; ``recipe`` reads --config FILE.toml.
  launch    pure decisions: launch mode, each process's ranks and device, the backend, the
            per-process batch and loader workers (``Layout``).
  devices   the accelerator (``torch.accelerator``), and whether this CPU computes bf16.
  images    what the data argument names (an ImageFolder or tar shards), the JPEG decoder, the
            training crop of every epoch (progressive resizing).
  plan      ``make_plan``: all of the above into one ``Plan``, before any process, model or
            loader is built, with where the processes meet and the local paths that stand for
            object-storage URLs. Every later stage reads the plan, never the raw flags or the
            launchers' variables again.

Imports only ``imagenet.errors``: everything else builds on it.
"""
