"""One process's run, from start to end: the orchestrator (the only package that knows ``Run``).

  trainer        run_training: build -> claim the folder -> resume -> check -> the epoch loop.
  build          ``Run``: everything a process holds, built from the plan.
  loading        this rank's data set and loaders, as the plan says (build's data stage).
  checkpointing  what a run's checkpoint holds (save) and how a resume puts it back.
  preflight      before the first step: room on the disk, every validation image readable; a
                 job after the last epoch leaves at once (the folder is claimed by
                 checkpoint.rundir).
  outputs        where files go besides OUTPUT_DIR (object storage, imagenet.train's caller).
  announce       what a run says about itself: derived settings, what -e evaluates, the end.
  start          what main.py and imagenet.train check before any data or process: the plan's
                 notes, crops the model can take.
"""
