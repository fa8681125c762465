"""Training: what one optimizer step needs and does.

  engine        train_one_epoch: dicts in, dicts out, no files; top-k counts kept on the device.
  models        a torchvision (or ``timm_models``) model by name; the crops -a accepts (and
                ``check_start``, main.py's and imagenet.train's first check); wrapped for DDP
                or FSDP; --compile (static shapes, compiled DDP, graph counts).
  optim         the loss, optimizer, per-iteration learning-rate schedule and EMA
                (``build_engine``); where a run is in epochs and images, the schedule rebuilt
                there.
  compile_cache --compile's graphs kept for restarts.
  fsdp          --fsdp: which blocks become units, sharding, gathered states.
  comm_hooks    DDP gradient compression for slow links, and its state.
  finetune      --finetune's weights fitted into the model; --freeze-backbone.
The last four are imported only by a run that uses them.
"""
