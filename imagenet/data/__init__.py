"""Data: images from disk (or object storage) to batches on the device, exactly and resumably.

  folder     ImageFolder (and --dummy) datasets and their loaders; ``Data`` and ``TrainData``,
             what the trainer asks of any training source.
  index      the folder's index (a restart reads it instead of listing every folder); every
             validation image readable, checked in threads.
  samplers   the order and seeds: the resumable training sampler (--ra-reps), exact validation
             shards; augmentation a pure function of (seed, epoch, sample).
  transforms JPEG decoding and augmentation to uint8 tensors, each sample at its epoch's crop
             (progressive resizing); normalisation on the device.
  prefetch   batches to the device ahead of the step; room in /dev/shm for the workers' batches.
  shards     tar shards (WebDataset format) and Parquet: sources, downloads, a strict reader.
  device     --decode-on-device (workers ship JPEG bytes and crop boxes, the device decodes and
             crops) and the side stream that brings every batch to the device.
  objectstore fsspec filesystems for s3:// and gs:// (data and outputs; extra "cloud").
The last three are imported only by a run that uses them.
"""
