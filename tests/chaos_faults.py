"""The faults of the chaos matrix beside kills and SIGTERMs (tests/chaos.py draws them and checks
their outcome; docs/chaos.md): how each is injected into a real run, and what is observed.

- hang: a rank (or, at one process, its loader worker) stopped with SIGSTOP;
- full disk: the output folder a tmpfs in a private mount namespace, filled while the run trains;
- damaged: checkpoint.pth.tar replaced by a copy with bytes flipped, or cut short;
- lost link: two hosts (network namespaces joined by a veth pair), the link taken down;
- slow storage: a ``sitecustomize.py`` that throttles the checkpoint writer's file writes (fault
  injection written by the harness into the scenario's folder, never part of the trainer).
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import sys
from functools import cache
from pathlib import Path

import torch
from helpers import MASTER, TwoHosts, private_mount_prefix

from imagenet.checkpoint import files
from imagenet.errors import CheckpointError

# ---------------------------------------------------------------- the processes of a run


def processes(token: str) -> list[tuple[int, dict[str, str], str]]:
    """(pid, environment, command line) of the live (not zombie) processes whose CHAOS_TOKEN is
    ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            if f"CHAOS_TOKEN={token}".encode() not in environ:
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in environ.decode(errors="replace").split("\0")
                   if "=" in item)
        found.append((int(entry.name), env, cmdline))
    return found


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def rank_pid(token: str, launcher: str, rank: int, main_pid: int) -> int | None:
    """The training process of ``rank``: the launcher's own process at one process; torchrun's
    worker with that RANK (its loader workers inherit it: the lowest pid); mp.spawn's children
    in the order they started (running spawn_main; their loader workers are their children)."""
    if launcher == "single":
        return main_pid
    found = processes(token)
    if launcher == "torchrun":
        ranks = sorted(pid for pid, env, cmdline in found
                       if env.get("RANK") == str(rank) and "main.py" in cmdline)
        return ranks[0] if ranks else None
    spawned = {pid for pid, _, cmdline in found if "spawn_main" in cmdline}
    ranks = sorted(pid for pid in spawned if parent(pid) not in spawned)
    return ranks[rank] if len(ranks) > rank else None


def worker_pid(token: str, trainer: int) -> int | None:
    """A loader worker of the training process ``trainer`` (forked: the same command line); the
    first started (the training loader's) when there are several."""
    found = processes(token)
    cmdlines = {pid: cmdline for pid, _, cmdline in found}
    workers = sorted(pid for pid, _, cmdline in found
                     if parent(pid) == trainer and cmdlines.get(trainer) == cmdline)
    return workers[0] if workers else None


def stop(token: str, launcher: str, rank: int, worker: bool, main_pid: int) -> str:
    """SIGSTOP rank ``rank``'s process (or its loader worker); what was stopped."""
    pid = rank_pid(token, launcher, rank, main_pid)
    if pid is not None and worker:
        pid = worker_pid(token, pid)
    if pid is None:
        return f"nothing stopped (no {'loader worker of ' * worker}rank {rank} found)"
    os.kill(pid, signal.SIGSTOP)
    return f"SIGSTOP to {'the loader worker of ' * worker}rank {rank} (pid {pid})"


# ---------------------------------------------------------------- no lost checkpoint


class Pin:
    """The checkpoint in place when a fault fired, held open: checkpoints are replaced, never
    edited, so the open file keeps the bytes that were whole then, whatever happens next."""

    def __init__(self) -> None:
        self.file: io.BufferedReader | None = None

    def take(self, path: Path) -> None:
        try:
            self.file = open(path, "rb")  # noqa: SIM115 (held until ``global_step``)
        except OSError:
            self.file = None

    def global_step(self) -> int | None:
        """The pinned checkpoint's global step (None: there was none)."""
        if self.file is None:
            return None
        with self.file:
            ckpt = torch.load(io.BytesIO(self.file.read()), map_location="cpu",
                              weights_only=True)
        return ckpt.get("global_step")


def lost_checkpoint(pinned: int | None, path: Path) -> str | None:
    """What was lost, when ``path`` (after the fault) does not load with its checksum or is
    older than the checkpoint complete when the fault fired (``pinned``, its global step)."""
    if pinned is None:
        return None
    try:
        now = files.load_checkpoint(path).get("global_step")
    except CheckpointError as exc:
        return f"lost checkpoint: the one written before the fault (step {pinned}) is gone: {exc}"
    if now is None or now < pinned:
        return f"lost checkpoint: {path.name} is at step {now}, older than the one complete " \
            f"when the fault fired (step {pinned})"
    return None


def finished_whole(out: Path, epochs: int) -> list[str]:
    """What is not whole in the folder of a run that exited 0 (after a full disk: the disk
    filled after its last write, or a write failed unnoticed): its checkpoint and best file
    load with their checksums, the checkpoint has trained every epoch, metrics.jsonl has each
    epoch once."""
    bad = []
    for path in (out / files.CHECKPOINT, out / files.BEST):
        try:
            ckpt = files.load_checkpoint(path)
        except CheckpointError as exc:
            bad.append(f"exit 0, but {path.name} does not load: {exc}")
            continue
        if path.name == files.CHECKPOINT and ckpt.get("epoch") != epochs:
            bad.append(f"exit 0, but {path.name} is at epoch {ckpt.get('epoch')} of {epochs}")
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        logged = [json.loads(line).get("epoch") for line in lines]
    except (OSError, ValueError) as exc:
        logged = [f"unreadable: {exc}"]
    if logged != list(range(epochs)):
        bad.append(f"exit 0, but metrics.jsonl has epochs {logged}")
    return bad


# ---------------------------------------------------------------- hang

def hang_report(out: Path, rank: int | None) -> list[str]:
    """The problems with OUTPUT_DIR/hang/report.json: missing, or not naming ``rank`` (None:
    any rank, as on a lost link, where each side finds the other silent)."""
    path = out / "hang" / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [f"no hang report ({path}: {exc})"]
    if rank is not None and report.get("rank") != rank:
        return [f"the hang report names rank {report.get('rank')}, the stopped one is {rank}"]
    if rank is None and report.get("silent") is not True:
        return [f"the hang report does not name a silent rank: {report.get('message')}"]
    return []


# ---------------------------------------------------------------- full disk

FILLER = ".chaos-filler"
DISK_MB = 64  # the tmpfs: room for the checkpoints (about 6 MB each) that the run asks for


@cache
def full_disk_problem() -> str | None:
    """Why a private tmpfs cannot be mounted here (None: it can)."""
    return None if private_mount_prefix() else "cannot mount a tmpfs (needs root or user " \
        "namespaces)"


def on_tmpfs(cmd: list[str], out: Path, keep: Path) -> list[str]:
    """``cmd`` run with ``out`` a fresh tmpfs of DISK_MB in a mount namespace of its own; when it
    has ended, what it left there (the filler aside, as the user frees the space) is copied
    to ``keep``, hard links, times and all."""
    script = (f'mount -t tmpfs -o size={DISK_MB}m tmpfs "$0" || exit 97\n'
              '"$@" & pid=$!\n'
              'wait $pid; code=$?\n'
              f'rm -f "$0/{FILLER}"; cp -a "$0/." "{keep}/" || exit 96\n'
              'exit $code')
    return [*private_mount_prefix(), "sh", "-c", script, str(out), *cmd]


def seen_by(pid: int, path: Path) -> Path:
    """``path`` as process ``pid`` sees it (inside its mount namespace)."""
    return Path(f"/proc/{pid}/root") / path.resolve().relative_to("/")


def fill(folder: Path, leave: int) -> str:
    """Fill the file system of ``folder`` but ``leave`` bytes; what was done."""
    st = os.statvfs(folder)
    want = max(st.f_bavail * st.f_frsize - leave, 0)
    written, chunk = 0, 1 << 20
    fd = os.open(folder / FILLER, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while written < want and chunk >= 4096:
            try:
                written += os.write(fd, bytes(min(chunk, want - written)))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk //= 16
    finally:
        os.close(fd)
    return f"disk filled ({written / 1e6:.0f} MB written, {leave / 1e6:.0f} MB left)"


def move_back(keep: Path, out: Path) -> None:
    """What the tmpfs held, into the real output folder (same file system as ``keep``)."""
    for entry in keep.iterdir():
        os.replace(entry, out / entry.name)
    keep.rmdir()


# ---------------------------------------------------------------- damaged

def damage(path: Path, how: str) -> None:
    """Replace ``path`` with a damaged copy, as a bad copy or a cut transfer leaves it: 16 bytes
    in the middle flipped, or the second half cut off. A new file: its hard links (model_best
    may be one) stay whole."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    if how == "flip":
        data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    else:
        del data[middle:]
    tmp = path.with_name(".chaos-damaged")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def intact_fallbacks(out: Path) -> dict[Path, dict]:
    """The older checkpoints of ``out`` that load whole (the history, the best file), and
    where each is (epoch, step_in_epoch, global_step): what --resume auto may fall back to."""
    found = {}
    for path in [out / files.BEST, *out.glob(files.EPOCH_PATTERN)]:
        try:
            ckpt = files.load_checkpoint(path)
        except CheckpointError:
            continue
        found[path] = {k: ckpt.get(k) for k in ("epoch", "step_in_epoch", "global_step")}
    return found


# ---------------------------------------------------------------- slow storage

SLOW_STORAGE = '''"""FAULT INJECTION by tests/chaos.py (slow storage): not part of the trainer.

The chaos harness wrote this file into a scenario's folder and put that folder first on
PYTHONPATH for the run it slows down. When the trainer imports imagenet.checkpoint.files, every
write of a checkpoint's bytes (torch.save's file object, ``_WriteErrors.write``) first sleeps
as long as a disk of CHAOS_SLOW_STORAGE_MBPS MB/s would take: a checkpoint's temp file exists
for seconds, as on a slow network file system.
"""

import os
import sys
import time

RATE = float(os.environ["CHAOS_SLOW_STORAGE_MBPS"]) * 1e6  # bytes per second
TARGET = "imagenet.checkpoint.files"


def throttle(module):
    write = module._WriteErrors.write

    def slow_write(self, data):
        time.sleep(len(data) / RATE)
        return write(self, data)

    module._WriteErrors.write = slow_write
    sys.stderr.write(f"[chaos fault injection] checkpoint writes at {RATE / 1e6:g} MB/s "
                     f"(pid {os.getpid()})\\n")


class ThrottleOnImport:
    """Finds TARGET with the other finders and throttles it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    throttle(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


sys.meta_path.insert(0, ThrottleOnImport())
'''
SLOW_STORAGE_LINE = "[chaos fault injection] checkpoint writes at"


def slow_storage_env(folder: Path, mbps: float, root: Path) -> dict[str, str]:
    """The environment of a run whose checkpoint writes go at ``mbps`` MB/s (``folder`` gets the
    sitecustomize.py that does it)."""
    inject = folder / "fault-injection"
    inject.mkdir(parents=True, exist_ok=True)
    (inject / "sitecustomize.py").write_text(SLOW_STORAGE)
    return {"PYTHONPATH": f"{inject}{os.pathsep}{root}", "CHAOS_SLOW_STORAGE_MBPS": str(mbps)}


# ---------------------------------------------------------------- lost link

# Both hosts' processes, started at once by one process (a Leg follows one command); it exits
# with their common exit code, 98 when they differ (the line before says which).
HOSTS_RUNNER = """import json, subprocess, sys
procs = [subprocess.Popen(cmd) for cmd in json.loads(sys.argv[1])]
codes = [p.wait() for p in procs]
print(f"[chaos: the hosts exited {codes}]", flush=True)
sys.exit(codes[0] if len(set(codes)) == 1 and codes[0] >= 0 else 98)
"""


def on_two_hosts(hosts: TwoHosts, per_rank: list[list[str]]) -> list[str]:
    """One command that runs ``per_rank[r]`` (main.py's command line but the rendezvous) as
    rank r on host r of ``hosts``, the ranks joining at a port of their own."""
    hosts.port += 1
    cmds = [hosts.on_host(rank, [*args, "--dist-url", f"tcp://{MASTER}:{hosts.port}",
                                 "--world-size", str(len(per_rank)), "--rank", str(rank)])
            for rank, args in enumerate(per_rank)]
    return [sys.executable, "-c", HOSTS_RUNNER, json.dumps(cmds)]


def take_link(hosts: TwoHosts, up: bool) -> str:
    """Bring the hosts' link up or down; what was done."""
    result = hosts.link(up)
    return f"link {'up' if up else 'down'}" + \
        (f" FAILED: {result.stderr.strip()}" if result.returncode else "")
