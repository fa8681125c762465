"""The images, as settings: what the data argument names, which library decodes its JPEGs, and
the training crop of every epoch; each a pure function of the flags (and what is installed).

Decoders. Which library decodes the JPEGs (``--decoder``): torchvision.io's ``decode_jpeg`` or
TorchCodec's (an optional extra), for the loader workers and the device path alike.

torchvision deprecated its image decoders in 0.29 ("will be removed in a future release") in
favour of TorchCodec. ``auto`` takes the faster of the two where both are present (measured side
by side: ``benchmarks/bench.py decoders``), and TorchCodec when torchvision's are gone, without a
code change; PIL (always installed with torchvision) when neither is there. Every choice gives the
same pixels as the classic script's PIL loader: EXIF orientation is not applied (TorchCodec
applies it; ``data.transforms`` undoes it).

A pure function of the flags and the installed packages: every process (a spawned loader worker
too) resolves the same backend.

Crops. The training crop of every epoch: --train-crop-size throughout, or progressive resizing.

FFCV's fast ResNet recipes train at 160 px, grow to 192 px over a few late epochs and evaluate at
224-256 px: small crops early make those epochs cheap, and the test-time resolution gap (FixRes)
makes the larger evaluation crop score higher. The size is a pure function of the epoch
(``CropSchedule.size``): epochs up to START_EPOCH train at the start size, epochs from END_EPOCH
on at --train-crop-size, the ones between on the straight line, rounded to --train-crop-multiple
(default 32, FFCV's rounding and the total stride of torchvision's CNNs, so every stage of a
ResNet gets whole feature maps and few sizes - few compiled graphs - appear).

The plan holds the schedule (``Plan.crops``); the loaders (``data.transforms``), the device decoder
and ``--compile`` read it from there.

Sources. What the data argument names, decided from its form (and, for a folder, what it holds):
an ImageFolder, or tar shards (a pattern, ``pipe:``, a URL, a folder with ``_info.json``); and
which names are read over a network. ``data`` and ``shards`` read them; the plan decides with
``data_format`` once.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from imagenet.errors import UsageError
from imagenet.settings.flags import Config

DECODERS = ("auto", "torchvision", "torchcodec")
# What --decoder auto prefers where both are installed: torchvision's decode_jpeg. Measured side
# by side (benchmarks/bench.py decoders, 500x375 px JPEGs, one core, torch 2.14.1 / torchvision
# 0.29.1 / TorchCodec 0.17.0): TorchCodec at 0.97-1.05x torchvision's rate, within the noise;
# torchvision needs no extra package and no EXIF undo.
FASTER = "torchvision"
TORCHCODEC_PIN = "torchcodec==0.17.0"  # the release that pairs with torch 2.14.1
INSTALL = f"pip install '{TORCHCODEC_PIN}' (or bash install.sh --dev)"


@dataclass(frozen=True)
class Decoding:
    """The image backend the loaders use ("tensor": torchvision.io, "torchcodec", "pil") and
    the start-up line's reason."""

    backend: str
    why: str

    @property
    def name(self) -> str:
        return {"tensor": "torchvision.io decode_jpeg", "torchcodec": "TorchCodec decode_jpeg",
                "pil": "PIL"}[self.backend]


@cache
def torchvision_decodes() -> bool:
    """True while torchvision ships its JPEG decoder (deprecated in 0.29, to be removed)."""
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def torchcodec_installed() -> bool:
    try:
        return importlib.util.find_spec("torchcodec") is not None
    except (ImportError, ValueError):  # a broken or hidden install
        return False


def choose_decoding(cfg: Config) -> Decoding:
    """The backend for ``cfg``; UsageError when the requested decoder is not installed."""
    if cfg.image_backend == "pil":
        return Decoding("pil", "--image-backend pil: the classic PIL pipeline")
    if cfg.decoder == "torchcodec":
        if not torchcodec_installed():
            raise UsageError(f"--decoder torchcodec: TorchCodec is not installed; {INSTALL}, or "
                             "use --decoder auto")
        return Decoding("torchcodec", "--decoder torchcodec")
    if cfg.decoder == "torchvision":
        if not torchvision_decodes():
            raise UsageError("--decoder torchvision: this torchvision has no image decoders "
                             "(deprecated in 0.29, since removed); use --decoder auto or "
                             f"torchcodec ({INSTALL})")
        return Decoding("tensor", "--decoder torchvision")
    if torchvision_decodes() and (FASTER == "torchvision" or not torchcodec_installed()):
        return Decoding("tensor", "auto: torchvision's is as fast as TorchCodec's "
                                  "(benchmarks/bench.py decoders) and needs no extra package")
    if torchcodec_installed():
        return Decoding("torchcodec", "auto: torchvision has no image decoders" if
                        not torchvision_decodes() else "auto: measured faster")
    return Decoding("pil", "auto: neither torchvision's image decoders nor TorchCodec are "
                           f"installed ({INSTALL} decodes faster)")


def installed_backend() -> str:
    """The tensor backend of this installation when nothing asks for one: torchvision's decoder
    while torchvision has it, else TorchCodec's, else PIL."""
    if torchvision_decodes():
        return "tensor"
    return "torchcodec" if torchcodec_installed() else "pil"


def image_backend(cfg: Config) -> str:
    """The loaders' image backend for ``cfg`` ("tensor", "torchcodec" or "pil")."""
    return choose_decoding(cfg).backend


# ------------------------------------------------------------- the training crop of every epoch

@dataclass(frozen=True)
class CropSchedule:
    """The training crop of every epoch (see the module docstring)."""

    start: int  # px, up to ``first_epoch``
    end: int  # px, from ``last_epoch`` on (--train-crop-size)
    first_epoch: int = 0
    last_epoch: int = 0
    multiple: int = 32  # px; sizes between are rounded to it
    progressive: bool = True  # False: --train-crop-size throughout (no --train-crop-start)

    def size(self, epoch: int) -> int:
        """The training crop of ``epoch``, pixels."""
        if epoch <= self.first_epoch:
            return self.start
        if epoch >= self.last_epoch:
            return self.end
        fraction = (epoch - self.first_epoch) / (self.last_epoch - self.first_epoch)
        exact = self.start + (self.end - self.start) * fraction
        rounded = round(exact / self.multiple) * self.multiple
        low, high = sorted((self.start, self.end))
        return min(max(rounded, low), high)

    def sizes(self, epochs: int) -> list[int]:
        """The distinct sizes of epochs 0 .. ``epochs`` - 1, in the order they come."""
        return list(dict.fromkeys(self.size(e) for e in range(epochs)))


def crop_schedule(cfg: Config) -> CropSchedule:
    """The schedule of the flags (not ``progressive`` without --train-crop-start)."""
    if cfg.train_crop_start is None or cfg.train_crop_ramp is None:
        size = cfg.train_crop_size
        return CropSchedule(size, size, 0, 0, cfg.train_crop_multiple, progressive=False)
    first, last = cfg.train_crop_ramp
    return CropSchedule(cfg.train_crop_start, cfg.train_crop_size, first, last,
                        cfg.train_crop_multiple)


# ----------------------------------------------------------------- what the data argument names

INFO_NAMES = ("_info.json", "info.json")  # timm tries them in this order
SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_NOT_FSSPEC = {"http", "https", "file"}  # http(s) has its own reader; file:// is a local path


def is_url(text: str | os.PathLike | None) -> bool:
    """True for an fsspec URL (``s3://bucket/x``, ``gs://...``), not a local path or http(s)."""
    match = SCHEME.match(str(text or ""))
    return bool(match) and match.group(1).lower() not in _NOT_FSSPEC


def is_remote(url: str) -> bool:
    """Whether ``url`` is read by downloading (http(s), a pipe: command, object storage)."""
    return url.startswith(("http://", "https://", "pipe:")) or is_url(url)


def is_shard_pattern(data: str) -> bool:
    """A shard list rather than a folder or base URL."""
    return data.startswith("pipe:") or "{" in data or data.endswith(".tar")


def data_format(data: str, requested: str) -> str:
    """"folder", "shards" or "parquet": ``requested`` unless "auto", else what ``data`` looks
    like."""
    if requested != "auto":
        return requested
    if data.startswith("hf://") or data.endswith(".parquet"):
        return "parquet"
    if is_shard_pattern(data):
        return "shards"
    if is_url(data):
        return url_format(data)
    if is_remote(data):
        return "shards"
    root = Path(data)
    shards = any((root / name).is_file() for name in INFO_NAMES)
    # class folders under train/ and val/, whatever other files DIR holds (a captions.parquet);
    # the Hub's converted branch holds train/0000.parquet: its split folders hold the files
    folder = (root / "train").is_dir() and (root / "val").is_dir() \
        and next((root / "train").glob("*.parquet"), None) is None
    if root.is_dir() and not folder and not shards and holds_parquet(root):
        return "parquet"  # the Hub's layout: *.parquet, data/*.parquet, default/train/*.parquet
    if folder and shards:
        raise UsageError(f"'{data}' holds both an ImageFolder (train/, val/) and shards "
                         "(_info.json): give --data-format folder or --data-format shards")
    tars = [p for p in root.glob("*.tar") if not p.name.endswith(".pth.tar")] \
        if root.is_dir() else []  # checkpoints (*.pth.tar) are not shards
    if not folder and not shards and tars:
        raise UsageError(f"'{data}' holds .tar files but no _info.json: give the training "
                         f"shards as a pattern ('{data}/train-{{000000..000009}}.tar') and "
                         "the validation shards with --val-data")
    return "shards" if shards else "folder"


def holds_parquet(root: Path) -> bool:
    """.parquet files in ``root`` or up to two folders below it (the Hub's layouts)."""
    return any(next(root.glob(f"{'*/' * depth}*.parquet"), None) for depth in range(3))


def url_format(url: str) -> str:
    """"parquet" for an fsspec URL holding .parquet files (up to two folders down) and no
    ``_info.json``, else "shards" (whose reader says what is missing: fsspec, the backend, the
    _info.json). A few listings of the URL."""
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        root = path.rstrip("/")
        if any(fs.exists(f"{root}/{name}") for name in INFO_NAMES):
            return "shards"
        found = any(fs.glob(f"{root}/{'*/' * depth}*.parquet") for depth in range(3))
    except Exception:  # not installed, no credentials, no such bucket: the shards' error says
        return "shards"
    return "parquet" if found else "shards"
