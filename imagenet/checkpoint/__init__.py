"""Checkpoints and the run folder that holds them.

  files        atomic writes, safe loads, which file to resume; nothing half-written.
  states       the state dicts of a model, optimizer and EMA (plain, DDP and FSDP alike), every
               rank's random streams; only finite state with the same classes saved or resumed.
  resume_from  the checkpoint every rank resumes (rank 0 decides); the flags and layout that
               differ from the checkpoint's.
  rundir       one run per folder: its lock, earlier runs moved to previous/; the background
               write; --keep-checkpoints' history.
  sharded      --sharded-checkpoint directories (torch.distributed.checkpoint); ``dcpread`` reads
               them as weights_only reads a file, ``dcpfiles`` checks their files.
  weights      any file's model weights (--finetune, export).
  storage      --output-dir / --resume on object storage: a local staging folder, mirrored.
The last three (and dcpread, dcpfiles) are imported only by a run that uses them.
"""
