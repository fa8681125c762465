"""Data: images from disk (or object storage) to batches on the device, exactly and resumably.

  folder     ImageFolder (and --dummy) datasets and their loaders; ``Data`` and ``TrainData``,
             what the trainer asks of any training source.
  samplers   the order and seeds: the resumable training sampler (--ra-reps), exact validation
             shards; augmentation a pure function of (seed, epoch, sample).
  shards     tar shards (WebDataset format): sources, downloads, a strict tar reader, the plan.
  transforms JPEG decoding and augmentation to uint8 tensors; normalisation on the device.
  device     --decode-on-device (workers ship JPEG bytes and crop boxes, the device decodes and
             crops) and the side stream that brings every batch to the device.
  resizing   progressive resizing in the loaders: each sample cropped at its epoch's size.
  shm        room in /dev/shm for the loader workers' batches.
  objectstore fsspec filesystems for s3:// and gs:// (data and outputs; extra "cloud").
"""
