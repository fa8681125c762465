"""Checkpoints and the run folder that holds them.

  files     atomic writes, safe loads, which file to resume; ``whole`` (nothing half-written).
  states    the state dicts of a model, optimizer and EMA (plain, DDP and FSDP alike).
  sharded   --sharded-checkpoint directories (torch.distributed.checkpoint); ``dcpread`` reads
            them as weights_only reads a file: nothing in them runs code.
  weights   any file's model weights (--finetune, export).
  guard     only finite state is saved or resumed, with the same class names.
  source    the checkpoint every rank resumes: rank 0 decides.
  changes   the flags and layout that differ from the checkpoint's.
  rng       every rank's random streams.  history: --keep-checkpoints.
  rundir    one run per folder: its lock, earlier runs moved to previous/.
  storage   --output-dir / --resume on object storage: a local staging folder, mirrored.
  disk      free space, the file size limit, one line for a write that did not fit.
"""
