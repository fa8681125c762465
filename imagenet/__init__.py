"""ImageNet / ImageFolder trainer for torchvision models. The modules, in the order a run uses them:

Starting
  cli          main(): parse the flags, plan the launch, start the processes, turn errors into one
               line and an exit code. The only place that exits.
  config       the flags -> a frozen Config; every field declares its classic flag.
  configfile   --config FILE.toml: a recipe file's keys -> flag values, checked like the flags.
  errors       the exceptions cli turns into exit codes (2 usage, 1 runtime, 143 preempted).
  launch       pure decisions: launch mode, each process's rank and device, the backend, and the
               per-process batch and loader workers (Layout). Reads the launchers' variables.
  distributed  joins the process group (errors that say what to check), barrier, agreed
               errors, cleanup.
  failures     one rank's failure stops every rank within seconds, with its message (through the
               rendezvous store, for launchers that do not stop the other ranks themselves).
  cpu_features whether the CPU has bf16 instructions (--amp bf16 without them is slow).
  inputsize    the crop sizes -a accepts (its model run on the meta device), checked first.

One training process (trainer.run_training: build -> claim the folder -> resume -> check -> train)
  build        Run: everything a process holds, built from the flags; build_engine makes the
               objects of a training step (also used by the tests and benchmarks).
  data         datasets, the resumable training sampler (with repeated augmentation,
               --ra-reps), the exact validation shards, loaders; TrainData, what the trainer
               asks of any training source.
  resolution   progressive resizing: the training crop of every epoch, built in the loader
               process from the sample's epoch; --compile with a static graph per size.
  shards       tar shards (WebDataset format): sources, downloads, a strict tar reader, the
               epoch plan (a pure function of seed, epoch and layout), the loaders.
  transforms   JPEG decoding and augmentation to uint8 tensors; normalisation on the device.
  gpu_data     --decode-on-device: workers ship JPEG bytes and crop boxes, the device decodes
               and crops; every batch reaches the device on a side stream, one batch ahead.
  shm          room in /dev/shm for the loader workers' batches, checked at start-up.
  models       a torchvision model by name, its weights; wrapped for DDP or FSDP (and unwrapped).
  timm_models  -a timm/NAME: timm.create_model, its names and weight tags checked (timm extra).
  compiling    --compile: static shapes, compiled DDP, the recompile limit, graph counts.
  finetune     --finetune PATH (any checkpoint or state dict into the plain model, the
               classifier found generically and re-initialised when it does not fit),
               --freeze-backbone (a linear probe).
  fsdp         --fsdp: which blocks become FSDP units (one rule for every model), sharding with
               mixed precision and offload, and the sharded states gathered for checkpoints.
  comm_hooks   DDP gradient compression for slow links (fp16/bf16/PowerSGD) and its state.
  optim        optimizer, per-iteration learning-rate schedule, loss, EMA.
  rundir       the output folder belongs to one run: its lock, earlier runs moved to previous/.
  preflight    before the first step: the folder claimed, room for the checkpoints, every
               validation image readable; every rank raises the same error.
  disk         free space, the file size limit, one line for a write that did not fit.
  checkpoint   files (atomic writes, safe loads), state (what a run saves, how a resume puts it
               back), guard (only finite state, the same class names), source (which checkpoint
               every rank resumes: rank 0 decides), changes (the flags and layout that differ
               from the checkpoint's), rng (every rank's random streams), sharded
               (--sharded-checkpoint directories), history (--keep-checkpoints: the best epoch
               checkpoints and their index).
  position     where a run is in epochs and images, in any layout; the schedule rebuilt there.
  trainer      the epoch loop: train, validate, keep the best, save, log.
  engine       train_one_epoch and evaluate; dicts in, dicts out, no files.
  evaluation   what a validation says beyond top-1: --tta-flip, the per-image predictions
               gathered to rank 0 (--predictions), the per-class report after the last epoch
               and with -e; -e --val-data FOLDER (another ImageFolder, no DIR needed).
  reports      the files of that report: predictions CSV, per-class CSV/JSON, confusion matrix
               (also a TensorBoard image), the worst classes.
  metrics      top-k counts and sums that stay on the device and are all-reduced once.
  preemption   SIGTERM/SIGUSR1/SIGINT: finish the step, save, agree across ranks, exit 143.
  timelimit    --time-limit: rank 0's clock asks for that stop in time to save (exit 143); a
               job after the last epoch has "nothing left to train".
  logger       console and progress lines, TensorBoard, metrics.jsonl, config.json (rank 0).
  console      what a person reads around the loop: --demo's settings, slow start-up stages,
               what -e evaluates, where a finished run's outputs are.
  trackers     --log-to mlflow,wandb: the same scalars, flags and final metrics; the same runs
               continued across resumes (OUTPUT_DIR/trackers.json).

Called from Python, where a launcher calls a function (Ray Train)
  api          imagenet.train(argv): main.py's run in this process, in the caller's process
               group if there is one; the final metrics, TrainerErrors, a hook per checkpoint.
  outputs      Run.outputs: what happens besides writing OUTPUT_DIR (uploads, the caller's
               hook per checkpoint, a caller's checkpoint to resume).

Object storage (s3://, gs://, any fsspec URL; extra "cloud")
  objectstore  fsspec filesystems and uploads that no reader sees half-done.
  storage      --output-dir / --resume URLs: a local staging folder, mirrored by rank 0.

Side tools (not imported by a training run unless asked for)
  tools.prepare     python -m imagenet.tools.prepare: ILSVRC2012 archives -> ImageFolder,
                    or -> tar shards (tools.shardwrite), also from an ImageFolder; both
                    writers share tools.prepfiles (imports run prepare -> shardwrite -> prepfiles).
  tools.envcheck    main.py --env-check: installation, devices and a real all-reduce.
  tools.demo        the built-in demo data set (--demo, run_single.sh).
  tools.unshard     python -m imagenet.tools.unshard: a --sharded-checkpoint directory -> the
                    classic single file.
  tools.export      python -m imagenet.tools.export: a checkpoint -> pt2, ONNX or TorchScript,
                    checked against eager PyTorch.
"""


def __getattr__(name: str):
    """``imagenet.train``, imported on first use (it pulls in torch and the trainer)."""
    if name == "train":
        from imagenet.api import train

        return train
    raise AttributeError(f"module 'imagenet' has no attribute {name!r}")
