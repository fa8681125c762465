"""--decode-on-device: JPEGs decoded (nvJPEG, batched) and cropped, resized and flipped on the
training device; loader workers only read files. And the side stream that copies every batch.

Who does what:

- a worker reads a file and its JPEG header (``read_encoded``), draws the sample's crop box and
  flip exactly as ``transforms.RandomResizedCropFlip`` would from the same per-sample seed
  (``EncodedTrainItem``), and ships the encoded bytes with the box; ``collate`` packs a batch
  into one flat byte tensor (one shared-memory segment per batch, not one per image);
- the training process decodes the batch on its device in one ``decode_jpeg`` call, crops,
  resizes and flips each image there (``DeviceCrops``), on a side stream one batch ahead
  (``DeviceBatches``), so the step that trains on the batch never waits for the copy.

Files nvJPEG cannot decode (PNG and other formats, CMYK or 12-bit JPEGs, a JPEG without its end
marker) are decoded and augmented by the worker as on the CPU path, and shipped finished. The
same code runs on the CPU (the tests compare it image for image with the CPU path there: the
same crop boxes and flips, the same pixels); on CUDA nvJPEG's pixels differ from libjpeg-turbo's
by rounding.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

import imagenet.data.transforms as T
from imagenet.errors import DataError
from imagenet.settings.crops import CropSchedule
from imagenet.settings.flags import Config

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
    if device_decodable(data):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), str(path)
    return T.decode_image(data, path), str(path)  # type: ignore[return-value]


class EncodedTrainItem:
    """Transform: (image, path) -> (payload, box, path). A JPEG's payload is its bytes and box is
    (top, left, height, width, flip), drawn as ``RandomResizedCropFlip`` draws them; any other
    image is augmented here on the CPU path, and its box is ``FINISHED``."""

    def __init__(self, crops: T.RandomResizedCropFlip) -> None:
        self.crops = crops

    def __call__(self, item: tuple[torch.Tensor, str]) -> tuple[torch.Tensor, torch.Tensor, str]:
        image, path = item
        if image.dim() == 3:
            return self.crops(image), torch.full((5,), FINISHED), path
        _, _, height, width, _ = jpeg_frame(image.numpy())  # type: ignore[misc]
        u = torch.rand(23, dtype=torch.float64).tolist()  # the draw RandomResizedCropFlip makes
        top, left, h, w = self.crops.crop_box(height, width, u)
        return image, torch.tensor([top, left, h, w, int(u[22] < 0.5)]), path


class EncodedValItem:
    """Transform: (image, path) -> (payload, box, path) for validation (no randomness)."""

    def __init__(self, finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.finish = finish

    def __call__(self, item: tuple[torch.Tensor, str]) -> tuple[torch.Tensor, torch.Tensor, str]:
        image, path = item
        if image.dim() == 3:
            return self.finish(image), torch.full((5,), FINISHED), path
        return image, torch.zeros(5, dtype=torch.long), path


def item_transforms(cfg: Config, crops: CropSchedule) -> tuple[EncodedTrainItem, EncodedValItem]:
    """The workers' transforms for training and validation items."""
    boxes = T.RandomResizedCropFlip(crops.end, cfg.interpolation, (cfg.train_crop_scale, 1.0))
    val = T.val_transform(cfg.val_resize_size, cfg.val_crop_size, cfg.interpolation)
    return EncodedTrainItem(boxes), EncodedValItem(val)


@dataclass
class EncodedBatch:
    """A batch as the workers ship it: every payload in one flat uint8 tensor."""

    data: torch.Tensor  # the payloads, concatenated (flattened: finished images too)
    sizes: list[int]  # bytes of each payload
    boxes: torch.Tensor  # (N, 5): crop box and flip, or FINISHED
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
    """A batch's images on ``device``: decoded together, then each cropped and resized to
    ``size`` (training: the worker's box and flip) or resized to ``resize`` and centre-cropped
    to ``size`` (validation, ``resize`` given)."""

    size: int
    interpolation: str = "bilinear"
    resize: int | None = None

    def __call__(self, batch: tuple[EncodedBatch, torch.Tensor], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        encoded, labels = batch
        images = decode(encoded, device, self.size)
        mode = T.interpolation_mode(self.interpolation)
        out = [image if box[0] == FINISHED else self.crop(image, box, mode)
               for image, box in zip(images, encoded.boxes.tolist())]
        return torch.stack(out), labels.to(device, non_blocking=True)

    def crop(self, image: torch.Tensor, box: list[int], mode) -> torch.Tensor:
        """One decoded image -> its (3, size, size) crop."""
        if self.resize is not None:
            image = F.resize(image, [self.resize], interpolation=mode, antialias=True)
            return F.center_crop(image, [self.size])
        top, left, h, w, flip = box
        crop = image[:, top:top + h, left:left + w]
        out = F.resize(crop, [self.size, self.size], interpolation=mode, antialias=True)
        return out.flip(-1) if flip else out


def device_crops(cfg: Config, crops: CropSchedule) -> tuple[DeviceCrops, DeviceCrops]:
    """The training and validation ``DeviceCrops`` of the flags."""
    return (DeviceCrops(crops.end, cfg.interpolation),
            DeviceCrops(cfg.val_crop_size, cfg.interpolation, cfg.val_resize_size))


def decode(encoded: EncodedBatch, device: torch.device, size: int) -> list[torch.Tensor]:
    """Every payload of ``encoded`` as a uint8 CHW image on ``device``: JPEGs in one batched
    decode_jpeg call (nvJPEG on CUDA), finished (3, size, size) images copied."""
    payloads = list(torch.split(encoded.data, encoded.sizes))
    jpegs = [i for i, box in enumerate(encoded.boxes[:, 0].tolist()) if box != FINISHED]
    images: list[torch.Tensor] = [torch.empty(0)] * len(payloads)
    for i, image in zip(jpegs, decode_jpegs([payloads[i] for i in jpegs],
                                            [encoded.paths[i] for i in jpegs], device)):
        images[i] = image
    for i in set(range(len(payloads))) - set(jpegs):
        images[i] = payloads[i].view(3, size, size).to(device, non_blocking=True)
    return images


def decode_jpegs(data: list[torch.Tensor], paths: list[str], device: torch.device
                 ) -> list[torch.Tensor]:
    """JPEG bytes -> RGB images on ``device``; a batch that fails is decoded one by one, and an
    image the device cannot decode is decoded by the CPU path (DataError naming a bad file)."""
    if not data:
        return []
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    images = []
    for one, path in zip(data, paths):
        try:
            images.append(decode_jpeg(one, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            image = T.decode_image(one.numpy().tobytes(), path)
            images.append(image.to(device))  # type: ignore[union-attr]
    return images


# ---------------------------------------------------------------- the stream


Finish = Callable[[object, torch.device], tuple[torch.Tensor, torch.Tensor]]


class DeviceBatches:
    """``loader``'s batches as device tensors (uint8 images, labels), made one batch ahead on a
    side CUDA stream: the copy (and the decode) of batch k+1 overlaps the step on batch k.

    ``finish`` turns a loader batch into device tensors (``DeviceCrops``); None copies a batch
    of uint8 images. On the CPU the batches are finished in turn, without a stream.
    """

    def __init__(self, loader: Iterable, device: torch.device, finish: Finish | None) -> None:
        self.loader, self.device, self.finish = loader, device, finish

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _load(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.finish is not None:
            return self.finish(batch, self.device)
        images, labels = batch
        return (images.to(self.device, non_blocking=True),
                labels.to(self.device, non_blocking=True))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.device.type != "cuda":
            yield from (self._load(batch) for batch in self.loader)
            return
        stream = torch.cuda.Stream(self.device)
        pending = None
        for batch in self.loader:
            with torch.cuda.stream(stream):
                ready = self._load(batch)
            if pending is not None:
                yield self._hand_over(pending, stream)
            pending = ready
        if pending is not None:
            yield self._hand_over(pending, stream)

    def _hand_over(self, tensors: tuple[torch.Tensor, torch.Tensor], stream: torch.cuda.Stream
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the training stream wait for ``stream``'s work on ``tensors``, and keep their
        memory from being reused before the training stream is done with them."""
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(stream)
        for t in tensors:
            t.record_stream(current)
        return tensors


def device_batches(loader: Iterable, device: torch.device, finish: Finish | None) -> Iterable:
    """``loader`` as the training step should read it: on the device through a side stream
    (CUDA) and/or finished by ``finish``; unchanged on the CPU without ``finish``."""
    if device.type != "cuda" and finish is None:
        return loader
    return DeviceBatches(loader, device, finish)
