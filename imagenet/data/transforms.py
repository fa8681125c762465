"""Image decoding and per-sample transforms; every pipeline ends in a uint8 CHW tensor.

Normalisation is not a per-sample step: ``normalize`` runs once per batch on the device, so
workers ship a quarter of the bytes (uint8 instead of float32) and do less arithmetic.

Three backends:

- ``"tensor"`` (default): libjpeg-turbo ``decode_jpeg`` and transforms on uint8 tensors, with
  the crop, resize and flip arranged around the memory layout of the fast uint8 resize kernel
  (see ``RandomResizedCropFlip``). About twice the classic pipeline's images/s per core.
- ``"torchcodec"``: the same with TorchCodec's ``decode_jpeg`` (``--decoder``): the
  same pixels.
- ``"pil"``: the classic ``PIL.Image.open(...).convert("RGB")`` and torchvision transforms on
  PIL images, kept as the reference the fast path is compared with.

Progressive resizing in the loaders: each training sample is cropped at its epoch's size.

The schedule itself (``settings.images.CropSchedule``: --train-crop-start growing to
--train-crop-size over --train-crop-ramp) is the plan's. Every training sample carries its epoch
(the sampler's keys, the shard reader's items), and the loader process that augments it builds
that epoch's transform itself (``EpochCrop``): the size is the same for any -j, constant within
an epoch, and a resume mid-ramp trains the sizes the uninterrupted run would. Validation sizes
(--val-resize-size, --val-crop-size) are independent. With --compile every size has static
graphs of its own (``training.models``: one per batch shape), compiled when the size first
appears, rather than one dynamic-shape graph for all: a new size costs one compile, never one
per batch.

JPEG bytes -> uint8 RGB CHW tensors with torchvision.io's decoder or TorchCodec's
(``settings.images`` chooses; ``"tensor"`` is torchvision's), on the CPU or, batched, on a CUDA
device (nvJPEG).

The same pixels whichever decoder runs, and the classic script's: its PIL loader ignores the EXIF
orientation, and so does torchvision's decoder; TorchCodec applies it, so its image is turned
back here (a flip or a transpose of the decoded pixels: exact). Both decoders raise RuntimeError
for a file they cannot decode; ``data.transforms`` then lets PIL have the last word.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from imagenet.errors import DataError
from imagenet.settings import devices
from imagenet.settings.flags import AUTO_AUGMENT
from imagenet.settings.images import CropSchedule, installed_backend

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BACKENDS = ("tensor", "pil")  # the two pipelines (--image-backend)
TENSORS = ("tensor", "torchcodec")  # the tensor pipeline with either decoder (--decoder)
KNOWN = (*TENSORS, "pil")
INTERPOLATIONS = {
    "nearest": v2.InterpolationMode.NEAREST,
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
}
# RandomErasing fills with the mean in 0..255, so after ``normalize`` the erased area is ~0, as in
# torchvision's reference recipe, which erases after normalising with the default value 0.
ERASE_VALUE = [round(255 * m) for m in IMAGENET_MEAN]

_JPEG_MAGIC = b"\xff\xd8\xff"
_JPEG_END = b"\xff\xd9"  # the EOI marker
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the empty IEND chunk and its CRC
# What PIL raises for unreadable files varies by format plugin: OSError (truncated, unidentified,
# missing), SyntaxError/struct.error/IndexError/ValueError/EOFError from broken headers.
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error,
               Image.DecompressionBombError)


def load_image(path: str | Path, backend: str) -> torch.Tensor | Image.Image:
    """An RGB image: uint8 CHW tensor ("tensor") or PIL image ("pil"); DataError if unreadable."""
    if backend == "pil":
        return _open_pil(path, path)
    if backend not in TENSORS:
        raise ValueError(f"unknown image backend {backend!r}; choose from {KNOWN}")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read image {path}: {exc.strerror or exc}") from None
    return decode_image(data, path, backend)


def decode_image(data: bytes, name: str | Path, backend: str | None = None
                 ) -> torch.Tensor | Image.Image:
    """``load_image`` for encoded bytes (a shard member); DataError naming ``name``.
    ``backend`` None: this installation's decoder (``settings.images.installed_backend``)."""
    backend = backend or installed_backend()
    if backend == "pil":
        return _open_pil(io.BytesIO(data), name)
    if data.startswith(_JPEG_MAGIC):
        try:
            # mode=RGB also converts grayscale and (Adobe) CMYK JPEGs exactly as PIL does, and a
            # truncated file raises instead of returning a partly grey image (tested).
            return decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), backend)
        except RuntimeError:
            pass  # corrupt, or a JPEG variant libjpeg-turbo lacks (12-bit): PIL has the last word
    # PNG, GIF, BMP, WebP...: PIL, so both backends agree. HWC memory viewed as CHW, the layout
    # decode_jpeg returns, which the resize below is fastest on.
    return torch.from_numpy(np.array(_open_pil(io.BytesIO(data), name))).permute(2, 0, 1)


def check_image_file(path: str | Path, backend: str) -> None:
    """DataError, naming the file and the decoder's reason, if ``path`` cannot be loaded.

    Cheap for the usual files: a JPEG that starts with its SOI marker and ends with its EOI
    marker, or a PNG that ends with its IEND chunk, is accepted after reading 20 bytes (a file
    cut short, empty or not an image is caught; damage inside the data is not). Anything else
    is decoded in full by ``load_image``, which has the last word.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
            f.seek(max(size - 12, 0))
            tail = f.read(12)
    except OSError as exc:
        raise DataError(f"cannot read image {path}: {exc.strerror or exc}") from None
    if head.startswith(_JPEG_MAGIC) and tail.endswith(_JPEG_END):
        return
    if head.startswith(_PNG_MAGIC) and tail == _PNG_END:
        return
    load_image(path, backend)


def _open_pil(source, path: str | Path) -> Image.Image:
    """PIL's fully decoded RGB image; DataError naming ``path`` if it cannot be read."""
    try:
        with Image.open(source) as img:
            return img.convert("RGB")  # convert() forces the lazy decode, so truncation shows here
    except Image.UnidentifiedImageError:
        # PIL's own text names the in-memory buffer (<_io.BytesIO object at 0x...>), not a file.
        raise DataError(f"cannot read image {path}: no image format recognises its first bytes "
                        f"({_size(source)}: empty, damaged or not an image)") from None
    except _PIL_ERRORS as exc:
        raise DataError(f"cannot read image {path}: {exc} ({_size(source)})") from None


def _size(source) -> str:
    """The size of an image's bytes or file, for an error message ("0 bytes" explains a lot)."""
    try:
        size = source.getbuffer().nbytes if isinstance(source, io.BytesIO) \
            else os.path.getsize(source)
    except OSError:
        return "size unknown"
    return f"{size:,} bytes"


def interpolation_mode(name: str) -> v2.InterpolationMode:
    """torchvision's interpolation mode for "nearest", "bilinear" or "bicubic"."""
    if name not in INTERPOLATIONS:
        raise ValueError(f"unknown interpolation {name!r}; choose from {tuple(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]


def to_chw(img: torch.Tensor | np.ndarray | Image.Image, flip: bool = False) -> torch.Tensor:
    """A contiguous uint8 CHW tensor, optionally mirrored left-right, in one copy."""
    if isinstance(img, torch.Tensor):
        if img.is_contiguous() and not flip:
            return img
        hwc = img.permute(1, 2, 0).numpy()
    else:
        hwc = np.asarray(img)
    if flip:
        hwc = hwc[:, ::-1]
    # numpy's strided copy packs HWC into CHW about 3x faster than torch's for 3-channel uint8.
    return torch.from_numpy(np.ascontiguousarray(hwc.transpose(2, 0, 1)))


class ToCHW:
    """Transform: pack a uint8 tensor or PIL image into a contiguous CHW tensor."""

    def __call__(self, img: torch.Tensor | Image.Image) -> torch.Tensor:
        return to_chw(img)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RandomResizedCropFlip:
    """RandomResizedCrop + RandomHorizontalFlip(0.5) for uint8 CHW tensors, as one fast step.

    Same crop distribution as torchvision's RandomResizedCrop (up to 10 tries, then a centre
    crop) but ~35% less time than the two v2 transforms (measured with 224 px crops of
    ImageNet-sized images): all random numbers come from one draw instead of up to 23; the crop
    is packed into HWC memory first, the layout the uint8 antialiased resize kernel works in; and
    the flip happens inside the one copy that makes the output contiguous CHW.
    """

    def __init__(self, size: int, interpolation: str = "bilinear",
                 scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.interpolation = size, interpolation_mode(interpolation)
        self.scale, self.ratio = scale, ratio

    def crop_box(self, height: int, width: int, u: list[float]) -> tuple[int, int, int, int]:
        """(top, left, h, w) of the crop, from 22 uniform numbers in [0, 1)."""
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        area = height * width
        for k in range(10):
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[2 * k])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[2 * k + 1])
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return int(u[20] * (height - h + 1)), int(u[21] * (width - w + 1)), h, w
        in_ratio = width / height  # no try fitted: centre crop clamped to the ratio range
        h, w = height, width
        if in_ratio < min(self.ratio):
            h = round(w / min(self.ratio))
        elif in_ratio > max(self.ratio):
            w = round(h * max(self.ratio))
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        u = torch.rand(23, dtype=torch.float64).tolist()  # 10 tries x 2, top, left, flip
        top, left, h, w = self.crop_box(img.shape[-2], img.shape[-1], u)
        crop = img[:, top:top + h, left:left + w].permute(1, 2, 0).contiguous().permute(2, 0, 1)
        out = F.resize(crop, [self.size, self.size], interpolation=self.interpolation,
                       antialias=True)
        return to_chw(out, flip=u[22] < 0.5)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, interpolation={self.interpolation.value},"
                f" scale={self.scale}, ratio={self.ratio})")


def auto_augment_transform(name: str, interpolation: v2.InterpolationMode, ra_magnitude: int,
                           augmix_severity: int) -> v2.Transform:
    """The --auto-augment policy ("ra", "ta_wide", "augmix" or "imagenet") as a v2 transform."""
    if name == "ra":
        return v2.RandAugment(magnitude=ra_magnitude, interpolation=interpolation)
    if name == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if name == "augmix":
        return v2.AugMix(severity=augmix_severity, interpolation=interpolation)
    if name == "imagenet":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=interpolation)
    raise ValueError(f"unknown auto augment policy {name!r}; choose from {AUTO_AUGMENT}")


def train_transform(crop_size: int, interpolation: str = "bilinear",
                    auto_augment: str | None = None, ra_magnitude: int = 9,
                    augmix_severity: int = 3, random_erase: float = 0.0,
                    backend: str = "tensor", min_scale: float = 0.08) -> Callable:
    """Training augmentation: image from ``load_image`` -> uint8 tensor (3, crop, crop)."""
    mode = interpolation_mode(interpolation)
    scale = (min_scale, 1.0)
    if backend in TENSORS:
        steps: list[Callable] = [RandomResizedCropFlip(crop_size, interpolation, scale)]
    elif backend == "pil":
        steps = [v2.RandomResizedCrop(crop_size, scale=scale, interpolation=mode, antialias=True),
                 v2.RandomHorizontalFlip()]
    else:
        raise ValueError(f"unknown image backend {backend!r}; choose from {KNOWN}")
    if auto_augment:
        # The policies' rotate/shear/translate on tensors support nearest and bilinear only, and
        # AugMix works on tensors even when given a PIL image.
        on_tensors = backend in TENSORS or auto_augment == "augmix"
        if on_tensors and mode == v2.InterpolationMode.BICUBIC:
            log.info("--auto-augment %s on tensors uses bilinear (its rotations and shears have "
                     "no bicubic); crops are still resized with bicubic", auto_augment)
            mode = v2.InterpolationMode.BILINEAR
        steps.append(auto_augment_transform(auto_augment, mode, ra_magnitude, augmix_severity))
    steps.append(ToCHW())
    if random_erase > 0:
        steps.append(v2.RandomErasing(p=random_erase, value=ERASE_VALUE))
    return v2.Compose(steps)


def val_transform(resize_size: int, crop_size: int, interpolation: str = "bilinear",
                  backend: str = "tensor") -> Callable:
    """Evaluation: resize the short side, centre crop -> uint8 tensor (3, crop, crop)."""
    if backend not in KNOWN:
        raise ValueError(f"unknown image backend {backend!r}; choose from {KNOWN}")
    # Same steps for both backends: v2 dispatches to the PIL or the uint8 tensor kernels. The
    # crop is a view; ToCHW makes the one copy.
    return v2.Compose([v2.Resize(resize_size, interpolation=interpolation_mode(interpolation),
                                 antialias=True),
                       v2.CenterCrop(crop_size), ToCHW()])


def batch_transform(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> Callable | None:
    """MixUp and/or CutMix (torchvision v2) for the device batch; None when both are off."""
    chosen = []
    if mixup_alpha > 0:
        chosen.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        chosen.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    if not chosen:
        return None
    return chosen[0] if len(chosen) == 1 else v2.RandomChoice(chosen)


@functools.cache
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet mean and std x 255 on ``device``, made once: a copy per batch from pageable
    host memory can make the host wait for the device stream."""
    # float32 whatever the training dtype is: bf16 cannot hold x * scale exactly.
    return tuple(torch.tensor(v, dtype=torch.float32).mul_(255).view(1, 3, 1, 1).to(device)
                 for v in (IMAGENET_MEAN, IMAGENET_STD))  # type: ignore[return-value]


def normalize(batch: torch.Tensor, channels_last: bool = False,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 NCHW batch -> (x / 255 - mean) / std in ``dtype``, on the batch's device."""
    if batch.dtype != torch.uint8 or batch.dim() != 4:
        raise TypeError(f"normalize expects a uint8 NCHW batch, got {batch.dtype} "
                        f"{tuple(batch.shape)}")
    if channels_last:
        batch = batch.contiguous(memory_format=torch.channels_last)  # 1 byte/value: cheap here
    mean, std = _mean_std(batch.device)
    out = batch.float().sub_(mean).div_(std)  # in place: keeps the memory format
    return out if dtype == torch.float32 else out.to(dtype)


# ---------------------------------------- progressive resizing: each sample at its epoch's crop

def announce(crops: CropSchedule, epoch: int, val_crop: int) -> dict[str, int]:
    """With progressive resizing: log the epoch's crop; its metrics.jsonl field (else {})."""
    if not crops.progressive:
        return {}
    size = crops.size(epoch)
    log.info("=> epoch %d: training crop %d px (%d -> %d px over epochs %d-%d), validation %d "
             "px", epoch, size, crops.start, crops.end, crops.first_epoch, crops.last_epoch,
             val_crop)
    return {"train_crop_px": size}


class EpochCrop:
    """A per-sample training transform whose crop size follows a ``CropSchedule``.

    ``build(size)`` makes the transform of one size (built once per size, in the process that
    runs it); the dataset sets ``epoch`` from the sample's key before calling (``follow_epoch``).
    """

    def __init__(self, schedule: CropSchedule, build: Callable[[int], Callable]) -> None:
        self.schedule, self.build = schedule, build
        self.epoch = 0
        self._built: dict[int, Callable] = {}

    def __call__(self, image: Any) -> Any:
        size = self.schedule.size(self.epoch)
        if size not in self._built:
            self._built[size] = self.build(size)
        return self._built[size](image)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.schedule}, {self.build(self.schedule.end)})"


def sized_by_epoch(crops: CropSchedule, build: Callable[[int], Callable]) -> Callable:
    """``build(--train-crop-size)``, or an ``EpochCrop`` of ``build`` with progressive resizing."""
    return EpochCrop(crops, build) if crops.progressive else build(crops.end)


def follow_epoch(holder: Any, epoch: int) -> None:
    """Point the ``EpochCrop`` transform of ``holder`` (a dataset) at ``epoch``, if it has one."""
    transform = getattr(holder, "transform", None)
    if isinstance(transform, EpochCrop):
        transform.epoch = epoch


class CornerCrop:
    """--dummy's stand-in for augmentation: the top-left ``size`` x ``size`` of the image."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image[..., :self.size, :self.size]


# -------------------------------------------------------------- JPEG bytes to uint8 RGB tensors

# EXIF orientation -> what undoes it on a CHW tensor. 1: as stored; 2: mirrored; 3: turned 180;
# 4: flipped; 5: transposed; 6: turned 90 clockwise for display; 7: transversed; 8: 270.
_UNDO = {
    2: lambda x: x.flip(-1),
    3: lambda x: x.flip(-1, -2),
    4: lambda x: x.flip(-2),
    5: lambda x: x.transpose(-1, -2),
    6: lambda x: x.transpose(-1, -2).flip(-2),
    7: lambda x: x.transpose(-1, -2).flip(-1, -2),
    8: lambda x: x.transpose(-1, -2).flip(-1),
}


def exif_orientation(data: bytes | memoryview) -> int:
    """The EXIF orientation (1-8) in a JPEG's APP1 segment; 1 when there is none (or it cannot
    be read). Walks the marker segments before the image data: a few dozen bytes."""
    i, size = 2, len(data)
    while i + 4 <= size and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xDA or marker == 0xD9:  # the image data starts: no EXIF before it
            break
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xE1 and bytes(data[i + 4:i + 10]) == b"Exif\0\0":
            return _tiff_orientation(bytes(data[i + 10:i + 2 + length]))
        i += 2 + length
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)  # type: ignore[arg-type]
    if ifd + 2 > len(tiff):
        return 1
    for k in range(int.from_bytes(tiff[ifd:ifd + 2], order)):  # type: ignore[arg-type]
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            break
        if int.from_bytes(tiff[entry:entry + 2], order) == 0x0112:  # type: ignore[arg-type]
            value = int.from_bytes(tiff[entry + 8:entry + 10], order)  # type: ignore[arg-type]
            return value if 1 <= value <= 8 else 1
    return 1


def as_stored(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` as TorchCodec returns it for a file of EXIF ``orientation`` -> the pixels as
    stored (what torchvision and PIL return)."""
    undo = _UNDO.get(orientation)
    return image if undo is None else undo(image).contiguous()


def decode(data: torch.Tensor, backend: str) -> torch.Tensor:
    """One JPEG (a 1-D uint8 CPU tensor) -> RGB uint8 CHW on the CPU; RuntimeError if it cannot
    be decoded."""
    if backend == "torchcodec":
        from torchcodec.decoders import decode_jpeg

        return as_stored(decode_jpeg(data, mode="RGB"), exif_orientation(_head(data)))
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(data, mode=ImageReadMode.RGB)


def decode_batch(data: list[torch.Tensor], device: torch.device, backend: str
                 ) -> list[torch.Tensor]:
    """JPEGs (1-D uint8 CPU tensors) -> RGB images on ``device``, in one call (one nvJPEG batch
    on CUDA); RuntimeError if any cannot be decoded.

    On CUDA the decoder writes from a stream of its own into memory the caching allocator hands
    out on the caller's stream (torchvision #9606, torchcodec #1634): the caller's stream is
    drained first, so no block it freed is still being read or written when the decoder's
    writes land."""
    if device.type == "cuda":
        devices.current_stream(device).synchronize()
    if backend == "torchcodec":
        from torchcodec.decoders import decode_jpeg

        images = decode_jpeg(data, mode="RGB", device=device)
        return [as_stored(image, exif_orientation(_head(one)))
                for image, one in zip(images, data)]
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def _head(data: torch.Tensor) -> memoryview:
    """The bytes of a 1-D uint8 CPU tensor, without a copy."""
    return memoryview(data.numpy())
