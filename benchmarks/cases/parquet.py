"""Hugging Face Parquet vs tar shards of the same images: loader speed per CPU core. Run by hand
(not a test):

    python benchmarks/bench.py parquet speed           # 2000 images, 3 passes each
    python benchmarks/bench.py parquet speed --images 5000 --passes 5
    python benchmarks/bench.py parquet accuracy        # the demo recipe on both: top-1
    python benchmarks/bench.py parquet check           # the row check before the first step

The data: ``--images`` photo-like JPEGs of ImageNet sizes (~470x360, quality 90; 10 classes) in
WORKDIR/folder, the tar shards and the Hub-layout Parquet that ``python -m imagenet.tools.prepare
--from-folder`` writes of them (files of ``--shard-size`` MB); made once, reused. Both are read
by the trainer's own shard reader (``ShardBatchSampler``: the epoch plan, two streams) and
decoded and augmented by ``ShardSamples`` with the training transform (RandomResizedCrop 224 +
flip) in batches of 64, in this process with one thread and no loader workers: images per
CPU-second is what one loader core delivers. The two take turns over ``--passes`` epochs (a slow
phase of the machine hits both); also the read alone (no decode). The target: Parquet within
10 % of the shards.

accuracy: the demo's procedural 10-class data set with 500 validation images (100 training
and 50 validation images per class), as class folders and as Hub Parquet (``prepare --format
parquet``); ``recipes/demo.toml`` trained on each (``--no-demo DIR``), one after the other; the
final top-1 of both. The target: within 4 points.

check: what the check of every row before the first step (``parquet.check_rows``) costs on one
real-sized file (``--rows`` rows of ``--row-bytes`` random bytes, row groups of 100, as
``datasets`` writes): with the footer's statistics (pyarrow and ``datasets`` write them), without
them on a local file (the label and image columns read), and without them at a ``local://`` URL
(the labels alone). Rows per second of each, best of ``--passes``.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
BATCH = 64


def make_data(workdir: Path, images: int, shard_mb: float) -> tuple[Path, Path]:
    """WORKDIR/shards-<MB>mb (``shards``'s) and WORKDIR/parquet-<MB>mb of WORKDIR/folder."""
    from benchmarks.cases.shards import make_data as folder_and_shards

    folder, shards = folder_and_shards(workdir, images, shard_mb)
    parquet = workdir / f"parquet-{shard_mb:g}mb"
    if not (parquet / "done").is_file():
        harness.prepare(folder, parquet, "--format", "parquet", "--shard-size", str(shard_mb))
        (parquet / "done").touch()
    return shards, parquet


def loader(shards, decode: bool):
    """The trainer's reader of ``shards`` (a ShardList): batches of decoded crops, or (without
    ``decode``) the encoded samples the sampler reads."""
    from torch.utils.data import DataLoader

    import imagenet.data.transforms as T
    from imagenet.data.shards.reader import ShardBatchSampler, ShardSamples

    sampler = ShardBatchSampler(shards, world_size=1, rank=0, batch_size=BATCH, shuffle=True,
                                seed=0, aug_seed=0)
    if not decode:
        return sampler
    return DataLoader(ShardSamples(T.train_transform(224), "tensor", 10, True),
                      batch_sampler=sampler, num_workers=0)


def one_pass(reader, epoch: int) -> tuple[int, float]:
    """(images, CPU seconds) of one epoch of ``reader``."""
    sampler = getattr(reader, "batch_sampler", reader)
    sampler.set_position(epoch, 0)
    start, n = time.process_time(), 0
    for batch in reader:  # decoded: (images, labels); read only: a list of samples
        n += len(batch[1]) if reader is not sampler else len(batch)
    return n, time.process_time() - start


def accuracy(args: argparse.Namespace) -> None:
    from imagenet.tools.demo import make_demo_dataset

    folder, parquet = args.workdir / "demo", args.workdir / "demo-parquet"
    make_demo_dataset(folder, train_per_class=100, val_per_class=50)
    if not (parquet / "done").is_file():
        harness.prepare(folder, parquet, "--format", "parquet")
        (parquet / "done").touch()
    top1 = {}
    for name, data in (("folder", folder), ("parquet", parquet)):
        out = args.workdir / f"run-{name}"
        start = time.perf_counter()
        harness.run_main([str(data), "--config", "recipes/demo.toml", "--no-demo",
                          "--output-dir", str(out), "--log-to", "none"], check=True, cwd=ROOT,
                         stdout=subprocess.DEVNULL)
        last = harness.last_metrics(out)
        top1[name] = last["val_acc1"]
        print(f"{name:>7}: top-1 {last['val_acc1']:.2f} % of {last['val_count']} validation "
              f"images after {last['epoch'] + 1} epochs ({time.perf_counter() - start:.0f} s)",
              flush=True)
    print(f"parquet - folder = {top1['parquet'] - top1['folder']:+.2f} points", flush=True)


def speed(args: argparse.Namespace) -> None:
    import torch

    from imagenet.data.shards.parquet import resolve_parquet
    from imagenet.data.shards.sources import resolve

    torch.set_num_threads(1)
    shard_dir, parquet_dir = make_data(args.workdir, args.images, args.shard_size)
    splits = {"shards": resolve(str(shard_dir), None, None).train,
              "parquet": resolve_parquet(str(parquet_dir), None).train}
    print(f"{args.images} images; shards: {len(splits['shards'].urls)} files, parquet: "
          f"{len(splits['parquet'].urls)} files ({args.shard_size:g} MB each)")
    for decode in (False, True):
        what = "decode + crop" if decode else "read only"
        rates: dict[str, list[float]] = {name: [] for name in splits}
        readers = {name: loader(split, decode) for name, split in splits.items()}
        for p_ in range(args.passes):
            for name, reader in readers.items():  # take turns
                n, cpu = one_pass(reader, p_)
                rates[name].append(n / cpu)
                print(f"{what:>13} pass {p_} {name:>7}: {n} images, {n / cpu:.0f} img/s per "
                      "CPU-second", flush=True)
        best = {name: max(r) for name, r in rates.items()}
        print(f"{what:>13}: shards {best['shards']:.0f} img/s, parquet {best['parquet']:.0f} "
              f"img/s per CPU-second: parquet/shards = {best['parquet'] / best['shards']:.3f} "
              "(best pass of each)", flush=True)


def check(args: argparse.Namespace) -> None:
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from imagenet.data.shards.parquet import check_rows, features, open_parquet
    from imagenet.tools.parquetwrite import ROW_GROUP, hub_metadata

    args.workdir.mkdir(parents=True, exist_ok=True)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image), ("label", pa.int64())],
                       metadata=hub_metadata([f"c{i}" for i in range(1000)]))
    paths = {}
    for statistics in (True, False):
        path = args.workdir / f"check-{args.rows}x{args.row_bytes}-{statistics}.parquet"
        paths[statistics] = path
        if path.is_file():
            continue
        with pq.ParquetWriter(path, schema, write_statistics=statistics) as writer:
            for start in range(0, args.rows, ROW_GROUP):
                n = min(ROW_GROUP, args.rows - start)
                rows = pa.array([{"bytes": os.urandom(args.row_bytes), "path": f"{start + i}.jpg"}
                                 for i in range(n)], image)
                labels = pa.array([(start + i) % 1000 for i in range(n)], pa.int64())
                writer.write_table(pa.table([rows, labels], schema=schema))
    size = paths[True].stat().st_size / 1e9
    print(f"{args.rows} rows of {args.row_bytes} bytes in row groups of {ROW_GROUP}: "
          f"{size:.2f} GB a file")
    cases = (("footer statistics, local", str(paths[True])),
             ("no statistics, local (labels + image bytes read)", str(paths[False])),
             ("no statistics, local:// URL (labels read)", f"local://{paths[False]}"))
    for name, url in cases:
        def check_file(url: str = url) -> None:
            file = open_parquet(url)
            check_rows(file, url, "train", features(file, url))

        best = harness.best_of(args.passes, check_file)
        print(f"{name:>50}: {best:.3f} s, {args.rows / best:,.0f} rows/s", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    p.add_argument("what", choices=("speed", "accuracy", "check"),
                   help="speed: loader img/s per core, Parquet vs tar shards; accuracy: the demo "
                        "recipe's top-1 on class folders vs their Parquet")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench_parquet"),
                   help="where the data sets and runs go, made once and reused "
                        "(default: /tmp/bench_parquet)")
    p.add_argument("--images", type=int, default=2000, help="training JPEGs (default: 2000)")
    p.add_argument("--shard-size", type=float, default=16.0, metavar="MB",
                   help="speed: the largest shard or Parquet file, megabytes (default: 16)")
    p.add_argument("--passes", type=int, default=3, help="epochs per reader (default: 3)")
    p.add_argument("--rows", type=int, default=50000, help="check: rows (default: 50000)")
    p.add_argument("--row-bytes", type=int, default=20000,
                   help="check: bytes of each row's image (default: 20000)")


def run(args: argparse.Namespace) -> None:
    {"speed": speed, "accuracy": accuracy, "check": check}[args.what](args)
