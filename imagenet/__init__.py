"""ImageNet / ImageFolder trainer for torchvision models. The package, in the order a run uses it
(each folder's __init__ lists its modules; docs/code-map.md has the whole map):

  cli         main(): parse the flags, make the plan, start the processes, turn errors into one
              line and an exit code. The only place that exits.
  api         imagenet.train(argv): main.py's run in this process (Ray Train calls it).
  settings/   the flags, a recipe file and the launcher's environment resolved once into a
              ``Plan`` (launch, layout, crop schedule, data format, decode path, time limit).
  launching/  the processes join and agree (process_group), fail together (failures)
              and stop together (preemption, time limit).
  run/        one process's run: build the ``Run``, resume it, check it can finish, train
              epoch by epoch, save. The only package that knows ``Run``.
  evaluation/ validation: the loop, TTA, per-image predictions, the per-class report.
  checkpoint/ checkpoint files and the run folder that holds them (lock, history, storage).
  training/   the step: engine, model, optimizer, compile, FSDP, comm hooks, fine-tuning.
  data/       folders and tar shards to batches on the device, exactly and resumably.
  reporting/  console, TensorBoard, metrics.jsonl, trackers, result files.
  errors      the exceptions cli turns into exit codes (2 usage, 1 runtime, 143 preempted).
  tools/      side tools, imported only when asked for: prepare, envcheck, demo, unshard, export.

Imports run one way (no circle): cli and api -> run -> evaluation -> checkpoint -> training ->
data -> launching -> reporting -> settings -> errors; tools/ stand apart.
"""


def __getattr__(name: str):
    """``imagenet.train``, imported on first use (it pulls in torch and the trainer)."""
    if name == "train":
        from imagenet.api import train

        return train
    raise AttributeError(f"module 'imagenet' has no attribute {name!r}")
