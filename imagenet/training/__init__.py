"""Training: what one optimizer step needs and does.

  engine       train_one_epoch and evaluate: dicts in, dicts out, no files.
  models       a torchvision (or ``timm_models``) model by name; wrapped for DDP or FSDP.
  optim        optimizer, per-iteration learning-rate schedule, loss, EMA.
  position     where a run is in epochs and images, in any layout; the schedule rebuilt there.
  compiling    --compile: static shapes, compiled DDP, graph counts.
  fsdp         --fsdp: which blocks become units, sharding, gathered states.
  comm_hooks   DDP gradient compression for slow links, and its state.
  finetune     --finetune's weights fitted into the model; --freeze-backbone.
  metrics      top-k counts and sums that stay on the device.
  inputsize    the crops -a accepts (its model run on the meta device).
  cpu_features whether this CPU has bf16 instructions.
"""
