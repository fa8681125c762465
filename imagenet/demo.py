"""The built-in demo data set: procedurally drawn shape/texture classes as a JPEG ImageFolder.

Classes differ by shape or texture, never by colour (colours are random per image), and survive
RandomResizedCrop + horizontal flip, so a small CNN learns them in a few CPU minutes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

log = logging.getLogger(__name__)

DEMO_CLASSES = ("circle", "square", "triangle", "cross", "ring", "stripes_h", "stripes_v",
                "checker", "diagonal", "dots")
MARKER = ".demo-complete"


def _colours(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A foreground and background colour far enough apart to see the shape."""
    while True:
        fg = tuple(rng.randrange(256) for _ in range(3))
        bg = tuple(rng.randrange(256) for _ in range(3))
        if sum(abs(a - b) for a, b in zip(fg, bg)) > 180:
            return fg, bg


def _shape(draw: ImageDraw.ImageDraw, name: str, cx: float, cy: float, r: float,
           angle: float, fg: tuple[int, ...]) -> None:
    """Draw one of the shape classes centred at (cx, cy) with radius r."""
    if name == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif name == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fg, width=max(2, int(r / 3)))
    else:
        corners = {"square": 4, "triangle": 3}.get(name)
        if corners:
            points = [(cx + r * math.cos(angle + 2 * math.pi * k / corners),
                       cy + r * math.sin(angle + 2 * math.pi * k / corners))
                      for k in range(corners)]
            draw.polygon(points, fill=fg)
        else:  # cross
            w = max(2, int(r / 2.5))
            for a in (angle, angle + math.pi / 2):
                dx, dy = r * math.cos(a), r * math.sin(a)
                draw.line([cx - dx, cy - dy, cx + dx, cy + dy], fill=fg, width=w)


def _texture(draw: ImageDraw.ImageDraw, name: str, size: int, rng: random.Random,
             fg: tuple[int, ...]) -> None:
    """Fill the whole image with one of the texture classes."""
    period = rng.randint(6, 12)
    width = max(2, period // 2)
    offset = rng.randrange(period)
    if name == "stripes_h":
        for y in range(offset - period, size, period):
            draw.rectangle([0, y, size, y + width - 1], fill=fg)
    elif name == "stripes_v":
        for x in range(offset - period, size, period):
            draw.rectangle([x, 0, x + width - 1, size], fill=fg)
    elif name == "diagonal":
        for d in range(-size + offset, 2 * size, period):
            draw.line([d, 0, d - size, size], fill=fg, width=width)
            draw.line([d - size, 0, d, size], fill=fg, width=width)  # both diagonals: flip-proof
    elif name == "checker":
        for y in range(0, size, period):
            for x in range(0, size, period):
                if (x // period + y // period) % 2 == 0:
                    draw.rectangle([x, y, x + period - 1, y + period - 1], fill=fg)
    else:  # dots
        for y in range(offset, size, period + 2):
            for x in range(offset, size, period + 2):
                draw.ellipse([x, y, x + width, y + width], fill=fg)


def draw_sample(class_index: int, seed: int, size: int) -> Image.Image:
    """One image of class ``class_index``; a pure function of its arguments."""
    rng = random.Random(seed)
    name = DEMO_CLASSES[class_index]
    fg, bg = _colours(rng)
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    if name in ("stripes_h", "stripes_v", "diagonal", "checker", "dots"):
        _texture(draw, name, size, rng, fg)
    else:
        r = size * rng.uniform(0.22, 0.4)
        cx, cy = (size / 2 + rng.uniform(-0.15, 0.15) * size for _ in range(2))
        _shape(draw, name, cx, cy, r, rng.uniform(0, 2 * math.pi), fg)
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.8)))
    noise = Image.effect_noise((size, size), rng.uniform(5, 25)).convert("RGB")
    return Image.blend(img, noise, 0.12)


def _write(tmp: Path, train_per_class: int, val_per_class: int, size: int, seed: int) -> None:
    for split, count, base in (("train", train_per_class, 0), ("val", val_per_class, 10**6)):
        for c, name in enumerate(DEMO_CLASSES):
            folder = tmp / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                sample_seed = (seed * 1_000_003 + base + c * 10_007 + i) & 0xFFFF_FFFF
                draw_sample(c, sample_seed, size).save(folder / f"{i:04d}.jpg", quality=90)


def make_demo_dataset(root: Path, train_per_class: int = 100, val_per_class: int = 20,
                      image_size: int = 64, seed: int = 0) -> Path:
    """Write (once) ROOT/train and ROOT/val; safe when several ranks call it at the same time."""
    root = Path(root)
    params = {"train_per_class": train_per_class, "val_per_class": val_per_class,
              "image_size": image_size, "seed": seed, "classes": list(DEMO_CLASSES)}
    marker = root / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return root
    if root.exists() and any(root.iterdir()) and not marker.is_file():
        raise ValueError(f"{root} exists and was not made by the demo generator; "
                         "remove it or choose another --output-dir")
    root.parent.mkdir(parents=True, exist_ok=True)
    log.info("=> writing the demo data set to %s", root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        _write(tmp, train_per_class, val_per_class, image_size, seed)
        (tmp / MARKER).write_text(json.dumps(params))
        if marker.is_file():  # stale parameters: replace the old set
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(tmp, root)  # atomic; fails if another rank got there first
        except OSError:
            if not (marker.is_file() and json.loads(marker.read_text()) == params):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
