"""JPEG bytes -> uint8 RGB CHW tensors with torchvision.io's decoder or TorchCodec's
(``settings.decoders`` chooses; ``"tensor"`` is torchvision's), on the CPU or, batched, on a CUDA
device (nvJPEG).

The same pixels whichever decoder runs, and the classic script's: its PIL loader ignores the EXIF
orientation, and so does torchvision's decoder; TorchCodec applies it, so its image is turned
back here (a flip or a transpose of the decoded pixels: exact). Both decoders raise RuntimeError
for a file they cannot decode; ``data.transforms`` then lets PIL have the last word.
"""

from __future__ import annotations

import torch

from imagenet.settings import devices

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
