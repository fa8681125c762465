"""The built-in demo data set: procedurally drawn shape/texture classes as a JPEG ImageFolder.

Classes differ by shape or texture, never by colour (colours are random per image), and survive
RandomResizedCrop + horizontal flip (no class is the mirror image of another), so a ResNet-18
learns them in a few CPU minutes. Every image is a pure function of (seed, split, class, index).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw, ImageFilter

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the atomic rename alone still guards the data
    fcntl = None

log = logging.getLogger(__name__)

SHAPES = ("circle", "square", "triangle", "cross", "ring")
TEXTURES = ("stripes_h", "stripes_v", "checker", "diagonal", "dots")
DEMO_CLASSES: tuple[str, ...] = SHAPES + TEXTURES
MARKER = ".demo-complete"
FORMAT_VERSION = 2  # bump whenever the drawing changes, so old data sets are regenerated
SUPERSAMPLE = 2  # draw masks at 2x and downsample: anti-aliased edges without blur artefacts
JPEG_QUALITY = 90

Colour = tuple[int, int, int]
Point = tuple[float, float]


def _colour_pair(rng: random.Random) -> tuple[Colour, Colour]:
    """Foreground and background colours far enough apart that the pattern stays visible."""
    while True:
        fg = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        bg = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        if math.dist(fg, bg) > 130:
            return fg, bg


def _smooth_field(rng: random.Random, centre: Colour, spread: int, size: int) -> Image.Image:
    """A smooth colour gradient around ``centre``: a random 2x2 image upsampled bilinearly."""
    corners = Image.new("RGB", (2, 2))
    corners.putdata([tuple(min(255, max(0, c + rng.randint(-spread, spread))) for c in centre)
                     for _ in range(4)])
    return corners.resize((size, size), Image.Resampling.BILINEAR)


def _polygon(cx: float, cy: float, r: float, corners: int, angle: float) -> list[Point]:
    """Vertices of a regular polygon centred at (cx, cy) with circumradius r."""
    return [(cx + r * math.cos(angle + 2 * math.pi * k / corners),
             cy + r * math.sin(angle + 2 * math.pi * k / corners)) for k in range(corners)]


def _bar(cx: float, cy: float, length: float, width: float, angle: float) -> list[Point]:
    """Corners of a rectangle of (length, width) centred at (cx, cy), long side along ``angle``."""
    dx, dy = math.cos(angle), math.sin(angle)
    nx, ny = -dy, dx
    half_l, half_w = length / 2, width / 2
    return [(cx + sx * half_l * dx + sy * half_w * nx, cy + sx * half_l * dy + sy * half_w * ny)
            for sx, sy in ((-1, -1), (1, -1), (1, 1), (-1, 1))]


def _draw_shape(draw: ImageDraw.ImageDraw, name: str, side: int, rng: random.Random) -> None:
    """One object at a random position, size and rotation."""
    r = side * rng.uniform(0.2, 0.4)
    cx, cy = (side * rng.uniform(0.32, 0.68) for _ in range(2))
    angle = rng.uniform(0, 2 * math.pi)
    if name == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    elif name == "ring":
        width = max(2, round(r * rng.uniform(0.2, 0.35)))
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=255, width=width)
    elif name == "square":
        draw.polygon(_polygon(cx, cy, r, 4, angle), fill=255)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, r * 1.15, 3, angle), fill=255)  # same area as the square
    elif name == "cross":
        width = 2 * r * rng.uniform(0.25, 0.4)
        for a in (angle, angle + math.pi / 2):
            draw.polygon(_bar(cx, cy, 2 * r, width, a), fill=255)
    else:
        raise ValueError(f"unknown demo shape {name!r}")


def _draw_stripes(draw: ImageDraw.ImageDraw, side: int, angle: float, rng: random.Random) -> None:
    """Parallel bars along ``angle`` covering the whole canvas, random period and phase."""
    period = side * rng.uniform(0.1, 0.2)
    width = period * rng.uniform(0.35, 0.6)
    nx, ny = -math.sin(angle), math.cos(angle)
    reach = side  # half-diagonal of the canvas is < side, so bars of length 2*side cover it
    offset = -reach + rng.uniform(0, period)
    while offset < reach:
        cx, cy = side / 2 + offset * nx, side / 2 + offset * ny
        draw.polygon(_bar(cx, cy, 2 * reach, width, angle), fill=255)
        offset += period


def _lattice(side: int, step: float, angle: float, rng: random.Random) -> Iterator[tuple]:
    """(i, j, x, y) of a rotated square lattice with random phase that covers the canvas."""
    ux, uy = step * math.cos(angle), step * math.sin(angle)
    phase_i, phase_j = rng.random(), rng.random()
    n = int(side / step) + 2
    for i in range(-n, n + 1):
        for j in range(-n, n + 1):
            a, b = i + phase_i, j + phase_j
            yield i, j, side / 2 + a * ux - b * uy, side / 2 + a * uy + b * ux


def _draw_texture(draw: ImageDraw.ImageDraw, name: str, side: int, rng: random.Random) -> None:
    """A pattern over the whole canvas; small random tilts keep horizontal/vertical apart."""
    tilt = math.radians(rng.uniform(-12, 12))
    if name == "stripes_h":
        _draw_stripes(draw, side, tilt, rng)
    elif name == "stripes_v":
        _draw_stripes(draw, side, math.pi / 2 + tilt, rng)
    elif name == "diagonal":  # either direction, so a horizontal flip stays in the class
        _draw_stripes(draw, side, rng.choice((1, -1)) * math.pi / 4 + tilt, rng)
    elif name == "checker":
        step = side * rng.uniform(0.08, 0.16)
        angle = math.radians(rng.uniform(-20, 20))
        for i, j, x, y in _lattice(side, step, angle, rng):
            if (i + j) % 2 == 0:
                draw.polygon(_polygon(x, y, step / math.sqrt(2), 4, angle + math.pi / 4),
                             fill=255)
    elif name == "dots":
        step = side * rng.uniform(0.12, 0.2)
        radius = step * rng.uniform(0.2, 0.33)
        for _, _, x, y in _lattice(side, step, rng.uniform(0, math.pi / 2), rng):
            draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=255)
    else:
        raise ValueError(f"unknown demo texture {name!r}")


def _noise(rng: random.Random, size: int, amplitude: int) -> Image.Image:
    """Seeded uniform RGB noise centred on 128 (PIL's effect_noise ignores our seed)."""
    lut = [128 + (v - 128) * amplitude // 128 for v in range(256)] * 3
    return Image.frombytes("RGB", (size, size), rng.randbytes(3 * size * size)).point(lut)


def draw_sample(name: str, rng: random.Random, size: int) -> Image.Image:
    """One RGB image of class ``name``, drawn from ``rng`` alone."""
    side = size * SUPERSAMPLE
    mask = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(mask)
    if name in SHAPES:
        _draw_shape(draw, name, side, rng)
    else:
        _draw_texture(draw, name, side, rng)
    mask = mask.resize((size, size), Image.Resampling.BOX)
    fg, bg = _colour_pair(rng)
    img = Image.composite(_smooth_field(rng, fg, 40, size), _smooth_field(rng, bg, 60, size), mask)
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.7)))
    return ImageChops.add(img, _noise(rng, size, rng.randint(8, 40)), 1.0, -128)


def _write_split(folder: Path, split: str, per_class: int, size: int, seed: int) -> None:
    """ROOT/<split>/<class>/<index>.jpg for every class."""
    for name in DEMO_CLASSES:
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            # A string seed is hashed with SHA-512: stable across runs, processes and order.
            rng = random.Random(f"{seed}/{split}/{name}/{i}")
            draw_sample(name, rng, size).save(folder / name / f"{i:05d}.jpg",
                                              quality=JPEG_QUALITY)


def _read_marker(root: Path) -> dict | None:
    """The parameters recorded in ROOT's marker; None when there is none; {} if unreadable."""
    try:
        return json.loads((root / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {}  # ours (the marker exists) but damaged: treat as stale


def _check_replaceable(root: Path) -> None:
    """Raise unless ROOT is absent, empty, or a demo data set (which we may replace)."""
    if not root.exists() or _read_marker(root) is not None:
        return
    if not root.is_dir() or any(root.iterdir()):
        raise ValueError(f"{root} exists and was not made by the demo generator (no {MARKER}); "
                         "refusing to overwrite it: remove it or choose another output folder")


@contextlib.contextmanager
def _swap_lock(root: Path) -> Iterator[None]:
    """Serialise the check-and-rename of ROOT across processes (generation runs unlocked)."""
    if fcntl is None:
        yield
        return
    with open(root.parent / f".{root.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _install(tmp: Path, root: Path, params: dict) -> None:
    """Move the finished TMP into place as ROOT, replacing a stale demo set; losers discard."""
    with _swap_lock(root):
        if _read_marker(root) == params:
            return  # another process finished first; the caller deletes our copy
        _check_replaceable(root)
        if root.exists() and _read_marker(root) is not None:
            stale = Path(tempfile.mkdtemp(prefix=f".{root.name}-stale-", dir=root.parent))
            os.replace(root, stale / "old")  # one atomic step out of the way, then delete
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, root)  # atomic; also replaces an empty ROOT directory


def make_demo_dataset(root: Path, train_per_class: int = 100, val_per_class: int = 20,
                      image_size: int = 64, seed: int = 0) -> Path:
    """Write ROOT/train and ROOT/val once (no-op if present); safe for concurrent ranks."""
    root = Path(root)
    params = {"version": FORMAT_VERSION, "classes": list(DEMO_CLASSES),
              "train_per_class": train_per_class, "val_per_class": val_per_class,
              "image_size": image_size, "seed": seed}
    if _read_marker(root) == params:
        return root
    _check_replaceable(root)  # fail before spending time on images
    root.parent.mkdir(parents=True, exist_ok=True)
    log.info("=> writing the demo data set (%d classes x %d train + %d val, %d px) to %s",
             len(DEMO_CLASSES), train_per_class, val_per_class, image_size, root)
    # Each process writes its own hidden temp dir next to ROOT, so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-tmp-", dir=root.parent))
    try:
        _write_split(tmp / "train", "train", train_per_class, image_size, seed)
        _write_split(tmp / "val", "val", val_per_class, image_size, seed)
        (tmp / MARKER).write_text(json.dumps(params, indent=1) + "\n")
        _install(tmp, root, params)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already unless another process won
    return root
