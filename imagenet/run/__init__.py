"""One process's run, from start to end: the orchestrator (the only package that knows ``Run``).

  trainer        run_training: build -> claim the folder -> resume -> check -> the epoch loop.
  build          ``Run``: everything a process holds, built from the plan.
  checkpointing  what a run's checkpoint holds (save) and how a resume puts it back.
  preflight      before the first step: the folder claimed, room on the disk, every validation
                 image readable; a job after the last epoch leaves at once.
  outputs        where files go besides OUTPUT_DIR (object storage, imagenet.train's caller).
  announce       what a run says about itself: derived settings, what -e evaluates, the end.
"""
