"""This rank's data, as the plan says: the data argument (or the demo's data), where the folder
indexes are kept, and the data set with its loaders (an ImageFolder, --dummy data, tar shards, or
-e --val-data's own)."""

from __future__ import annotations

import logging
from pathlib import Path

import imagenet.evaluation.eval_data as eval_data
from imagenet.checkpoint.resume_from import Decided
from imagenet.data.folder import Data, build_data
from imagenet.data.index import IndexFiles
from imagenet.launching.collectives import DistInfo
from imagenet.settings.flags import DEMO_DATA, Config
from imagenet.settings.plan import Plan

log = logging.getLogger(__name__)
STREAMED = ("shards", "parquet")  # read by the shard machinery (imagenet.data.shards)


def data_root(cfg: Config, output_dir: Path) -> str:
    """The data argument: DIR (a folder, URL or shard pattern), or the built-in demo data
    generated under OUTPUT_DIR."""
    if not cfg.demo:
        return cfg.data
    from imagenet.tools.demo import make_demo_dataset

    return str(make_demo_dataset(output_dir / DEMO_DATA))


def index_files(plan: Plan, dist: DistInfo) -> IndexFiles:
    """Where the folder indexes are kept (--cache-dir); every process reads them. Rank 0 writes
    the ones it builds; so does each other node's first process when --cache-dir names a folder
    (node-local data copies then get one each): in the default OUTPUT_DIR/cache, the run folder
    is rank 0's alone, and a node without it writes nothing there."""
    writes = dist.is_main or (dist.local_rank == 0 and plan.cfg.cache_dir is not None)
    return IndexFiles(plan.cache_dir, write=writes)


def load_data(plan: Plan, dist: DistInfo, root: str, aug_seed: int,
              continues: Decided | None = None) -> Data:
    """This rank's data: an ImageFolder (or --dummy data) or tar shards, as the plan says;
    ``continues``: the checkpoint of the run (-e --val-data labels its folder with its
    classes)."""
    cfg = plan.cfg
    pin_memory = dist.device.type not in ("cpu", "mps")  # MPS shares the CPU's memory
    indexes = index_files(plan, dist)
    if dist.is_main and plan.data_format != "dummy":
        log.info("=> images decoded by %s (%s)", plan.decoding.name, plan.decoding.why)
    if plan.data_format not in STREAMED and cfg.evaluate and cfg.val_data:  # DIR not read
        return eval_data.build_eval_data(plan, dist.rank, aug_seed, pin_memory, indexes,
                                         continues)
    if dist.is_main and plan.decode.on_device:
        log.info("=> JPEGs decoded and cropped on %s (--decode-on-device %s); loader workers "
                 "read files", dist.device, plan.decode.why)
    elif dist.is_main and plan.data_format == "folder" and dist.device.type == "cuda":
        log.info("=> JPEGs decoded and cropped by the loader workers (--decode-on-device %s)",
                 plan.decode.why)
    if plan.data_format in STREAMED:
        from imagenet.data.shards import build_shard_data  # imported only for shards

        return build_shard_data(plan, root, dist.rank, aug_seed, pin_memory=pin_memory)
    return build_data(plan, root, dist.rank, aug_seed, pin_memory=pin_memory, files=indexes)
