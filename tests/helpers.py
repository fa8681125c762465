"""Shared test helpers: tiny models and data, JPEG ImageFolders, checkpoints, command lines,
subprocesses and gloo ranks. Fixtures live in conftest.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "main.py")
PRESTART = str(ROOT / "tests" / "prestart.py")
# Tiny, fast runs: 32 px crops, no loader workers unless a test asks. SMALL_ARCH (checkpoints of
# 3 MB) where a test's subject is not the model: a TINY run of 2 epochs is 9 s of process here,
# 13-18 s with resnet18 (86 MB checkpoints, each hashed and synced). TINY18 (resnet18) where a test
# reads resnet18's own parameters, sizes a disk by its checkpoint, runs --dummy (shufflenet's
# loss turns NaN on one repeated image) or compiles: docs/testing.md, "The model".
SMALL_ARCH = "shufflenet_v2_x0_5"
TINY = ["-a", SMALL_ARCH, "--train-crop-size", "32", "--val-resize-size", "36",
        "--val-crop-size", "32", "-b", "8", "-j", "0", "-p", "2", "--lr", "0.01"]
TINY18 = ["-a", "resnet18", *TINY[2:]]


def write_image_folder(root: Path, classes: int = 3, train_per_class: int = 8,
                       val_per_class: int = 3, size: int = 40) -> Path:
    """A real JPEG ImageFolder (train/ and val/) with one colour+pattern per class."""
    from PIL import Image, ImageDraw

    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                colour = ((70 * c + 40) % 256, (30 * c + 90 + 5 * i) % 256, (150 - 20 * c) % 256)
                img = Image.new("RGB", (size + i % 5, size), colour)
                draw = ImageDraw.Draw(img)
                draw.rectangle([i % 7, c * 5, i % 7 + 10, c * 5 + 10], fill=(255, 255, 255))
                img.save(folder / f"img{i}.jpg", quality=90)
    return root


def settled_folder(folder: Path) -> Path:
    """``folder`` once it is older than the folder index's settle time (``index.SETTLE_NS``), as
    a user's data set is: a folder changed within it of its listing is recorded as unsettled and
    listed again, silently, by the next start (which rewrites the index). A run forked from the
    pre-imported trainer starts well within it of ``write_image_folder``."""
    from imagenet.data.index import SETTLE_NS

    time.sleep(SETTLE_NS / 1e9 + 0.1)
    return folder


def child_env(*, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for subprocesses: the repo importable, few threads, no launcher leftovers.
    Built from ``base`` (the test process's environment now, by default)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "SLURM_",
                                "TORCHELASTIC_", "GLOO_SOCKET", "NCCL_SOCKET"))}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


# The test process's environment before any test ran: what a test's runs inherit unless the test
# sets a variable itself. The prestart server is started with it, not with the environment of
# the test that happens to start it first (a monkeypatched variable there made every later
# test's runs differ from the server's and start plainly).
SESSION_ENV = dict(os.environ)


def main_cmd(*args: str) -> list[str]:
    """The command line that runs main.py with ``args``."""
    return [sys.executable, MAIN, *args]


_prestart: dict[str, object] = {}


def prestarted_cmd(*args: str) -> list[str]:
    """The command line that runs main.py with ``args`` forked from a pre-imported trainer
    (tests/prestart.py): the same process a plain start makes, ~5 s of CPU sooner. For runs
    whose subject comes after start-up; a run whose environment differs in anything read at
    import starts plainly (prestart.RUNTIME_ONLY)."""
    if os.environ.get("IMAGENET_TEST_PLAIN_STARTS") == "1":
        return main_cmd(*args)
    if "socket" not in _prestart:
        import atexit
        import tempfile

        folder = tempfile.mkdtemp(prefix="prestart-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # after the server's kill
        sock = str(Path(folder) / "server")
        _prestart.update(socket=sock, server=start_prestart_server(sock))
        # Until it listens (~5 s of imports): a run started before would find no server and
        # start plainly, importing everything beside it.
        deadline = time.monotonic() + 120
        while not Path(sock).exists() and _prestart["server"].poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    return [sys.executable, PRESTART, "run", str(_prestart["socket"]), *args]


def start_prestart_server(sock: str) -> subprocess.Popen:
    """A prestart server listening at ``sock`` (once it has imported the trainer), with the
    session's environment (``SESSION_ENV``); killed when the test process exits."""
    import atexit

    log = open(Path(sock).with_suffix(".log"), "w")
    server = subprocess.Popen([sys.executable, PRESTART, "serve", sock],
                              env=child_env(base=SESSION_ENV), stdin=subprocess.DEVNULL,
                              stdout=log, stderr=log, cwd=ROOT, start_new_session=True)
    atexit.register(server.kill)
    return server


def run_group(proc: subprocess.Popen, pidfile: Path, within: float = 60) -> int:
    """The process group of the run that ``proc`` started (in a session of its own): ``proc``'s
    own for a plain start; for a ``prestarted_cmd``, the forked run's, whose pid the client
    writes to ``pidfile`` (given to it as ``IMAGENET_TEST_RUN_PIDFILE``). Signals meant for the
    run's group (SIGKILL, SIGSTOP, SLURM's SIGTERM) go there; the client is left alone."""
    if PRESTART not in proc.args:
        return proc.pid
    deadline = time.monotonic() + within
    while not pidfile.exists():
        if proc.poll() is not None:
            return proc.pid
        assert time.monotonic() < deadline, f"no pid in {pidfile} after {within} s"
        time.sleep(0.01)
    return int(pidfile.read_text())


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: its children, theirs, and so on (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_main(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
             cwd: Path | None = None, plain: bool = False) -> subprocess.CompletedProcess:
    """Run main.py with ``args``; returns the completed process (output captured as text).
    Started through the pre-imported trainer (``prestarted_cmd``) unless ``plain``: a test
    whose subject is start-up itself (imports, the first lines, timing) asks for a plain one."""
    cmd = main_cmd(*args) if plain else prestarted_cmd(*args)
    return subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout, env=env or child_env(), cwd=cwd or ROOT)


def run_parallel(commands: list[list[str]], envs: list[dict[str, str]], workdir: Path,
                 timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Start several commands at once (e.g. the ranks of one job) and wait for all of them.

    Output goes to files under ``workdir`` (no pipe can fill up and stall a rank). On timeout
    every command's whole process group (its spawned children too) is killed and the test fails.
    """
    import time

    workdir.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i, (cmd, env) in enumerate(zip(commands, envs)):
        out, err = open(workdir / f"cmd{i}.out", "w+"), open(workdir / f"cmd{i}.err", "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=ROOT,
                                      start_new_session=True))
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()
    results = []
    for cmd, p, (out, err) in zip(commands, procs, files):
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    assert not timed_out, f"timed out after {timeout}s:\n" + "\n".join(
        f"{r.args}\n{r.stdout}\n{r.stderr}" for r in results)
    return results


@cache
def private_mount_prefix() -> tuple[str, ...] | None:
    """``unshare`` arguments giving a command a mount namespace of its own, where it may mount
    a tmpfs (as root, or through a user namespace); None where neither is allowed."""
    for prefix in (("unshare", "-m"), ("unshare", "-rm")):
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                               capture_output=True)
        if shutil.which("unshare") and probe.returncode == 0:
            return prefix
    return None


def load_checkpoint(path: Path) -> dict:
    """A checkpoint as a user would load it: on the CPU, weights_only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_position(path: Path) -> tuple[int, int] | None:
    """(epoch, step_in_epoch) of the checkpoint at ``path``; None while there is none."""
    try:  # mmap: the small entries only
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError):
        return None
    return ckpt["epoch"], ckpt["step_in_epoch"]


def fault_at(point: str, hit: int, action: str) -> str:
    """An ``IMAGENET_FAILPOINTS`` entry (imagenet/settings/failpoints.py): ``action`` once, at
    the ``hit``-th time this process passes ``point`` (1: the first), nothing before or after.
    ``fault_at("train.step", 3, "sigterm")``: SIGTERM to itself once its third step is trained."""
    return f"{point}={hit - 1}*off->1*{action}"


def save_edited(ckpt: dict, path: Path) -> None:
    """Save a checkpoint edited by hand as a user would: without its (now stale) checksum."""
    torch.save({k: v for k, v in ckpt.items() if k != "checksum"}, path)


# ---------------------------------------------------------------- two hosts on one machine

MASTER, PEER = "10.200.0.1", "10.200.0.2"


class Unavailable(Exception):
    """What a test or a chaos scenario needs cannot be made on this machine (it says why)."""


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Two network namespaces joined by a veth pair, with MASTER and PEER: two hosts, one per
    rank (``on_host``); removed on leaving the ``with``. Unavailable without root or iproute2."""

    made = 0  # pairs made by this process: their names are unique to it

    def __init__(self, prefix: str = "imgnt") -> None:
        TwoHosts.made += 1
        tag = f"{os.getpid() % 100000:05d}{TwoHosts.made % 1000:03d}"
        self.names = [f"{prefix}{tag}{side}" for side in "ab"]
        self.ends = [f"v{prefix[:3]}{tag}{side}" for side in "ab"]  # at most 15 characters
        self.port = 29500  # the last rendezvous port used there (each run takes the next)

    def __enter__(self) -> TwoHosts:
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        if shutil.which("ip") is None or ip("netns", "list").returncode != 0:
            raise Unavailable("`ip netns` (iproute2) is not available")
        steps = [("netns", "add", self.names[0]), ("netns", "add", self.names[1]),
                 ("link", "add", self.ends[0], "type", "veth", "peer", "name", self.ends[1])]
        for name, end, addr in zip(self.names, self.ends, (MASTER, PEER)):
            steps += [("link", "set", end, "netns", name),
                      ("-n", name, "addr", "add", f"{addr}/24", "dev", end),
                      ("-n", name, "link", "set", end, "up"),
                      ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            result = ip(*step)
            if result.returncode != 0:
                self.__exit__()
                raise Unavailable(f"cannot build the namespaces (ip {' '.join(step)}): "
                                  f"{result.stderr.strip()}")
        return self

    def __exit__(self, *_: object) -> None:
        for name in self.names:
            ip("netns", "delete", name)  # deletes the veth end inside it too
        ip("link", "delete", self.ends[0])  # in case it never moved into its namespace

    def link(self, up: bool) -> subprocess.CompletedProcess:
        """Bring the link between the hosts up or down (at the peer's end)."""
        return ip("-n", self.names[1], "link", "set", self.ends[1], "up" if up else "down")

    def on_host(self, rank: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on host ``rank``: in its namespace, under a host name of its own (two
        machines to a run: neither may signal the other's processes)."""
        own_name = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"host{rank}"]
        return ["ip", "netns", "exec", self.names[rank], *own_name, *cmd]


# ---------------------------------------------------------------- tiny models and data


def tiny_net(widths: tuple[int, ...] = (8,), classes: int = 3, bn: bool = False,
             pool: int = 1) -> nn.Module:
    """Stride-2 3x3 convs of ``widths`` channels (each optionally with BatchNorm), ReLU, adaptive
    pooling to ``pool`` x ``pool`` and a linear classifier; the same weights in every process."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 3
    for out in widths:
        layers.append(nn.Conv2d(width, out, 3, stride=2, padding=1))
        if bn:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU())
        width = out
    layers += [nn.AdaptiveAvgPool2d(pool), nn.Flatten(), nn.Linear(width * pool * pool, classes)]
    return nn.Sequential(*layers)


class StripedImages(Dataset):
    """uint8 CHW images whose class is faint stripes (channel and orientation) under noise: a
    stand-in for a decoded image folder that a tiny net can learn."""

    def __init__(self, n: int, classes: int = 3, size: int = 32, seed: int = 99) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (n,), generator=g)
        noise = torch.randint(0, 160, (n, 3, size, size), generator=g)
        stripes = (torch.arange(size) // 4 % 2 * 60).view(1, -1)
        for i, c in enumerate(self.labels.tolist()):
            noise[i, c % 3] += stripes.T if c % 2 else stripes
        self.images = noise.clamp(0, 255).to(torch.uint8)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])


def uint8_batches(n: int, batch: int, size: int = 16, seed: int = 0
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of ``StripedImages`` as a loader would yield them."""
    data = StripedImages(n * batch, size=size, seed=seed)
    return [(data.images[i:i + batch], data.labels[i:i + batch])
            for i in range(0, n * batch, batch)]


def tiny_engine(model: nn.Module, *flags: str, steps: int, world: int = 1, batch: int = 8,
                classes: int = 3, device: str = "cpu"):
    """The trainer's own engine (optim.build_engine) for ``model`` from main.py ``flags``."""
    from imagenet.settings.flags import parse_config
    from imagenet.settings.launch import Layout
    from imagenet.training.models import unwrap
    from imagenet.training.optim import build_engine

    cfg = parse_config(["data", *flags])
    layout = Layout(world, batch, cfg.grad_accum_steps, 0)
    return build_engine(cfg, unwrap(model), model, torch.device(device), layout, steps, classes)


# ---------------------------------------------------------------- gloo ranks

# What a forkserver imports once per test process, before it forks the ranks (start_ranks).
PRELOAD = ["torch", "torchvision", "torch.distributed", "imagenet.launching.process_group",
           "imagenet.settings.plan", "imagenet.run.trainer", "imagenet.run.build",
           "imagenet.evaluation.validate", "torch.utils.tensorboard"]


def start_ranks(fn, args: tuple = (), nprocs: int = 2, join: bool = True,
                env: dict[str, str] | None = None):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join)`` for a test's own ranks
    (``fn(rank, *args)``, module-level), forked from a forkserver: one per test process, which
    imported torch and the trainer once (``PRELOAD``), so a rank imports nothing again (a
    spawned one pays ~2.5 s of CPU). Each rank runs in the caller's environment (or ``env``)
    and working folder of now, as a spawned child would, not in the forkserver's. How main.py
    starts its own processes is tested with main.py's mp.spawn, never through here."""
    import multiprocessing

    import torch.multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)
    return torch.multiprocessing.start_processes(
        _as_the_caller, args=(fn, dict(os.environ if env is None else env), os.getcwd(), *args),
        nprocs=nprocs,
        join=join, start_method="forkserver")


def _as_the_caller(rank: int, fn, env: dict[str, str], cwd: str, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(1)  # as a run's ranks (OMP_NUM_THREADS=1): several ranks share 2 cores
    fn(rank, *args)


def join_gloo(rank: int, world: int, port: int):
    """Join a real gloo process group on loopback through imagenet.launching.process_group (as
    main.py does); returns its DistInfo. For the body of a test's ranks (start_ranks)."""
    import torch

    from imagenet.launching.process_group import init_distributed
    from imagenet.settings.flags import parse_config
    from imagenet.settings.plan import make_plan

    torch.set_num_threads(1)
    cfg = parse_config(["data", "--dist-url", f"tcp://127.0.0.1:{port}", "--world-size",
                        str(world), "--rank", str(rank), "--dist-timeout", "120"])
    info = init_distributed(make_plan(cfg, {}, 0))
    assert (info.rank, info.world_size, info.backend) == (rank, world, "gloo")
    return info


def gloo_rank_saving(rank: int, world: int, port: int, out: Path, compute) -> None:
    """A rank (start_ranks): join gloo, save ``compute(info)`` to ``out/rank{rank}.pt``, leave
    together. ``compute`` must be a module-level function (the ranks unpickle it by name)."""
    import datetime

    import torch
    import torch.distributed as dist

    from imagenet.launching.process_group import cleanup

    info = join_gloo(rank, world, port)
    try:
        torch.save(compute(info), out / f"rank{rank}.pt")
        dist.barrier(timeout=datetime.timedelta(seconds=60))
    finally:
        cleanup()


def device_images_match(shards, batch: int = 8) -> tuple[int, int]:
    """--decode-on-device on tar shards or Parquet (a ``ShardSet``): the workers ship each
    sample's JPEG bytes with the crop box the CPU path draws from the same per-sample seed;
    decoded and cropped on the device (the CPU here), every image of two training epochs and of
    validation must equal the CPU path's, with its label. Returns the images compared (train,
    val)."""
    import torch

    from imagenet.data import device
    from imagenet.data.folder import build_transforms
    from imagenet.data.shards.reader import ShardBatchSampler, ShardSamples
    from imagenet.settings.flags import parse_config
    from imagenet.settings.images import crop_schedule

    cfg = parse_config(["data", "--train-crop-size", "24", "--val-resize-size", "30",
                        "--val-crop-size", "24", "--train-crop-scale", "0.2"])
    crops = crop_schedule(cfg)
    cpu_tfs, enc_tfs, finish = build_transforms(cfg, crops), device.item_transforms(cfg, crops), \
        device.device_crops(cfg)
    classes = len(shards.classes)
    seen = []
    for i, (split, train) in enumerate(((shards.train, True), (shards.val, False))):
        cpu = ShardSamples(cpu_tfs[i], "tensor", classes, train=train)
        enc = ShardSamples(enc_tfs[i], "tensor", classes, train=train, encoded=True)
        count = 0
        for epoch in (0, 1) if train else (0,):
            sampler = ShardBatchSampler(split, world_size=1, rank=0, batch_size=batch,
                                        shuffle=train, seed=3, aug_seed=5)
            sampler.set_position(epoch, 0)
            for items in sampler:
                want = [cpu[item] for item in items]
                encoded = device.collate([enc[item] for item in items])
                assert encoded[0].boxes[:, 0].min() >= 0  # JPEG bytes, not finished images
                got, labels = finish[i](encoded, torch.device("cpu"))
                assert got.shape == (len(items), 3, 24, 24)
                assert torch.equal(got, torch.stack([image for image, _ in want])), (epoch,
                                                                                     split.urls)
                assert labels.tolist() == [label for _, label in want]
                count += len(items)
        seen.append(count)
    return seen[0], seen[1]


def device_path_trains_the_same(data: Path, out: Path, *flags: str) -> None:
    """Seeded runs of main.py on ``data`` through the CPU path and the device path (on the CPU:
    2 loader workers shipping JPEG bytes, decoded and cropped in the training process) end
    with the same weights and accuracy."""
    import torch

    got = {}
    for mode, workers in (("off", "0"), ("on", "2")):
        proc = run_main(str(data), *flags, "--epochs", "2", "--seed", "3", "-j", workers,
                        "--decode-on-device", mode, "--output-dir", str(out / mode))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("decoded and cropped on cpu" in proc.stdout) == (mode == "on"), proc.stdout
        assert "waiting for data" in proc.stdout  # the epoch summary
        got[mode] = load_checkpoint(out / mode / "checkpoint.pth.tar")
    for name, value in got["off"]["state_dict"].items():
        assert torch.equal(value, got["on"]["state_dict"][name]), name
    assert got["off"]["best_acc1"] == got["on"]["best_acc1"]
