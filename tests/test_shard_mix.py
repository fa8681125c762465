"""The class mix of the training batches read from shards (issue 60): Parquet files and tar
shards are read as a few sequential streams, so what a batch can hold depends on how many
places of the split it draws from. A split stored in class order (a ``datasets`` set written
with pyarrow after ``Dataset.shuffle()``, which only records an index mapping, or sorted by
label as many Hub sets are) must still give batches that mix the classes as an ImageFolder's
shuffled epoch does. Real Parquet files (real JPEG bytes, the ``huggingface`` metadata) read
by the trainer's own batch sampler; no decoding, so the test takes about a second.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from imagenet.data.shards.parquet import resolve_parquet
from imagenet.data.shards.reader import ShardBatchSampler

CLASSES, PER_CLASS, FILE_ROWS, ROW_GROUP, BATCH = 10, 300, 400, 100, 64  # issue 60's set


def write_sorted_parquet(out: Path) -> Path:
    """The issue's 3,000 training rows in class order: 8 files of 400 rows, row groups of 100
    (and a validation file, which a data set needs)."""
    jpegs = []
    for c in range(CLASSES):
        buf = io.BytesIO()
        Image.new("L", (32, 32), 20 * c).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    names = [f"class{c}" for c in range(CLASSES)]
    meta = {"huggingface": json.dumps({"info": {"features": {
        "image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": names}}}})}
    labels = [c for c in range(CLASSES) for _ in range(PER_CLASS)]
    table = pa.table({"image": [{"bytes": jpegs[c], "path": f"{i}.jpg"}
                                for i, c in enumerate(labels)],
                      "label": pa.array(labels, pa.int64())}).replace_schema_metadata(meta)
    data = out / "data"
    data.mkdir(parents=True)
    files = -(-len(labels) // FILE_ROWS)
    for i in range(files):
        pq.write_table(table.slice(i * FILE_ROWS, FILE_ROWS),
                       data / f"train-{i:05d}-of-{files:05d}.parquet", row_group_size=ROW_GROUP)
    pq.write_table(table.slice(0, 20), data / "validation-00000-of-00001.parquet")
    return out


@pytest.fixture(scope="module")
def sorted_split(tmp_path_factory):
    """The training files of ``write_sorted_parquet``, as the trainer counts them."""
    return resolve_parquet(str(write_sorted_parquet(tmp_path_factory.mktemp("hub"))), None).train


def trainer_sampler(shards) -> ShardBatchSampler:
    """The training batch sampler as ``build_shard_data`` makes it (its streams and blocks)."""
    return ShardBatchSampler(shards, world_size=1, rank=0, batch_size=BATCH, shuffle=True,
                             seed=0, aug_seed=0)


def class_counts(sampler: ShardBatchSampler, epochs: int) -> np.ndarray:
    """Images of each class in each batch of the sampler's first epochs: (batches, classes)."""
    counts = []
    for epoch in range(epochs):
        sampler.set_position(epoch)
        counts += [np.bincount([int(raw["cls"]) for *_, raw in batch], minlength=CLASSES)
                   for batch in sampler]
    return np.array(counts)


def test_batches_of_a_split_stored_in_class_order_mix_the_classes_as_a_folder_does(sorted_split):
    counts = class_counts(trainer_sampler(sorted_split), epochs=2)
    assert counts.shape == (2 * 46, CLASSES) and (counts.sum(1) == BATCH).all()
    # An ImageFolder's shuffled epoch: a batch of 64 holds all 10 classes (9.99 on average),
    # the largest with about 12 images, each class's count spread by sqrt(64 x 0.1 x 0.9) = 2.4.
    # Two streams of 128 gave batches of 2 classes, 40 images of one, a spread of 11.5.
    fewest = counts.astype(bool).sum(1).min()
    most, spread = counts.max(), counts.std(0).mean()
    assert fewest >= 8 and most <= BATCH // 4 and spread < 3.5, (
        f"a batch with only {fewest} classes, one with {most} images of one class; class "
        f"counts per batch spread {spread:.1f} (a folder's: 2.4)")


def test_the_augmented_samples_preview_shows_the_first_batch_s_first_images(sorted_split):
    """The preview (``ShardTrain.preview``, logged at start) reads every stream's share of the
    first batch, in the batch's order, not one stream's few."""
    sampler = trainer_sampler(sorted_split)
    first = next(iter(sampler))
    assert [item[2] for item in sampler.first_items(0, 16)] == [item[2] for item in first[:16]]
