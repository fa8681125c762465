"""Image decoding and per-sample transforms; every pipeline ends in a uint8 CHW tensor.

Normalisation is not a per-sample step: ``normalize`` runs once per batch on the device, so
workers ship a quarter of the bytes (uint8 instead of float32) and do less arithmetic.

Three backends:

- ``"tensor"`` (default): libjpeg-turbo ``decode_jpeg`` and transforms on uint8 tensors, with
  the crop, resize and flip arranged around the memory layout of the fast uint8 resize kernel
  (see ``RandomResizedCropFlip``). About twice the classic pipeline's images/s per core.
- ``"torchcodec"``: the same with TorchCodec's ``decode_jpeg`` (``--decoder``; data.jpeg): the
  same pixels.
- ``"pil"``: the classic ``PIL.Image.open(...).convert("RGB")`` and torchvision transforms on
  PIL images, kept as the reference the fast path is compared with.
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

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from imagenet.data import jpeg
from imagenet.errors import DataError
from imagenet.settings.decoders import installed_backend
from imagenet.settings.flags import AUTO_AUGMENT

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
    ``backend`` None: this installation's decoder (``settings.decoders.installed_backend``)."""
    backend = backend or installed_backend()
    if backend == "pil":
        return _open_pil(io.BytesIO(data), name)
    if data.startswith(_JPEG_MAGIC):
        try:
            # mode=RGB also converts grayscale and (Adobe) CMYK JPEGs exactly as PIL does, and a
            # truncated file raises instead of returning a partly grey image (tested).
            return jpeg.decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), backend)
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
