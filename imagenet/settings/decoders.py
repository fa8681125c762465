"""Which library decodes the JPEGs (``--decoder``): torchvision.io's ``decode_jpeg`` or
TorchCodec's (an optional extra), for the loader workers and the device path alike.

torchvision deprecated its image decoders in 0.29 ("will be removed in a future release") in
favour of TorchCodec. ``auto`` takes the faster of the two where both are present (measured side
by side: ``benchmarks/decoders.py``), and TorchCodec when torchvision's are gone, without a code
change; PIL (always installed with torchvision) when neither is there. Every choice gives the
same pixels as the classic script's PIL loader: EXIF orientation is not applied (TorchCodec
applies it; ``data.transforms`` undoes it).

A pure function of the flags and the installed packages: every process (a spawned loader worker
too) resolves the same backend.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache

from imagenet.errors import UsageError
from imagenet.settings.flags import Config

DECODERS = ("auto", "torchvision", "torchcodec")
# What --decoder auto prefers where both are installed: torchvision's decode_jpeg. Measured side
# by side (benchmarks/decoders.py, 500x375 px JPEGs, one core, torch 2.14.1 / torchvision 0.29.1
# / TorchCodec 0.17.0): TorchCodec at 0.97-1.05x torchvision's rate, within the noise; torchvision
# needs no extra package and no EXIF undo.
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
                                  "(benchmarks/decoders.py) and needs no extra package")
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
