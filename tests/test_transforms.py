"""Image loading and transforms: both backends agree, odd formats load as RGB, errors name files."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from imagenet.data import transforms as T
from imagenet.errors import DataError

RED = (255, 0, 0)
# torchvision 0.29 deprecates its decoders in favour of TorchCodec (not installed here).
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def textured(width: int = 120, height: int = 90, seed: int = 0) -> Image.Image:
    """A smooth colour field plus noise: compresses and resamples like a small photo."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.BICUBIC), np.float32)
    noise = rng.normal(0, 8, (height, width, 3))
    return Image.fromarray(np.clip(smooth + noise, 0, 255).astype(np.uint8))


@pytest.fixture
def jpeg(tmp_path: Path) -> Path:
    """A 120x90 photo-like RGB JPEG."""
    path = tmp_path / "photo.jpg"
    textured().save(path, quality=90)
    return path


def as_chw(img: torch.Tensor | Image.Image) -> torch.Tensor:
    """Either backend's image as a uint8 CHW tensor."""
    return img if isinstance(img, torch.Tensor) else T.to_chw(img)


# --- loading -------------------------------------------------------------------------------------

def test_fast_jpeg_decode_matches_pil(jpeg: Path) -> None:
    fast = T.load_image(jpeg, "tensor")
    classic = T.load_image(jpeg, "pil")
    assert isinstance(classic, Image.Image) and classic.mode == "RGB"
    assert fast.dtype == torch.uint8 and fast.shape == (3, 90, 120)
    # Both are libjpeg-turbo with the same IDCT and chroma upsampling: bit-identical here (mean
    # |diff| 0.000 on these and the benchmark's 200 photo-like JPEGs); slack for other builds.
    diff = (fast.int() - as_chw(classic).int()).abs()
    assert diff.float().mean() < 0.5 and diff.max() <= 4


def write_odd_formats(folder: Path) -> dict[str, Path]:
    """Solid-red images in every format/mode the fast decoder might mishandle."""
    red = Image.new("RGB", (32, 24), RED)
    paths = {name: folder / name for name in
             ("rgb.png", "gray.jpg", "cmyk.jpg", "rgba.png", "palette.gif", "rgb.bmp",
              "png_named.jpg")}
    red.save(paths["rgb.png"])
    Image.new("L", (32, 24), 128).save(paths["gray.jpg"], quality=95)
    red.convert("CMYK").save(paths["cmyk.jpg"], quality=95)
    Image.new("RGBA", (32, 24), (*RED, 128)).save(paths["rgba.png"])
    red.convert("P").save(paths["palette.gif"])
    red.save(paths["rgb.bmp"])
    red.save(paths["png_named.jpg"], format="PNG")  # ImageNet has a PNG named .JPEG
    return paths


@pytest.mark.parametrize("backend", T.BACKENDS)
def test_odd_formats_load_as_rgb_with_right_colours(tmp_path: Path, backend: str) -> None:
    for name, path in write_odd_formats(tmp_path).items():
        img = as_chw(T.load_image(path, backend))
        assert img.shape == (3, 24, 32) and img.dtype == torch.uint8, name
        mean = img.float().mean(dim=(1, 2))
        expected = torch.tensor([128.0] * 3 if name == "gray.jpg" else RED)
        assert (mean - expected).abs().max() < 4, (name, mean.tolist())


@pytest.mark.parametrize("mode", ["CMYK", "L"])
def test_cmyk_and_gray_jpeg_fast_path_matches_pil_on_texture(tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"{mode}.jpg"
    textured().convert(mode).save(path, quality=95)
    fast, classic = T.load_image(path, "tensor"), as_chw(T.load_image(path, "pil"))
    assert fast.shape == classic.shape == (3, 90, 120)
    assert (fast.int() - classic.int()).abs().float().mean() < 0.5  # measured: identical


@pytest.mark.parametrize("backend", T.BACKENDS)
def test_unreadable_files_raise_data_error_naming_the_file(tmp_path: Path, jpeg: Path,
                                                         backend: str) -> None:
    data = jpeg.read_bytes()
    broken = {"truncated.jpg": data[: len(data) // 2], "no_end_marker.jpg": data[:-2],
              "garbage.jpg": b"\xff\xd8\xff" + bytes(range(256)) * 4,
              "not_an_image.png": b"hello, world\n" * 50, "empty.jpg": b""}
    for name, content in broken.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError, match=f"cannot read image .*{name}"):
            T.load_image(path, backend)
    with pytest.raises(DataError, match="missing.jpg"):
        T.load_image(tmp_path / "missing.jpg", backend)


def test_unknown_backend_is_rejected(jpeg: Path) -> None:
    with pytest.raises(ValueError, match="backend"):
        T.load_image(jpeg, "opencv")


# --- transforms ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", T.BACKENDS)
@pytest.mark.parametrize("auto_augment", [None, *T.AUTO_AUGMENT])
def test_train_transform_gives_uint8_crops(jpeg: Path, backend: str,
                                           auto_augment: str | None) -> None:
    tf = T.train_transform(48, auto_augment=auto_augment, random_erase=0.5, backend=backend)
    img = T.load_image(jpeg, backend)
    for _ in range(3):
        out = tf(img)
        assert out.shape == (3, 48, 48) and out.dtype == torch.uint8 and out.is_contiguous()


@pytest.mark.parametrize("interpolation", list(T.INTERPOLATIONS))
def test_backends_agree_on_shape_dtype_and_range(tmp_path: Path, interpolation: str) -> None:
    # One colour plus noise: every random crop has the same statistics, whatever its box.
    rng = np.random.default_rng(0)
    pixels = np.array([200, 100, 50]) + rng.normal(0, 20, (90, 120, 3))
    path = tmp_path / "noise.jpg"
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    fast, classic = (T.train_transform(64, interpolation, backend=b)(T.load_image(path, b))
                     for b in T.BACKENDS)
    assert fast.shape == classic.shape == (3, 64, 64)
    assert fast.dtype == classic.dtype == torch.uint8
    for out in (fast, classic):
        assert (out.float().mean((1, 2)) - torch.tensor([200.0, 100, 50])).abs().max() < 8
    assert abs(fast.float().std() - classic.float().std()) < 0.1 * classic.float().std()


def _colours(img: torch.Tensor) -> set[tuple[int, ...]]:
    """The distinct RGB triples of a uint8 CHW image."""
    return set(map(tuple, img.flatten(1).T.tolist()))


@pytest.mark.parametrize("backend", T.BACKENDS)
def test_interpolation_changes_how_train_and_val_resize(jpeg: Path, backend: str) -> None:
    img = T.load_image(jpeg, backend)
    source = _colours(as_chw(img))
    outputs = {}
    for name in T.INTERPOLATIONS:
        torch.manual_seed(0)  # the same crop box and flip for every mode
        outputs[name] = (T.train_transform(48, name, backend=backend)(img),
                         T.val_transform(60, 48, name, backend=backend)(img))
    # nearest copies source pixels: no colour that is not in the photo
    assert all(_colours(out) <= source for out in outputs["nearest"])
    for i in (0, 1):  # bilinear and bicubic blend neighbours, each in its own way
        assert not _colours(outputs["bilinear"][i]) <= source
        assert not _colours(outputs["bicubic"][i]) <= source
        assert not torch.equal(outputs["bilinear"][i], outputs["bicubic"][i])


def test_random_erasing_fills_with_the_mean(jpeg: Path) -> None:
    tf = T.train_transform(64, random_erase=1.0)
    out = tf(T.load_image(jpeg, "tensor"))
    erased = (out == torch.tensor(T.ERASE_VALUE, dtype=torch.uint8).view(3, 1, 1)).all(0)
    assert erased.sum() >= 0.02 * 64 * 64 * 0.9  # v2 erases 2-33% of the area
    normalised = T.normalize(out[None])[0]
    assert normalised[:, erased].abs().max() < 0.01


def test_tensor_crop_is_a_flipped_resized_region(tmp_path: Path) -> None:
    # Left half black, right half white: every crop is black-left/white-right unless flipped,
    # and a flip must mirror it; both outcomes appear over a few seeds.
    img = torch.zeros(3, 100, 200, dtype=torch.uint8)
    img[:, :, 100:] = 255
    tf = T.RandomResizedCropFlip(32, scale=(0.9, 1.0))
    seen = set()
    for seed in range(12):
        torch.manual_seed(seed)
        out = tf(img)
        seen.add(bool(out[:, :, 0].float().mean() > out[:, :, -1].float().mean()))
    assert seen == {True, False}


def test_crop_box_follows_torchvision_rules_and_distribution() -> None:
    from torchvision.transforms import v2

    ours, theirs = T.RandomResizedCropFlip(224), v2.RandomResizedCrop(224)
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        height, width = torch.randint(20, 600, (2,), generator=g).tolist()
        top, left, h, w = ours.crop_box(height, width, torch.rand(22, generator=g).tolist())
        assert 0 <= top <= height - h and 0 <= left <= width - w and h > 0 and w > 0
    # No try fits (areas too large for the extreme shape): the centre crop clamped to 4:3.
    assert ours.crop_box(100, 1000, [0.999] * 22) == (0, 433, 100, 133)
    # Same distribution as torchvision's sampler: mean area, aspect and position agree.
    torch.manual_seed(0)
    image = torch.zeros(3, 300, 400)
    boxes = {"ours": torch.tensor([ours.crop_box(300, 400, torch.rand(22).tolist())
                                   for _ in range(3000)], dtype=torch.float64),
             "theirs": torch.tensor([list(theirs.make_params([image]).values())
                                     for _ in range(3000)], dtype=torch.float64)}
    stats = {k: torch.stack([b[:, 2] * b[:, 3] / 120_000, (b[:, 3] / b[:, 2]).log(),
                             (b[:, 0] + b[:, 2] / 2) / 300, (b[:, 1] + b[:, 3] / 2) / 400]
                            ).mean(1) for k, b in boxes.items()}
    assert torch.allclose(stats["ours"], stats["theirs"], atol=0.02), stats


def test_val_transform_is_deterministic_and_centre_crops(tmp_path: Path) -> None:
    # A 100x80 image with a distinct centre: resize 40 -> 50x40, centre crop 32.
    arr = np.zeros((80, 100, 3), np.uint8)
    arr[30:50, 40:60] = 255
    path = tmp_path / "centre.png"
    Image.fromarray(arr).save(path)
    for backend in T.BACKENDS:
        tf = T.val_transform(40, 32, backend=backend)
        img = T.load_image(path, backend)
        first, second = tf(img), tf(img)
        assert torch.equal(first, second) and first.shape == (3, 32, 32)
        assert first.is_contiguous() and first.dtype == torch.uint8
        # The white square sits in the middle of the crop: 8x8 px at 12..20 after resize.
        assert first[:, 13:19, 13:19].min() > 200 and first[:, :4, :4].max() < 50


def test_val_backends_agree_within_one_level(jpeg: Path) -> None:
    fast = T.val_transform(80, 64)(T.load_image(jpeg, "tensor"))
    classic = T.val_transform(80, 64, backend="pil")(T.load_image(jpeg, "pil"))
    diff = (fast.int() - classic.int()).abs()
    # torch's uint8 antialiased resize reproduces PIL's to rounding: measured mean 0.002 on
    # photo-like JPEGs (benchmarks/bench.py data); allow some slack.
    assert diff.float().mean() < 0.1 and diff.max() <= 2


def test_transforms_are_picklable(jpeg: Path) -> None:
    torch.manual_seed(0)
    for backend in T.BACKENDS:
        for tf in (T.train_transform(32, "bicubic", "ta_wide", random_erase=0.25,
                                     backend=backend),
                   T.val_transform(40, 32, backend=backend)):
            clone = pickle.loads(pickle.dumps(tf))
            img = T.load_image(jpeg, backend)
            torch.manual_seed(1)
            expected = tf(img)
            torch.manual_seed(1)
            assert torch.equal(clone(img), expected)


# --- normalize -----------------------------------------------------------------------------------

def test_normalize_gives_standard_values_dtype_and_layout() -> None:
    # Pixels drawn around the ImageNet mean/std come out ~N(0, 1) per channel.
    g = torch.Generator().manual_seed(0)
    mean = torch.tensor(T.IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(T.IMAGENET_STD).view(1, 3, 1, 1) * 255
    batch = (mean + std * torch.randn(8, 3, 32, 32, generator=g)).round().clamp(0, 255)
    out = T.normalize(batch.to(torch.uint8))
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert out.mean((0, 2, 3)).abs().max() < 0.1
    assert (out.std((0, 2, 3)) - 1).abs().max() < 0.1
    cl = T.normalize(batch.to(torch.uint8), channels_last=True, dtype=torch.bfloat16)
    assert cl.dtype == torch.bfloat16
    assert cl.is_contiguous(memory_format=torch.channels_last) and cl.stride()[1] == 1
    assert torch.allclose(cl.float(), out, atol=0.02)


def test_normalize_matches_the_classic_formula() -> None:
    batch = torch.arange(256, dtype=torch.uint8).repeat(2, 3, 1, 1)  # (2, 3, 1, 256)
    mean = torch.tensor(T.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(T.IMAGENET_STD).view(1, 3, 1, 1)
    expected = (batch.float() / 255 - mean) / std
    assert torch.allclose(T.normalize(batch), expected, atol=1e-5)
    with pytest.raises(TypeError, match="uint8"):
        T.normalize(batch.float())
