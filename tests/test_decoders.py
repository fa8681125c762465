"""--decoder: torchvision.io's JPEG decoder or TorchCodec's give the same pixels (the classic
script's: EXIF orientation not applied, grayscale and CMYK converted as PIL does, a damaged file
named), auto picks torchvision's while it exists and TorchCodec's once it is gone, and a run
trains bit for bit the same whichever decodes. Real JPEG files; "torchvision without its
decoders" is a real torchvision with ``decode_jpeg`` taken out by a ``sitecustomize`` (fault
injection: the release that removes them is not out), "TorchCodec not installed" one that hides
the package."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, TINY, load_checkpoint, run_main
from PIL import Image

from imagenet.data import transforms as T
from imagenet.errors import DataError
from imagenet.settings import images
from imagenet.settings.flags import parse_config

DECODERS = ("tensor", "torchcodec")
RUN = [*TINY, "-b", "4", "-j", "1", "--epochs", "1", "--seed", "0"]  # a loader worker decodes
NO_TORCHVISION_DECODERS = """
import torchvision.io, torchvision.transforms.v2  # v2's JPEG augmentation binds decode_jpeg first
for name in ("decode_jpeg", "decode_image", "ImageReadMode"):
    delattr(torchvision.io, name)
"""
NO_TORCHCODEC = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "torchcodec" or name.startswith("torchcodec."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _Hide())
"""


def picture(height: int = 30, width: int = 50, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def jpeg_bytes(image: Image.Image, orientation: int | None = None, **options) -> bytes:
    out = io.BytesIO()
    if orientation is not None:
        exif = image.getexif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    image.save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def pil_pixels(data: bytes) -> torch.Tensor:
    """The classic loader's pixels: PIL, convert("RGB"), no EXIF transpose."""
    return torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_decodes_to_the_stored_pixels_with_either_decoder(orientation):
    data = jpeg_bytes(picture(), orientation)
    assert T.exif_orientation(data) == orientation
    want = pil_pixels(data)
    for backend in DECODERS:
        got = T.decode_image(data, "x.jpg", backend)
        assert got.shape == (3, 30, 50) and torch.equal(got, want), (backend, orientation)


def test_grayscale_cmyk_and_progressive_jpegs_are_the_same_pixels():
    rgb = picture()
    for data in (jpeg_bytes(rgb.convert("L")), jpeg_bytes(rgb.convert("CMYK")),
                 jpeg_bytes(rgb, progressive=True), jpeg_bytes(rgb, 1)):
        want = pil_pixels(data)
        for backend in DECODERS:
            assert torch.equal(T.decode_image(data, "x.jpg", backend), want), backend


def test_no_exif_and_odd_headers_read_as_orientation_1():
    assert T.exif_orientation(jpeg_bytes(picture())) == 1
    assert T.exif_orientation(b"\xff\xd8\xff\xe1\x00\x10Exif\0\0MM\0*\xff\xff") == 1
    assert T.exif_orientation(b"\xff\xd8") == 1


def test_a_damaged_jpeg_is_named_with_either_decoder(tmp_path):
    data = jpeg_bytes(picture())
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(data[:len(data) // 3])
    for backend in DECODERS:
        with pytest.raises(DataError, match="cut.jpg"):
            T.load_image(bad, backend)


def test_auto_is_torchvisions_while_it_decodes_and_pil_keeps_its_pipeline():
    auto = images.choose_decoding(parse_config(["d"]))
    assert images.torchvision_decodes() and images.torchcodec_installed()
    assert auto.backend == "tensor" and auto.why.startswith("auto:")
    assert images.choose_decoding(parse_config(["d", "--decoder", "torchcodec"])).backend \
        == "torchcodec"
    assert images.choose_decoding(parse_config(["d", "--image-backend", "pil"])).backend \
        == "pil"


def exif_folder(root: Path) -> Path:
    """Two classes of JPEGs, a third of them with an EXIF orientation of 6 or 8."""
    for split, n in (("train", 12), ("val", 3)):
        for c in range(2):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                turn = (None, 6, 8)[i % 3]
                (folder / f"{i}.jpg").write_bytes(
                    jpeg_bytes(picture(36 + c * 4, 44, seed=100 * c + i), turn))
    return root


def site(tmp_path: Path, name: str, code: str) -> dict[str, str]:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(code)
    from helpers import child_env

    return child_env(PYTHONPATH=f"{folder}:{ROOT}")


@pytest.mark.slow
def test_a_run_trains_the_same_bits_whichever_decoder_and_after_torchvisions_are_gone(tmp_path):
    """The same seed with torchvision's decoder, TorchCodec's, and a torchvision whose decoders
    are removed (auto then takes TorchCodec without a flag): the same weights, bit for bit; the
    start-up line says which decoder runs and why."""
    data = exif_folder(tmp_path / "data")
    flags = [str(data), *RUN]
    runs = {"torchvision": run_main(*flags, "--output-dir", str(tmp_path / "tv")),
            "torchcodec": run_main(*flags, "--decoder", "torchcodec",
                                   "--output-dir", str(tmp_path / "tc")),
            "gone": run_main(*flags, "--output-dir", str(tmp_path / "gone"),
                             env=site(tmp_path, "gone-site", NO_TORCHVISION_DECODERS))}
    for name, proc in runs.items():
        assert proc.returncode == 0, (name, proc.stdout[-2000:] + proc.stderr[-2000:])
    assert "=> images decoded by torchvision.io decode_jpeg (auto: " in runs["torchvision"].stdout
    assert "=> images decoded by TorchCodec decode_jpeg (--decoder torchcodec)" \
        in runs["torchcodec"].stdout
    assert "=> images decoded by TorchCodec decode_jpeg (auto: torchvision has no image " \
           "decoders)" in runs["gone"].stdout
    want = load_checkpoint(tmp_path / "tv" / "checkpoint.pth.tar")["state_dict"]
    for name in ("tc", "gone"):
        got = load_checkpoint(tmp_path / name / "checkpoint.pth.tar")["state_dict"]
        for key, value in want.items():
            assert torch.equal(value, got[key]), (name, key)


@pytest.mark.slow
def test_evaluation_and_tar_shards_decode_after_torchvisions_decoders_are_gone(tmp_path):
    """The other two readers of JPEG bytes, under a torchvision without decoders: -e of a
    folder gives the training run's own top-1, and a run on tar shards (their own reader)
    trains and evaluates with TorchCodec, picked without a flag."""
    from test_shards import prepare_shards

    data = exif_folder(tmp_path / "data")
    gone = site(tmp_path, "gone-site", NO_TORCHVISION_DECODERS)
    flags = RUN
    trained = run_main(str(data), *flags, "--output-dir", str(tmp_path / "run"))
    assert trained.returncode == 0, trained.stderr[-2000:]
    evaluated = run_main(str(data), *flags, "-e", "--resume",
                         str(tmp_path / "run" / "checkpoint.pth.tar"),
                         "--output-dir", str(tmp_path / "eval"), env=gone)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "=> images decoded by TorchCodec decode_jpeg (auto: " in evaluated.stdout
    top1 = [line.split()[:3] for line in trained.stdout.splitlines() if " * Acc@1" in line]
    assert [line.split()[:3] for line in evaluated.stdout.splitlines()
            if " * Acc@1" in line] == top1[-1:], evaluated.stdout[-2000:]
    made = prepare_shards(data, tmp_path / "shards", "--shard-max-images", "8")
    assert made.returncode == 0, made.stderr
    sharded = run_main(str(tmp_path / "shards"), *flags, "--output-dir", str(tmp_path / "s"),
                       env=gone)
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    assert "=> images decoded by TorchCodec decode_jpeg (auto: " in sharded.stdout
    assert " * Acc@1" in sharded.stdout


@pytest.mark.slow
def test_asking_for_a_decoder_that_is_not_there_is_one_line(tmp_path):
    """Before anything is read: exit 2, one line naming the flag and what to install."""
    for flag, code, message in (
            ("torchcodec", NO_TORCHCODEC, "--decoder torchcodec: TorchCodec is not installed; "
                                          f"pip install '{images.TORCHCODEC_PIN}'"),
            ("torchvision", NO_TORCHVISION_DECODERS, "--decoder torchvision: this torchvision "
                                                     "has no image decoders")):
        proc = run_main(str(tmp_path / "nowhere"), "--decoder", flag,
                        env=site(tmp_path, f"site-{flag}", code))
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert message in lines[0], lines
