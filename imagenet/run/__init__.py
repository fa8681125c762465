"""One process's run, from start to end: the orchestrator (the only package that knows ``Run``).

  trainer        run_training: build -> claim the folder -> resume -> check -> the epoch loop.
  build          ``Run``: everything a process holds, built from the plan: this rank's data set
                 and loaders, the early start of the training batches, the model and engine.
  checkpointing  what a run's checkpoint holds (save) and how a resume puts it back;
                 ``Checkpointer``: the epoch loop's saves (--save-every, the best files, the
                 background write).
  stopping       ``Stop``: the epoch loop's stop (signals, --time-limit; one exit, 143 or the
                 time limit's code) and --compile's upkeep between steps.
  preflight      before the first step: room on the disk, every validation image readable; a
                 job after the last epoch leaves at once; what a run says about itself (derived
                 settings, what -e evaluates, the end).
  outputs        where files go besides OUTPUT_DIR (object storage, imagenet.train's caller).
"""
