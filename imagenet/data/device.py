"""--decode-on-device: JPEGs decoded (nvJPEG, batched) and cropped, resized and flipped on the
training device; loader workers only read files.

Who does what:

- a worker reads a file and its JPEG header (``read_encoded``), draws the sample's crop box and
  flip exactly as ``transforms.RandomResizedCropFlip`` would from the same per-sample seed, at
  its epoch's crop size (``EncodedTrainItem``; progressive resizing as on the CPU path), and
  ships the encoded bytes with the box; ``collate`` packs a batch into one flat byte tensor
  (one shared-memory segment per batch, not one per image);
- the training process decodes the batch on its device in one ``decode_jpeg`` call, then crops,
  resizes and flips the whole batch in one batched resampling (``resample``) (``DeviceCrops``),
  in a thread and on a CUDA stream of its own, ahead of the step (``prefetch``).

Files nvJPEG cannot decode (PNG and other formats, CMYK or 12-bit JPEGs, a JPEG without its end
marker) are decoded and augmented by the worker as on the CPU path, and shipped finished. On the
CPU the device path resizes image by image with torchvision's kernels, so the tests can compare
it image for image with the CPU path (the same crop boxes and flips, the same pixels); on CUDA
nvJPEG's pixels differ from libjpeg-turbo's by rounding, and the batched resampling from
torchvision's uint8 kernels by rounding (within one grey level, bilinear).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torchvision.transforms.v2 import functional as F

import imagenet.data.transforms as T
from imagenet.data.resample import FILTERS, Windows, resample
from imagenet.data.transforms import sized_by_epoch
from imagenet.errors import DataError
from imagenet.settings.flags import Config
from imagenet.settings.images import CropSchedule, image_backend

log = logging.getLogger(__name__)

# Baseline, extended and progressive Huffman JPEG: what nvJPEG decodes (not arithmetic coding,
# lossless or hierarchical ones).
DEVICE_SOF = frozenset((0xC0, 0xC1, 0xC2))
ANY_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not frames
STANDALONE = frozenset((0x01, *range(0xD0, 0xDA)))  # markers without a length field
FINISHED = -1  # box[0] of an image the worker decoded and augmented itself


# ---------------------------------------------------------------- in the loader workers


def jpeg_frame(buf) -> tuple[int, int, int, int, int] | None:
    """(SOF marker, precision, height, width, components) of a JPEG's frame header, or None when
    ``buf`` (bytes-like) is not a JPEG with a readable one."""
    if len(buf) < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= len(buf):
        if buf[i] != 0xFF:
            return None
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in STANDALONE:
            i += 2
            continue
        if marker in ANY_SOF:
            if i + 10 > len(buf):
                return None
            precision, height, width, components = struct.unpack_from(">BHHB", buf, i + 4)
            return marker, precision, height, width, components
        i += 2 + struct.unpack_from(">H", buf, i + 2)[0]
    return None


def device_decodable(buf) -> bool:
    """True for a complete 8-bit grey or colour Huffman JPEG (what nvJPEG decodes as RGB)."""
    frame = jpeg_frame(buf)
    if frame is None or bytes(buf[-2:]) != T._JPEG_END:
        return False
    marker, precision, height, width, components = frame
    return marker in DEVICE_SOF and precision == 8 and height > 0 and width > 0 \
        and components in (1, 3)


def read_encoded(path: str | Path) -> tuple[torch.Tensor, str]:
    """(image, path) for ImageFolder: the file's bytes (1-D uint8) when the device can decode
    them, else the image decoded here (uint8 CHW); DataError if unreadable."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read image {path}: {exc.strerror or exc}") from None
    return encoded(data, str(path))


def encoded(data: bytes, name: str, backend: str | None = None) -> tuple[torch.Tensor, str]:
    """(image, name) of an image's bytes (a file's, a tar shard member's, a Parquet row's): the
    bytes (1-D uint8) when the device can decode them, else the image decoded here (uint8 CHW,
    with ``backend``); DataError naming ``name`` if it cannot be decoded."""
    if device_decodable(data):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), name
    return T.decode_image(data, name, backend), name  # type: ignore[return-value]


BOX = ("top", "left", "height", "width", "flip", "size")  # a row of EncodedBatch.boxes


class EncodedTrainItem:
    """Transform: (image, path) -> (payload, box, path). A JPEG's payload is its bytes and box is
    (top, left, height, width, flip, size), drawn as ``RandomResizedCropFlip`` draws them (``size``
    is the crop it resizes to); any other image is augmented here on the CPU path, and its box
    starts with ``FINISHED``."""

    def __init__(self, crops: T.RandomResizedCropFlip) -> None:
        self.crops = crops

    def __call__(self, item: tuple[torch.Tensor, str]) -> tuple[torch.Tensor, torch.Tensor, str]:
        image, path = item
        size = self.crops.size
        if image.dim() == 3:
            return self.crops(image), torch.tensor([FINISHED] * 5 + [size]), path
        _, _, height, width, _ = jpeg_frame(image.numpy())  # type: ignore[misc]
        u = torch.rand(23, dtype=torch.float64).tolist()  # the draw RandomResizedCropFlip makes
        top, left, h, w = self.crops.crop_box(height, width, u)
        return image, torch.tensor([top, left, h, w, int(u[22] < 0.5), size]), path


def encoded_train_item(size: int, interpolation: str, scale: tuple[float, float]
                       ) -> EncodedTrainItem:
    """The worker's training transform for crops of ``size`` (picklable: a module function)."""
    return EncodedTrainItem(T.RandomResizedCropFlip(size, interpolation, scale))


class EncodedValItem:
    """Transform: (image, path) -> (payload, box, path) for validation (no randomness)."""

    def __init__(self, finish: Callable[[torch.Tensor], torch.Tensor], size: int) -> None:
        self.finish, self.size = finish, size

    def __call__(self, item: tuple[torch.Tensor, str]) -> tuple[torch.Tensor, torch.Tensor, str]:
        image, path = item
        if image.dim() == 3:
            return self.finish(image), torch.tensor([FINISHED] * 5 + [self.size]), path
        return image, torch.tensor([0] * 5 + [self.size]), path


def item_transforms(cfg: Config, crops: CropSchedule) -> tuple[Callable, EncodedValItem]:
    """The workers' transforms for training items (at each epoch's crop size) and validation
    items."""
    train = sized_by_epoch(crops, partial(encoded_train_item, interpolation=cfg.interpolation,
                                          scale=(cfg.train_crop_scale, 1.0)))
    val = T.val_transform(cfg.val_resize_size, cfg.val_crop_size, cfg.interpolation)
    return train, EncodedValItem(val, cfg.val_crop_size)


@dataclass
class EncodedBatch:
    """A batch as the workers ship it: every payload in one flat uint8 tensor."""

    data: torch.Tensor  # the payloads, concatenated (flattened: finished images too)
    sizes: list[int]  # bytes of each payload
    boxes: torch.Tensor  # (N, 6): ``BOX`` (top, left, height, width, flip, size), or FINISHED
    paths: list[str]  # for error messages


def collate(items: Sequence[tuple[tuple[torch.Tensor, torch.Tensor, str], int]]
            ) -> tuple[EncodedBatch, torch.Tensor]:
    """DataLoader collate_fn: ((payload, box, path), label) items -> (EncodedBatch, labels)."""
    payloads = [payload.reshape(-1) for (payload, _, _), _ in items]
    batch = EncodedBatch(torch.cat(payloads), [len(p) for p in payloads],
                         torch.stack([box for (_, box, _), _ in items]),
                         [path for (_, _, path), _ in items])
    return batch, torch.tensor([label for _, label in items])


# ---------------------------------------------------------------- on the device


@dataclass(frozen=True)
class DeviceCrops:
    """A batch's images on ``device``: decoded together, then cropped and resized (training: each
    image's box and flip, to the batch's crop size) or resized to ``resize`` and centre-cropped to
    ``size`` (validation, ``resize`` given). ``batched``: one batched resampling for the whole
    batch (``resample``); None = on CUDA, image by image with torchvision's kernels elsewhere."""

    size: int
    interpolation: str = "bilinear"
    resize: int | None = None
    batched: bool | None = None
    backend: str = "tensor"  # the decoder: torchvision.io's or TorchCodec's (settings.images)

    def __call__(self, batch: tuple[EncodedBatch, torch.Tensor], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        encoded, labels = batch
        size = self.size if self.resize is not None else int(encoded.boxes[0, 5])
        images = decode(encoded, device, size, self.backend)
        boxes = encoded.boxes.tolist()
        jpegs = [i for i, box in enumerate(boxes) if box[0] != FINISHED]
        batched = device.type == "cuda" if self.batched is None else self.batched
        if batched and jpegs and self.interpolation in FILTERS:
            out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
            done = [i for i in range(len(images)) if i not in set(jpegs)]
            if done:
                out[done] = torch.stack([images[i] for i in done])
            out[jpegs] = self.resample([images[i] for i in jpegs],
                                       [boxes[i] for i in jpegs], size)
        else:
            mode = T.interpolation_mode(self.interpolation)
            out = torch.stack([image if box[0] == FINISHED else self.crop(image, box, size, mode)
                               for image, box in zip(images, boxes)])
        return out, labels.to(device, non_blocking=True)

    def resample(self, images: list[torch.Tensor], boxes: list[list[int]], size: int
                 ) -> torch.Tensor:
        """The JPEGs' crops in one batched resampling (see ``resample``)."""
        n = len(images)
        heights = torch.tensor([image.shape[-2] for image in images])
        widths = torch.tensor([image.shape[-1] for image in images])
        if self.resize is None:  # training: the worker's box, resized to the crop size
            box = torch.tensor(boxes)
            full = torch.full((n,), size)
            rows = Windows(box[:, 0], box[:, 2], full, torch.zeros(n, dtype=torch.long))
            cols = Windows(box[:, 1], box[:, 3], full, torch.zeros(n, dtype=torch.long))
            return resample(images, rows, cols, size, box[:, 4], self.interpolation)
        # Validation: the short side resized to ``resize`` (the long one as torchvision rounds
        # it), then the centre ``size`` x ``size`` of that, as F.resize + F.center_crop do.
        short = torch.minimum(heights, widths)
        out_h = torch.where(heights == short, self.resize, self.resize * heights // short)
        out_w = torch.where(widths == short, self.resize, self.resize * widths // short)
        zero = torch.zeros(n, dtype=torch.long)
        rows = Windows(zero, heights, out_h, ((out_h - size) / 2).round().long())
        cols = Windows(zero, widths, out_w, ((out_w - size) / 2).round().long())
        return resample(images, rows, cols, size, torch.zeros(n), self.interpolation)

    def crop(self, image: torch.Tensor, box: list[int], size: int, mode) -> torch.Tensor:
        """One decoded image -> its (3, size, size) crop, with torchvision's kernels."""
        if self.resize is not None:
            image = F.resize(image, [self.resize], interpolation=mode, antialias=True)
            return F.center_crop(image, [self.size])
        top, left, h, w, flip, _ = box
        crop = image[:, top:top + h, left:left + w]
        out = F.resize(crop, [size, size], interpolation=mode, antialias=True)
        return out.flip(-1) if flip else out


def device_crops(cfg: Config) -> tuple[DeviceCrops, DeviceCrops]:
    """The training and validation ``DeviceCrops`` of the flags (the training crop's size comes
    with each batch: progressive resizing)."""
    backend = image_backend(cfg)
    return (DeviceCrops(cfg.train_crop_size, cfg.interpolation, backend=backend),
            DeviceCrops(cfg.val_crop_size, cfg.interpolation, cfg.val_resize_size,
                        backend=backend))


def decode(encoded: EncodedBatch, device: torch.device, size: int, backend: str = "tensor"
           ) -> list[torch.Tensor]:
    """Every payload of ``encoded`` as a uint8 CHW image on ``device``: JPEGs in one batched
    decode_jpeg call of ``backend``'s decoder (nvJPEG on CUDA), finished (3, size, size) images
    copied."""
    payloads = list(torch.split(encoded.data, encoded.sizes))
    jpegs = [i for i, box in enumerate(encoded.boxes[:, 0].tolist()) if box != FINISHED]
    images: list[torch.Tensor] = [torch.empty(0)] * len(payloads)
    for i, image in zip(jpegs, decode_jpegs([payloads[i] for i in jpegs],
                                            [encoded.paths[i] for i in jpegs], device,
                                            backend)):
        images[i] = image
    for i in set(range(len(payloads))) - set(jpegs):
        images[i] = payloads[i].view(3, size, size).to(device, non_blocking=True)
    return images


def decode_jpegs(data: list[torch.Tensor], paths: list[str], device: torch.device,
                 backend: str = "tensor") -> list[torch.Tensor]:
    """JPEG bytes -> RGB images on ``device``; a batch that fails is decoded one by one, and an
    image the device cannot decode is decoded by the CPU path (DataError naming a bad file)."""
    if not data:
        return []
    try:
        return T.decode_batch(data, device, backend)
    except RuntimeError:
        pass
    images = []
    for one, path in zip(data, paths):
        try:
            images.append(T.decode_batch([one], device, backend)[0])
        except RuntimeError:
            image = T.decode_image(one.numpy().tobytes(), path, backend)
            images.append(image.to(device))  # type: ignore[union-attr]
    return images
