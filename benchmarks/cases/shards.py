"""Tar shards vs the ImageFolder they were written from: speed per loader core, a 100 Mbit/s
link, time to the first batch and the cost of a mid-epoch resume. Run by hand (not a test):

    python benchmarks/bench.py shards speed            # local disk, one core
    python benchmarks/bench.py shards resume           # first batch; mid-epoch resume
    python benchmarks/bench.py shards http             # as root: two namespaces, tbf 100mbit

The data: ``--images`` photo-like JPEGs of ImageNet sizes (~470x360, quality 90; 10 classes) in
``WORKDIR/folder`` and the shards ``prepare --from-folder`` writes of them (``--shard-size``
MB) in ``WORKDIR/shards``; made once and reused. Everything goes through the trainer's own
loaders (``build_data`` / ``build_shard_data``): decode, RandomResizedCrop 224 + flip, batches.

speed: images per CPU-second of one process with one thread and no loader workers (what one
loader core delivers), the files and the shards taking turns over ``--passes`` epochs with a
warm page cache; also the read alone (no decode).
resume: time from nothing to the first batch (2 workers); then a resume at the middle of an
epoch: time to its first batch, images decoded to get there, vs replaying the epoch up to there.
http: a server namespace (``python -m http.server``, optionally answering each request
``--delay-ms`` late, as object stores do: this kernel has no netem to delay packets) and a
client namespace joined by a veth pair whose server end is shaped by ``tc qdisc ... tbf rate
RATE``. The client's loader (2 workers) reads one epoch as shards, then as one request per
image; link use = bytes the server's veth sent x 8 / time / rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
SERVER, CLIENT, PORT = "10.202.0.1", "10.202.0.2", 8000
BATCH = 64


def make_data(workdir: Path, images: int, shard_mb: float) -> tuple[Path, Path]:
    """WORKDIR/folder (train: ``images`` JPEGs in 10 classes; val: 100) and WORKDIR/shards."""
    folder, shards = workdir / "folder", workdir / f"shards-{shard_mb:g}mb"
    if not (folder / "done").is_file():
        for split, count in (("train", images), ("val", 100)):
            for c in range(10):
                harness.write_photo_like_jpegs(folder / split / f"class{c}", count // 10,
                                               seed=1000 * c + (split == "val"))
        (folder / "done").touch()
    if not (shards / "_info.json").is_file():
        harness.prepare(folder, shards, "--shard-size", str(shard_mb))
    return folder, shards


def loaders(data: str, workers: int, world: int = 1):
    """The trainer's Data for ``data`` (a folder, shard folder or URL), one rank of ``world``."""
    import torch

    from imagenet.launching.process_group import DistInfo
    from imagenet.run.build import load_data
    from imagenet.settings.flags import parse_config
    from imagenet.settings.launch import Layout

    cfg = parse_config([data, "--seed", "0"])
    dist = DistInfo(0, 0, world, 1, torch.device("cpu"), "gloo")
    return load_data(cfg, dist, Layout(world, BATCH, 1, workers), data, aug_seed=0)


def epoch(loader, limit: int | None = None) -> tuple[int, float, float, float]:
    """(images, wall s, CPU s of this process, s to the first batch) of one pass."""
    start, cpu, first, n = time.perf_counter(), time.process_time(), None, 0
    for i, (images, _) in enumerate(loader):
        first = first or time.perf_counter() - start
        n += len(images)
        if limit is not None and i + 1 >= limit:
            break
    return n, time.perf_counter() - start, time.process_time() - cpu, first or 0.0


# ---------------------------------------------------------------- speed


def drop_cached(root: Path) -> None:
    """Evict the page cache of every file under ``root`` (ours only: others keep theirs)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def read_only(folder: Path, shards: Path) -> dict[str, float]:
    """Images/s of reading the bytes alone: one file each vs the shards' samples."""
    from imagenet.data.shards.streams import open_shard
    from imagenet.data.shards.tarreader import SampleReader

    files = sorted((folder / "train").rglob("*.jpg"))
    start = time.process_time()
    for path in files:
        path.read_bytes()
    files_rate = len(files) / (time.process_time() - start)
    tars, n = sorted(shards.glob("train-*.tar")), 0
    start = time.process_time()
    for tar in tars:
        reader = SampleReader(open_shard(str(tar)), str(tar), frozenset({"jpg", "cls"}))
        while reader.next() is not None:
            n += 1
        reader.close()
    return {"files": files_rate, "shards": n / (time.process_time() - start)}


def speed(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    folder, shards = make_data(args.workdir, args.images, args.shard_size)
    runs = {"ImageFolder": loaders(str(folder), 0), "shards": loaders(str(shards), 0)}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    walls: dict[str, list[float]] = {name: [] for name in runs}
    for data in runs.values():  # warm the code paths
        data.train.set_position(0, 0)
        epoch(data.train.loader, limit=5)
    for p in range(args.passes):
        for name, data in runs.items():  # take turns: slow phases hit both
            if args.cold:
                drop_cached(folder if name == "ImageFolder" else shards)
            data.train.set_position(p, 0)
            n, wall, cpu, _ = epoch(data.train.loader)
            rates[name].append(n / cpu)
            walls[name].append(n / wall)
            print(f"pass {p} {name:>11}: {n} images, {wall:.1f} s wall, {n / cpu:.1f} img/s "
                  f"per CPU-second", flush=True)
    best = {name: max(r) for name, r in rates.items()}
    raw = {"files": 0.0, "shards": 0.0}
    for _ in range(args.passes):
        if args.cold:
            drop_cached(folder)
            drop_cached(shards)
        raw = {k: max(v, raw[k]) for k, v in read_only(folder, shards).items()}
    cache = "cold page cache (each file's pages dropped before each pass)" if args.cold \
        else "warm page cache"
    print(f"\n{args.images} JPEGs, one process, one thread, no loader workers, {cache}; best "
          f"of {args.passes} epochs (decode + RandomResizedCrop 224 + flip, batches of {BATCH})")
    for name, rate in best.items():
        print(f"{name:>12}: {rate:7.1f} img/s per loader core (CPU time; by wall time: "
              f"{max(walls[name]):.1f} img/s)")
    print(f"shards / ImageFolder: {best['shards'] / best['ImageFolder']:.3f}")
    print(f"read alone (no decode, CPU time, best of {args.passes}): files {raw['files']:.0f} "
          f"img/s, shards {raw['shards']:.0f} img/s ({raw['shards'] / raw['files']:.2f}x)")


# ---------------------------------------------------------------- resume


def resume(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    folder, shards = make_data(args.workdir, args.images, args.shard_size)
    print("time to the first batch, 2 loader workers (build the data, start the workers, "
          "read and decode one batch):")
    for name, data_path in (("ImageFolder", folder), ("shards", shards)):
        start = time.perf_counter()
        data = loaders(str(data_path), 2)
        built = time.perf_counter() - start
        data.train.set_position(0, 0)
        _, _, _, first = epoch(data.train.loader, limit=1)
        print(f"{name:>12}: {built + first:.2f} s (building the data {built:.2f} s, first batch "
              f"{first:.2f} s)")
        del data
    data = loaders(str(shards), 0)
    half = data.train.batches // 2
    print(f"\nresume at batch {half} of {data.train.batches} ({half * BATCH} images done), no "
          "loader workers (so this process counts the decodes):")
    decodes, reads = data.train.dataset.stats, data.train.sampler.stats
    data.train.set_position(1, 0)
    _, _, _, at_start = epoch(data.train.loader, limit=1)
    data.train.set_position(1, half * BATCH)
    decoded, skipped, read = decodes.decoded, reads.skipped, reads.read
    _, _, _, first = epoch(data.train.loader, limit=1)
    print(f"  resume (skip): first batch in {first:.2f} s; {decodes.decoded - decoded} images "
          f"decoded; {reads.skipped - skipped} passed over by their tar headers, "
          f"{reads.read - read} read whole (the blocks of {data.train.sampler.layout['block']} "
          f"and reading ahead); the first batch of an epoch: {at_start:.2f} s")
    data.train.set_position(1, 0)
    n, wall, _, _ = epoch(data.train.loader, limit=half + 1)
    print(f"  replay (decode everything before it): first batch in {wall:.2f} s; {n} images "
          f"decoded ({wall / first:.0f}x the skip)")


# ---------------------------------------------------------------- http


def ip(*argv: str, check: bool = True) -> None:
    subprocess.run(["ip", *argv], check=check, capture_output=True)


@contextlib.contextmanager
def two_hosts(rate: str) -> Iterator[tuple[str, str, str]]:
    """(server namespace, client namespace, server veth end); the server end shaped by tbf."""
    tag = str(os.getpid())[-6:]
    server, client, ends = f"bsh{tag}s", f"bsh{tag}c", (f"vsh{tag}s", f"vsh{tag}c")
    try:
        for name in (server, client):
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for name, end, addr in ((server, ends[0], SERVER), (client, ends[1], CLIENT)):
            ip("link", "set", end, "netns", name)
            ip("-n", name, "addr", "add", f"{addr}/24", "dev", end)
            ip("-n", name, "link", "set", end, "up")
        subprocess.run(["ip", "netns", "exec", server, "tc", "qdisc", "replace", "dev", ends[0],
                        "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"],
                       check=True)
        yield server, client, ends[0]
    finally:
        for name in (server, client):
            ip("netns", "delete", name, check=False)


def sent_bytes(namespace: str, end: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", namespace, "cat",
                          f"/sys/class/net/{end}/statistics/tx_bytes"], capture_output=True,
                         text=True, check=True)
    return int(out.stdout)


def http(args: argparse.Namespace) -> None:
    folder, shards = make_data(args.workdir, args.images, args.shard_size)
    rate_bits = float(args.rate.removesuffix("mbit")) * 1e6
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rows = []
    with two_hosts(args.rate) as (server_ns, client_ns, end):
        for delay in args.delay_ms:
            srv = subprocess.Popen(["ip", "netns", "exec", server_ns, *harness.child_command(
                                    "shards", "_serve", str(args.workdir), str(delay))], env=env,
                                   stderr=subprocess.DEVNULL)  # resets when a read ends early
            time.sleep(2)
            try:
                for mode in ("shards", "files"):
                    sent = sent_bytes(server_ns, end)
                    out = subprocess.run(["ip", "netns", "exec", client_ns,
                                          *harness.child_command("shards", "_client", mode,
                                                                 str(folder), shards.name)],
                                         env=env, capture_output=True, text=True, check=True)
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    result.update(mode=mode, delay=delay, wire=sent_bytes(server_ns, end) - sent)
                    result["use"] = result["wire"] * 8 / result["seconds"] / rate_bits
                    rows.append(result)
                    print(json.dumps(result), flush=True)
            finally:
                srv.kill()
                srv.wait()
    megabytes = sum(p.stat().st_size for p in (folder / "train").rglob("*.jpg")) / 1e6
    print(f"\n{args.images} JPEGs ({megabytes:.0f} MB) over tbf {args.rate}; client: 2 loader "
          f"workers, batches of {BATCH}")
    print(f"{'reading':>22} {'delay':>6} {'images':>7} {'s':>7} {'img/s':>7} {'first batch':>12} "
          f"{'link use':>9} {'MB sent':>8}")
    for r in rows:
        name = "shards (streamed)" if r["mode"] == "shards" else "one request per image"
        print(f"{name:>22} {r['delay']:>4}ms {r['images']:>7} {r['seconds']:>7.1f} "
              f"{r['images'] / r['seconds']:>7.1f} {r['first']:>10.2f} s {100 * r['use']:>8.1f}% "
              f"{r['wire'] / 1e6:>8.1f}")


def serve(workdir: str, delay_ms: float) -> None:
    """``python -m http.server`` that answers each request ``delay_ms`` late."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(delay_ms / 1000)
            super().do_GET()

        def log_message(self, *args) -> None:
            pass

    ThreadingHTTPServer((SERVER, PORT), partial(Handler, directory=workdir)).serve_forever()


class HttpFolder:
    """ImageFolder over HTTP: one GET per image (the baseline)."""

    def __init__(self, folder: Path, transform) -> None:
        from torchvision.datasets.folder import find_classes, make_dataset

        classes, index = find_classes(str(folder / "train"))
        self.samples = [(f"http://{SERVER}:{PORT}/folder/train/"
                         f"{Path(p).relative_to(folder / 'train').as_posix()}", label)
                        for p, label in make_dataset(str(folder / "train"), index,
                                                     extensions=(".jpg",))]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        import urllib.request

        from imagenet.data import transforms as T

        url, label = self.samples[i]
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
        return self.transform(T.decode_image(data, url)), label


def client(mode: str, folder: Path, shards: str) -> None:
    """One epoch read over the link; prints a JSON line."""
    import torch
    from torch.utils.data import DataLoader

    from imagenet.data import transforms as T
    from imagenet.data.samplers import SeededDataset

    torch.set_num_threads(1)
    start = time.perf_counter()
    if mode == "shards":
        data = loaders(f"http://{SERVER}:{PORT}/{shards}", 2)
        data.train.set_position(0, 0)
        loader = data.train.loader
    else:
        dataset = HttpFolder(folder, T.train_transform(224))
        loader = DataLoader(SeededDataset(dataset, 0), batch_size=BATCH, num_workers=2,
                            sampler=[(0, i) for i in torch.randperm(len(dataset)).tolist()])
    n, _, _, first = epoch(loader)
    print(json.dumps({"images": n, "seconds": time.perf_counter() - start, "first": first}))


def child(argv: list[str]) -> None:
    """The http legs' processes (``harness.child_command("shards", ...)``): the server, a client."""
    if argv[:1] == ["_serve"]:
        return serve(argv[1], float(argv[2]))
    if argv[:1] == ["_client"]:
        return client(argv[1], Path(argv[2]), argv[3])
    raise SystemExit(f"bench.py shards: no helper process {argv[:1]}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    p.add_argument("what", choices=("speed", "resume", "http"),
                   help="speed: per loader core; resume: first batch and mid-epoch resume; "
                        "http: over a shaped link (root)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench_shards"),
                   help="data made here once and reused (default: %(default)s)")
    p.add_argument("--images", type=int, default=5000, help="training JPEGs (default: 5000)")
    p.add_argument("--shard-size", type=float, default=16.0, metavar="MB",
                   help="shard size for prepare, MB (default: 16: ~200 images, so that a "
                        "reader crosses many shards, as on ImageNet's 1,024)")
    p.add_argument("--passes", type=int, default=3, help="speed: epochs per reader")
    p.add_argument("--cold", action="store_true",
                   help="speed: drop the files' cached pages before each pass")
    p.add_argument("--rate", default="100mbit", help="http: tbf rate (default: 100mbit)")
    p.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="http: server answer delays to try, ms (default: 0 20)")


def run(args: argparse.Namespace) -> None:
    {"speed": speed, "resume": resume, "http": http}[args.what](args)
