"""Before training: each rank checks its share of the validation shards, so that a missing,
truncated or miscounted shard costs seconds, not a trained epoch.

A local shard is read by its tar headers only (a seek past each member's data, about a second
for ImageNet's 50,000 images split over the ranks): every sample is counted against
``_info.json`` and the end-of-archive block must be there. A remote shard (http, ``pipe:``) is
opened and its first header read: it exists, the URL or command works and it is a tar; reading
all of it would download the validation set once more, so its length is checked as it is read.
"""

from __future__ import annotations

from imagenet.data.shards.parquet import open_reader
from imagenet.data.shards.sources import ShardList
from imagenet.data.shards.tarreader import ShardError
from imagenet.settings.images import is_remote


def first_bad_shard(shards: ShardList, rank: int, world_size: int) -> ShardError | None:
    """The first problem found in this rank's share of ``shards`` (every ``world_size``-th
    shard from ``rank`` on); None when they are fine."""
    for url, count in list(zip(shards.urls, shards.counts))[rank::world_size]:
        try:
            check_shard(url, count)
        except ShardError as exc:
            return exc
        except OSError as exc:  # a read that failed after the open (EIO, a vanished mount)
            return ShardError(f"shard {url} cannot be read: {exc.strerror or exc}")
    return None


def check_shard(url: str, count: int) -> None:
    """ShardError unless the shard at ``url`` holds ``count`` samples (remote: is readable)."""
    reader = open_reader(url, frozenset())  # a Parquet file: its footer's row count
    try:
        found = reader.skip(1 if is_remote(url) else count + 1)
    finally:
        reader.close()
    if is_remote(url):
        return
    if found > count:
        raise ShardError(f"shard {url} holds more than the {count} samples its _info.json "
                         "lists: copy it again or fix _info.json")
    if found < count:
        raise ShardError(f"shard {url} ends after {found} samples but its _info.json lists "
                         f"{count}: copy it again or fix _info.json")
