"""Settings: the command line, a recipe file and the launcher's environment, resolved once.

  flags     the flags -> a frozen ``Config`` (the flag table: every field declares its classic
            flag); ``choices`` checks -a and --log-to against what is installed; ``recipe`` reads
            --config FILE.toml; ``duration`` parses --time-limit and finds its end.
  launch    pure decisions: launch mode, each process's ranks and device, the backend, the
            per-process batch and loader workers (``Layout``); ``slurm`` reads SLURM's variables.
  crops     the training crop of every epoch (progressive resizing).
  sources   what the data argument names: an ImageFolder or tar shards.
  staging   the local paths that stand for an object-storage --output-dir, --resume, --predictions.
  plan      ``make_plan``: all of the above into one ``Plan``, before any process, model or
            loader is built. Every later stage reads the plan, never the raw flags or the
            launchers' variables again.

Imports only ``imagenet.errors``: everything else builds on it.
"""
