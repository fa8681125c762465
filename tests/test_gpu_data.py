"""--decode-on-device (imagenet.data.device) on the CPU: the same crop boxes, flips and pixels as
the CPU path, image for image, from the same per-sample seeds; the files nvJPEG cannot take
(PNG, CMYK, truncated) handled by the workers; main.py trains the same weights either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY18, device_path_trains_the_same, write_image_folder
from PIL import Image
from torchvision.transforms.v2 import functional as F

from imagenet.data import device as gpu_data
from imagenet.data import prefetch, resample
from imagenet.data import transforms as T
from imagenet.data.folder import build_datasets
from imagenet.data.samplers import SeededDataset
from imagenet.errors import DataError, UsageError
from imagenet.settings.flags import parse_config
from imagenet.settings.images import crop_schedule
from imagenet.settings.plan import decode_path

CPU = torch.device("cpu")


def odd_files(folder: Path) -> dict[str, Path]:
    """Images beside the plain JPEGs: each kind of file the device path must cope with."""
    gradient = Image.linear_gradient("L").resize((90, 70))
    rgb = Image.merge("RGB", (gradient, gradient.rotate(90), gradient.transpose(0)))
    files = {"progressive": folder / "progressive.jpg", "grey": folder / "grey.jpg",
             "cmyk": folder / "cmyk.jpg", "png": folder / "image.png",
             "tiny": folder / "tiny.jpg"}
    rgb.save(files["progressive"], quality=85, progressive=True)
    gradient.save(files["grey"], quality=85)
    rgb.convert("CMYK").save(files["cmyk"], quality=85)
    rgb.save(files["png"])
    rgb.resize((9, 7)).save(files["tiny"], quality=85)
    return files


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = write_image_folder(tmp_path_factory.mktemp("data") / "data", classes=2,
                              train_per_class=6, val_per_class=3, size=48)
    for split in ("train", "val"):
        odd_files(root / split / "class0")
    return root


def device_items(dataset, keys, finish) -> torch.Tensor:
    """The images of ``keys`` through the device path, decoded on the CPU."""
    batch = gpu_data.collate([dataset[key] for key in keys])
    return finish(batch, CPU)[0]


def test_device_path_gives_the_cpu_path_s_images(folder: Path):
    cfg = parse_config(["data", "--train-crop-size", "24", "--val-resize-size", "30",
                        "--val-crop-size", "24", "--train-crop-scale", "0.2"])
    crops = crop_schedule(cfg)
    train, val, _ = build_datasets(cfg, crops, folder)
    train_enc, val_enc, _ = build_datasets(cfg, crops, folder, encoded=True)
    train_finish, val_finish = gpu_data.device_crops(cfg)
    n = len(train)
    assert n == len(train_enc) == 17
    keys = [(epoch, i) for epoch in (0, 1, 2) for i in range(n)]
    cpu = torch.stack([SeededDataset(train, 7)[k][0] for k in keys])
    device = device_items(SeededDataset(train_enc, 7), keys, train_finish)
    assert device.shape == (len(keys), 3, 24, 24)
    assert torch.equal(device, cpu)  # the same boxes, flips and pixels, epoch after epoch
    assert not torch.equal(cpu[:n], cpu[n:2 * n])  # (the epochs do differ)
    cpu_val = torch.stack([val[i][0] for i in range(len(val))])
    assert torch.equal(device_items(val_enc, range(len(val_enc)), val_finish), cpu_val)


def test_what_nvjpeg_gets_and_what_the_workers_decode(folder: Path, tmp_path: Path):
    files = {name: path.read_bytes() for name, path in odd_files(tmp_path).items()}
    plain = next((folder / "train" / "class1").glob("*.jpg")).read_bytes()
    assert gpu_data.jpeg_frame(plain)[:2] == (0xC0, 8)
    assert gpu_data.jpeg_frame(files["progressive"])[0] == 0xC2
    assert [gpu_data.device_decodable(files[k]) for k in ("progressive", "grey", "tiny")] == \
        [True, True, True]
    assert gpu_data.jpeg_frame(files["cmyk"])[4] == 4
    assert not gpu_data.device_decodable(files["cmyk"])  # nvJPEG's RGB output has no CMYK
    assert not gpu_data.device_decodable(files["png"])
    assert not gpu_data.device_decodable(plain[:-100])  # cut short: no end marker
    assert gpu_data.jpeg_frame(b"\xff\xd8\xff\xe0\x00") is None
    # A file cut short is decoded by the worker, whose error names it (as on the CPU path).
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(plain[: len(plain) // 2])
    with pytest.raises(DataError, match="cut.jpg"):
        gpu_data.read_encoded(cut)
    image, path = gpu_data.read_encoded(tmp_path / "image.png")
    assert image.shape == (3, 70, 90) and path.endswith("image.png")


@pytest.mark.parametrize("argv, device, shards, on", [
    ([], "cuda", False, True), ([], "cpu", False, False), (["--image-backend", "pil"], "cuda",
     False, False), (["--auto-augment", "ta_wide"], "cuda", False, False), ([], "cuda", True,
     True), (["--dummy"], "cuda", False, False), (["--decode-on-device", "on"], "cpu", False,
     True), (["--decode-on-device", "off"], "cuda", False, False)])
def test_when_the_device_decodes(argv, device, shards, on):
    fmt = "shards" if shards else "dummy" if "--dummy" in argv else "folder"
    assert decode_path(parse_config(["data", *argv]), fmt, device).on_device is on


@pytest.mark.parametrize("workers, on", [(0, True), (3, True), (7, True), (8, False),
                                         (15, False)])
def test_auto_leaves_decoding_to_enough_workers(workers, on):
    """An H200 with 16 cores (15 workers) trained faster on the workers' JPEGs (4,013 img/s)
    than with the GPU decoding (3,384): auto must not pick the device path there."""
    decode = decode_path(parse_config(["data"]), "folder", "cuda", workers)
    assert decode.on_device is on
    assert decode.why.startswith("auto: ") and f"{workers} loader worker(s)" in decode.why
    assert decode_path(parse_config(["data", "--decode-on-device", "on"]), "folder", "cuda",
                       workers).on_device  # on is on


@pytest.mark.parametrize("argv, shards, words", [
    (["--image-backend", "pil"], False, "--image-backend pil decodes with PIL"),
    (["--random-erase", "0.25"], True, "--random-erase runs per image on the CPU")])
def test_impossible_requests_name_the_flag(argv, shards, words):
    cfg = parse_config(["data", "--decode-on-device", "on", *argv])
    with pytest.raises(UsageError, match=f"--decode-on-device on: {words}"):
        decode_path(cfg, "shards" if shards else "folder", "cuda")


def variants_of_every_data_flag() -> list[list[str]]:
    """A command line per value of each data flag other than its default: every choice, or a
    number changed (those the flag's own checks refuse are left out)."""
    import dataclasses

    from imagenet.settings.flags import Config

    found = []
    for f in dataclasses.fields(Config):
        meta = f.metadata
        if meta.get("group") != "data" or not meta["names"][0].startswith("--"):
            continue
        flag, kwargs = meta["names"][-1], meta["kwargs"]
        if kwargs.get("action") in ("store_true", "store_false"):
            values = [[]]
        elif "choices" in kwargs:
            values = [[str(c)] for c in kwargs["choices"] if c != f.default]
        elif isinstance(f.default, bool) or not isinstance(f.default, (int, float)):
            continue  # paths, names, lists: not an augmentation
        else:
            changed = (f.default + 1) / 2 if isinstance(f.default, float) and f.default < 1 \
                else f.default + 1  # a probability or scale stays within (0, 1]
            values = [[str(changed)]]
        for value in values:
            argv = ["data", flag, *value]
            try:
                parse_config(argv)
            except (UsageError, SystemExit):
                continue
            found.append(argv[1:])
    return found


def test_no_data_flag_is_left_out_by_the_device_path():
    """The device path crops, resizes and flips; any other per-image step of the CPU path's
    training transform must rule the device path out (its flag marked ``cpu_per_image`` in
    settings/flags.py), or --decode-on-device would silently train without it. Every data
    flag, every value."""
    from imagenet.data.folder import build_transforms

    plain = {type(step) for step in build_transforms(parse_config(["data"]),
                                                     crop_schedule(parse_config(["data"])))[0]
             .transforms}
    checked = []
    for argv in variants_of_every_data_flag():
        cfg = parse_config(["data", *argv])
        if not decode_path(cfg, "folder", "cuda").on_device:
            continue
        train = build_transforms(cfg, crop_schedule(cfg))[0]
        steps = getattr(train, "transforms", None) or train.build(cfg.train_crop_size).transforms
        assert {type(step) for step in steps} <= plain, (argv, steps)
        checked.append(argv)
    assert ["--interpolation", "bicubic"] in checked and ["--train-crop-scale", "0.54"] in checked
    # (the test sees the flags: what the marked flags rule out is not checked above)
    assert ["--auto-augment", "ra"] not in checked and ["--random-erase", "0.5"] not in checked


def test_batches_on_the_cpu_pass_through_or_are_finished():
    batches = [(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]))]
    assert prefetch.device_batches(batches, CPU, None) is batches
    doubled = prefetch.device_batches(batches, CPU, lambda b, d: (b[0] + 1, b[1]))
    assert len(doubled) == 1
    assert [int(images.sum()) for images, _ in doubled] == [2 * 3 * 4 * 4]


@pytest.mark.slow
def test_main_trains_the_same_weights_with_the_device_path(folder: Path, tmp_path: Path):
    """Seeded runs through the CPU path and the device path (on the CPU, 2 workers shipping
    JPEG bytes, the odd files decoded by the workers) end with the same weights and accuracy."""
    device_path_trains_the_same(folder, tmp_path, *TINY18)


# ---------------------------------------------------------------- one batched resampling


def windows(boxes, sizes):
    """Training windows of ``boxes`` (top, left, h, w), resized to ``sizes``."""
    box = torch.tensor(boxes)
    full, zero = torch.tensor(sizes), torch.zeros(len(boxes), dtype=torch.long)
    return (resample.Windows(box[:, 0], box[:, 2], full, zero),
            resample.Windows(box[:, 1], box[:, 3], full, zero))


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_batched_resampling_is_torchvision_s_antialiased_resize(interpolation):
    g = torch.Generator().manual_seed(0)
    shapes = [(60, 80), (47, 33), (120, 90), (20, 25), (10, 12)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in shapes]
    boxes = [(5, 7, 40, 50), (0, 0, 47, 33), (10, 20, 100, 60), (2, 3, 15, 17), (0, 0, 10, 12)]
    flips = torch.tensor([0, 1, 0, 1, 0])
    rows, cols = windows(boxes, [24] * 5)
    out = resample.resample(images, rows, cols, 24, flips, interpolation)
    mode = T.interpolation_mode(interpolation)
    for image, (top, left, h, w), flip, got in zip(images, boxes, flips, out):
        crop = image[:, top:top + h, left:left + w]
        # The loader workers' resize: torchvision's uint8 kernel (fixed-point, the horizontal
        # pass kept in uint8, as PIL). Upscaled noise (the last two) makes bicubic overshoot:
        # rounded only at the end, the batched path was up to 19 grey levels off there.
        fixed = F.resize(crop, [24, 24], interpolation=mode, antialias=True)
        fixed = fixed.flip(-1) if flip else fixed
        assert (got.int() - fixed.int()).abs().max() <= 1


def test_batched_validation_crops_are_resize_then_centre_crop():
    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in ((60, 80), (81, 50), (36, 36))]
    crops = gpu_data.DeviceCrops(24, "bilinear", resize=30, batched=True)
    got = crops.resample(images, [[0] * 6] * 3, 24)
    for image, one in zip(images, got):
        exact = F.center_crop(F.resize(image.float(), [30], antialias=True), [24])
        assert (one.float() - exact.round().clamp(0, 255)).abs().max() <= 1


def test_size_groups_cover_every_image_once_within_the_budget():
    shapes = [(500, 375), (4000, 3000), (333, 500), (20, 20), (500, 500), (375, 500)]
    groups = resample.size_groups(shapes, budget=3 * 600 * 600 * 2)
    assert sorted(i for group in groups for i in group) == list(range(len(shapes)))
    assert [1] in groups  # the huge image alone
    for group in groups:
        h = max(shapes[i][0] for i in group)
        w = max(shapes[i][1] for i in group)
        assert len(group) == 1 or len(group) * h * w * 3 <= 3 * 600 * 600 * 2


def test_the_batched_device_path_gives_the_cpu_path_s_crops(folder: Path):
    """Batched (as on CUDA) on the CPU: the same images as the CPU path within one grey level,
    the files the workers finished included."""
    cfg = parse_config(["data", "--train-crop-size", "24", "--train-crop-scale", "0.2"])
    crops = crop_schedule(cfg)
    train, _, _ = build_datasets(cfg, crops, folder)
    encoded, _, _ = build_datasets(cfg, crops, folder, encoded=True)
    keys = [(1, i) for i in range(len(train))]
    cpu = torch.stack([SeededDataset(train, 5)[k][0] for k in keys])
    batch = gpu_data.collate([SeededDataset(encoded, 5)[k] for k in keys])
    batched = gpu_data.DeviceCrops(24, batched=True)(batch, CPU)[0]
    assert batched.shape == cpu.shape
    assert (batched.int() - cpu.int()).abs().max() <= 1


def test_progressive_sizes_on_the_device_path_are_the_cpu_path_s(folder: Path):
    cfg = parse_config(["data", "--train-crop-start", "16", "--train-crop-ramp", "0", "2",
                        "--train-crop-size", "32", "--train-crop-multiple", "8",
                        "--train-crop-scale", "0.2"])
    crops = crop_schedule(cfg)
    train, _, _ = build_datasets(cfg, crops, folder)
    encoded, _, _ = build_datasets(cfg, crops, folder, encoded=True)
    finish = gpu_data.device_crops(cfg)[0]
    for epoch, size in enumerate((16, 24, 32)):
        keys = [(epoch, i) for i in range(len(train))]
        cpu = torch.stack([SeededDataset(train, 9)[k][0] for k in keys])
        device = device_items(SeededDataset(encoded, 9), keys, finish)
        assert device.shape == (len(keys), 3, size, size)
        assert torch.equal(device, cpu)  # crop for crop, at the epoch's size
