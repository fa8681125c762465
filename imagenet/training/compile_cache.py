"""--compile's compiled graphs kept where a requeued job finds them (--cache-dir, by default
OUTPUT_DIR/cache/compile/), so that it compiles nothing it compiled before.

Each process compiles into a fresh folder of its own on this node (``TORCHINDUCTOR_CACHE_DIR``:
inductor's FX graph cache, AOTAutograd's cache, the C++ or Triton kernels they load). After a
step or an epoch that compiled something, and when a signal stops the run, rank 0 packs what
appeared since into one archive per training crop size (``graphs-<PX>px-<sha>.tar``: a
progressive-resizing run keeps one per size; validation's graphs go with the crop size whose
epoch compiled them) and names it, with its SHA-256, in ``manifest.json``. Only finished
compilations are packed (nothing compiles between steps), a new archive is written before the
manifest names it and the manifest is replaced atomically, so a kill at any moment leaves a
consistent cache.

A start with --compile reads the manifest: when it was made for this torch, device and model
(``signature``: what the graphs depend on) and every archive's checksum holds, the archives are
unpacked into the new folder and inductor finds its graphs there (a cache hit per graph: Dynamo
still traces the model, nothing is compiled). Otherwise one line says why, nothing is used, and
this run's graphs replace the old ones. Inductor keys each graph by its code, shapes, torch
version and settings, so a graph the signature did not foresee is compiled, never mistaken.
The CPU kernels are built for this CPU's instruction set (-march=native): the CPU model and its
flags are part of the signature. A process killed before its end leaves its work folder in the
temp folder: the next start on that node removes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch

import imagenet.launching.watchdog as watchdog
from imagenet.settings import devices
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout

log = logging.getLogger(__name__)

ENV = "TORCHINDUCTOR_CACHE_DIR"
SUBFOLDER = "compile"
MANIFEST = "manifest.json"
FORMAT, VERSION = "imagenet-trainer compiled graphs", 1
SKIPPED = ("locks",)  # inductor's lock files: not part of a compiled graph
WORK_PREFIX = "imagenet-compile-"  # this process's folder: WORK_PREFIX<pid>-<random>


def device_name(device: torch.device) -> str:
    """The device the kernels are built for: the GPU and its compute capability, or the CPU's
    model and a digest of its instruction-set flags."""
    if device.type != "cpu":  # a GPU and its capability; another accelerator's kernels: its type's
        return devices.name(device)
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = info.get("model name") or platform.processor()
    flags = info.get("flags") or info.get("Features")
    digest = f" (flags {hashlib.sha1(flags.encode()).hexdigest()[:8]})" if flags else ""
    return f"{platform.machine()} {model}{digest}"


def environment(device: torch.device) -> dict[str, Any]:
    """What every compiled graph depends on besides the model: torch, the toolchain, the
    device."""
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "device": device_name(device)}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    return env


class CompileCache:
    """This process's compile folder and the run's archives of it (rank 0 writes them)."""

    def __init__(self, place: Path, work: Path, made_for: dict[str, Any], writes: bool) -> None:
        self.place, self.work, self.made_for, self.writes = place, work, made_for, writes
        self.sizes: dict[str, dict[str, Any]] = {}  # crop size -> manifest entry (archives)
        self.owned: dict[str, set[str]] = {}  # crop size -> files of its archive
        self.known: set[str] = set()  # files already packed or unpacked
        self.reused: list[str] = []  # crop sizes whose graphs were unpacked
        self._saved_misses = graph_cache_counts()["misses"]

    # ---- start

    def reuse(self) -> str:
        """Unpack the archives that fit this run; the start-up line saying what happened."""
        manifest = self.place / MANIFEST
        try:
            saved = json.loads(manifest.read_text())
        except (FileNotFoundError, NotADirectoryError):
            return (f"=> --compile: no compiled graphs in {self.place} yet; this start's are "
                    "kept there for the next one")
        except (OSError, ValueError) as exc:
            return self._not_used(f"its manifest is unreadable ({type(exc).__name__})")
        if not isinstance(saved, dict) or saved.get("format") != FORMAT or \
                saved.get("version") != VERSION or not isinstance(saved.get("sizes"), dict):
            return self._not_used("its manifest is damaged or of another version")
        if saved.get("made_for") != self.made_for:
            return self._not_used("they were made for "
                                  + differences(saved.get("made_for"), self.made_for))
        damaged = []
        for size, entry in sorted(saved["sizes"].items(), key=lambda kv: int(kv[0])):
            try:
                names = self._unpack(entry)
            except (OSError, KeyError, TypeError, ValueError, tarfile.TarError) as exc:
                damaged.append(f"{size} px ({type(exc).__name__}: {exc})")
                continue
            self.sizes[size], self.owned[size] = entry, names
            self.known |= names
            self.reused.append(size)
        files = len(self.known)
        size_mb = sum(int(e.get("bytes", 0)) for e in self.sizes.values()) / 1e6
        lines = []
        if self.reused:
            lines.append(f"=> --compile: reusing the graphs compiled for crop size(s) "
                         f"{', '.join(self.reused)} px from {self.place} ({files} files, "
                         f"{size_mb:.1f} MB): compiled graphs are loaded, not compiled again")
        if damaged:
            lines.append(f"=> --compile: the graphs for {'; '.join(damaged)} in {self.place} "
                         "are damaged: not used; compiling them again")
        return "\n".join(lines)

    def _not_used(self, why: str) -> str:
        return (f"=> --compile: the compiled graphs in {self.place} are not used: {why}; "
                "compiling again, and this run's graphs replace them")

    def _unpack(self, entry: dict[str, Any]) -> set[str]:
        """Check an archive's checksum, unpack it into the work folder; its file names."""
        path = self.place / str(entry["archive"])
        if Path(entry["archive"]).name != entry["archive"]:
            raise ValueError("archive names a path outside the cache")
        if sha256_of(path) != entry["sha256"]:
            raise ValueError("checksum mismatch")
        with tarfile.open(path) as tar:
            names = {m.name for m in tar.getmembers() if m.isfile()}
            tar.extractall(self.work, filter="data")
        return names

    # ---- saving

    def files(self) -> set[str]:
        """The work folder's finished files (inductor writes a temporary dot-file and renames
        it), relative paths."""
        found = set()
        for path in self.work.rglob("*"):
            rel = path.relative_to(self.work)
            if rel.parts[0] in SKIPPED or any(p.startswith(".") for p in rel.parts):
                continue
            if path.is_file() and not path.is_symlink():
                found.add(rel.as_posix())
        return found

    def save(self, crop_size: int) -> str | None:
        """Pack what was compiled since the last save into ``crop_size``'s archive and name it
        in the manifest (rank 0; nothing new: nothing done). The line saying so, or None."""
        if not self.writes:
            return None
        new = self.files() - self.known
        if not new:
            return None
        size = str(crop_size)
        names = self.owned.get(size, set()) | new
        self.place.mkdir(parents=True, exist_ok=True)
        tmp = self.place / f".graphs-{size}px.tmp-{os.getpid()}"
        try:
            with tarfile.open(tmp, "w") as tar:
                for name in sorted(names):
                    tar.add(self.work / name, arcname=name, recursive=False)
            digest = sha256_of(tmp)
            archive = f"graphs-{size}px-{digest[:12]}.tar"
            entry = {"archive": archive, "sha256": digest, "files": len(names),
                     "bytes": tmp.stat().st_size}
            os.replace(tmp, self.place / archive)
        finally:
            tmp.unlink(missing_ok=True)
        self.sizes[size], self.owned[size] = entry, names
        self.known |= new
        self._write_manifest()
        return (f"=> --compile: kept {len(new)} newly compiled file(s) for crop size {size} px "
                f"in {self.place} (its archive: {entry['bytes'] / 1e6:.1f} MB): a restart loads "
                "them")

    def _write_manifest(self) -> None:
        """The manifest naming the current archives (atomically), then the others removed."""
        payload = {"format": FORMAT, "version": VERSION, "made_for": self.made_for,
                   "sizes": self.sizes}
        tmp = self.place / f".{MANIFEST}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        os.replace(tmp, self.place / MANIFEST)
        current = {entry["archive"] for entry in self.sizes.values()}
        for old in self.place.glob("graphs-*.tar"):
            if old.name not in current:
                old.unlink(missing_ok=True)

    def save_if_compiled(self, crop_size: int) -> None:
        """``save`` when inductor compiled a graph since the last one (a cache miss): after a
        step, an epoch's validation, a stop. Between steps nothing is being compiled."""
        missed = graph_cache_counts()["misses"]
        if missed == self._saved_misses:
            return
        self._saved_misses = missed
        try:
            with watchdog.paused(f"keeping the compiled graphs in {self.place} (--compile)"):
                line = self.save(crop_size)
        except OSError as exc:  # a full or read-only cache folder must not stop training
            log.warning("=> --compile: cannot keep the compiled graphs in %s (%s): a restart "
                        "compiles them again", self.place, exc.strerror or exc)
            return
        if line:
            log.info("%s", line)

    def close(self) -> None:
        """Remove this process's work folder; torch's own cache folder again."""
        if os.environ.get(ENV) == str(self.work):
            del os.environ[ENV]
        shutil.rmtree(self.work, ignore_errors=True)


def sha256_of(path: Path) -> str:
    """A file's SHA-256, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def differences(saved: Any, now: dict[str, Any]) -> str:
    """What differs between two signatures, as 'torch 2.13.0 (now 2.14.1), ...'."""
    if not isinstance(saved, dict):
        return "an unknown model"
    changed = [f"{k} {saved.get(k)} (now {now.get(k)})" for k in sorted(set(saved) | set(now))
               if saved.get(k) != now.get(k)]
    return ", ".join(changed[:4]) + (" and more" if len(changed) > 4 else "")


def remove_stale_work_folders() -> None:
    """Remove the work folders that processes killed before their end left on this node
    (this user's, whose process is gone)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{WORK_PREFIX}*-*"):
        try:
            pid = int(folder.name[len(WORK_PREFIX):].split("-", 1)[0])
            if folder.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)  # ProcessLookupError: gone
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, OSError):
            continue


def users_own_cache() -> bool:
    """True when TORCHINDUCTOR_CACHE_DIR names a folder of the user's (inductor itself sets it
    to its default folder once it has looked)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(ENV)
    return bool(current) and os.path.abspath(current) != os.path.abspath(default_cache_dir())


def open_cache(place: Path | None, made_for: dict[str, Any], writes: bool) -> CompileCache | None:
    """Point inductor at a new folder of this process's, filled from ``place`` when its graphs
    fit ``made_for``; None (torch's own cache folder as usual) when --cache-dir is none or
    TORCHINDUCTOR_CACHE_DIR is set (the user's own cache). Call before anything compiles."""
    if place is None:
        return None
    if users_own_cache():
        if writes:
            log.info("=> --compile: %s is set (%s): torch's compile cache is there, the run "
                     "keeps none of its own", ENV, os.environ[ENV])
        return None
    remove_stale_work_folders()
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-"))
    os.environ[ENV] = str(work)  # read by inductor at each use, and by its compile workers
    cache = CompileCache(place / SUBFOLDER, work, made_for, writes)
    line = cache.reuse()
    if line and writes:
        log.info("%s", line)
    return cache


def graph_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache hits and misses in this process so far (a miss: a graph
    compiled; a hit: loaded)."""
    from torch._dynamo.utils import counters

    return {"hits": int(counters["inductor"]["fxgraph_cache_hit"]
                        + counters["aot_autograd"]["autograd_cache_hit"]),
            "misses": int(counters["inductor"]["fxgraph_cache_miss"]
                          + counters["aot_autograd"]["autograd_cache_miss"])}


def graph_signature(cfg: Config, layout: Layout, classes: int, device: torch.device
                    ) -> dict[str, Any]:
    """What the compiled graphs depend on: the environment, the model and the shapes (per
    crop size, each archive's). A flag missing here that changes a graph costs a compile
    (inductor's own key tells), never a wrong graph."""
    return {**environment(device), "arch": cfg.arch, "classes": classes,
            "batch": layout.batch_size, "world_size": layout.world_size,
            "val_crop": cfg.val_crop_size, "amp": cfg.amp, "channels_last": cfg.channels_last,
            "compile_mode": cfg.compile_mode, "sync_bn": cfg.sync_bn,
            "freeze_backbone": cfg.freeze_backbone, "tta_flip": cfg.tta_flip,
            "ddp": [cfg.bucket_cap_mb, cfg.ddp_comm_hook],
            "fsdp": [cfg.fsdp, cfg.fsdp_zero, cfg.fsdp_cpu_offload, cfg.fsdp_reduce_dtype]}
