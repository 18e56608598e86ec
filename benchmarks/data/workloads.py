"""Small image-classification workloads the recipe benchmark (and the tests) make themselves.

Each is a labelled set of uint8 images, made from a seed with PIL and numpy alone (no download),
of a different kind, so a recipe tuned on one cannot pass for a recipe that fits any:

* ``shapes``: 3 classes (disc, square, triangle), 32x32 RGB, random colours, size and position,
  so only the outline tells the class;
* ``glyphs``: 10 classes (the letters A to J), 28x28 grayscale, random size, position and stroke;
* ``textures``: 4 classes of stripes at 0, 45, 90 and 135 degrees, 32x32 grayscale, random period,
  phase and noise (a horizontal flip would swap two classes);
* ``dots``: 4 classes (one to four dots), 32x32 RGB, random colours and places: counting.

`make` returns the arrays; `write_folder` lays a workload out as the image folder that
``download.source: folder`` reads (``train/<class>/*.png``, ``test/<class>/*.png``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("shapes", "glyphs", "textures", "dots")


@dataclass(frozen=True)
class Workload:
    """One generated workload: images (N, H, W, C) uint8 and labels (N,) per split, and its class names."""

    name: str
    classes: tuple[str, ...]
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    @property
    def channels(self) -> int:
        return int(self.train_x.shape[-1])


def _colour(rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(v) for v in rng.integers(0, 256, 3))


def _distinct(rng: np.random.Generator, other: tuple[int, ...]) -> tuple[int, ...]:
    """A random colour far enough from ``other`` that the figure stays visible."""
    while True:
        colour = _colour(rng)
        if sum(abs(a - b) for a, b in zip(colour, other)) > 200:
            return colour


def _shape(rng: np.random.Generator, label: int) -> np.ndarray:
    from PIL import Image, ImageDraw

    background = _colour(rng)
    image = Image.new("RGB", (32, 32), background)
    draw = ImageDraw.Draw(image)
    size = int(rng.integers(10, 20))
    x, y = (int(v) for v in rng.integers(1, 32 - size - 1, 2))
    fill = _distinct(rng, background)
    if label == 0:
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    elif label == 1:
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return np.asarray(image)


def _glyph(rng: np.random.Generator, label: int) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("L", (28, 28), 0)
    font = ImageFont.load_default(size=int(rng.integers(14, 22)))
    letter = "ABCDEFGHIJ"[label]
    left, top, right, bottom = font.getbbox(letter)
    x = int(rng.integers(0, max(1, 28 - (right - left)))) - left
    y = int(rng.integers(0, max(1, 28 - (bottom - top)))) - top
    ImageDraw.Draw(image).text((x, y), letter, fill=int(rng.integers(160, 256)), font=font,
                               stroke_width=int(rng.integers(0, 2)), stroke_fill=255)
    return np.asarray(image)[..., None]


def _texture(rng: np.random.Generator, label: int) -> np.ndarray:
    angle = np.deg2rad(45 * label + rng.uniform(-8, 8))
    period, phase = rng.uniform(4, 9), rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:32, 0:32]
    wave = np.sin(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period + phase)
    image = 128 + 70 * wave + rng.normal(0, 30, (32, 32))
    return np.clip(image, 0, 255).astype(np.uint8)[..., None]


def _dots(rng: np.random.Generator, label: int) -> np.ndarray:
    from PIL import Image, ImageDraw

    background = _colour(rng)
    image = Image.new("RGB", (32, 32), background)
    draw = ImageDraw.Draw(image)
    placed: list[tuple[int, int]] = []
    while len(placed) < label + 1:  # dots that do not touch, so the count is what the image shows
        x, y = (int(v) for v in rng.integers(2, 26, 2))
        if all(abs(x - a) > 7 or abs(y - b) > 7 for a, b in placed):
            placed.append((x, y))
            draw.ellipse((x, y, x + 5, y + 5), fill=_distinct(rng, background))
    return np.asarray(image)


_MAKERS = {"shapes": (_shape, ("disc", "square", "triangle")),
           "glyphs": (_glyph, tuple("abcdefghij")),
           "textures": (_texture, ("deg0", "deg45", "deg90", "deg135")),
           "dots": (_dots, ("one", "two", "three", "four"))}


def make(kind: str, train_per_class: int, test_per_class: int, seed: int = 0) -> Workload:
    """``kind``'s images: ``train_per_class`` and ``test_per_class`` of each class, reproducible from ``seed``."""
    if kind not in _MAKERS:
        raise ValueError(f"unknown workload {kind!r}; one of {', '.join(KINDS)}")
    maker, classes = _MAKERS[kind]
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    splits = []
    for per_class in (train_per_class, test_per_class):
        labels = np.repeat(np.arange(len(classes)), per_class)
        images = np.stack([maker(rng, int(label)) for label in labels])
        splits += [images, labels.astype(np.int64)]
    return Workload(kind, classes, *splits)


def write_folder(workload: Workload, root: Path) -> Path:
    """``workload`` as an image folder (``train/<class>/<i>.png``, ``test/<class>/<i>.png``) under ``root``."""
    from PIL import Image

    for split, images, labels in (("train", workload.train_x, workload.train_y), ("test", workload.test_x, workload.test_y)):
        for i, (image, label) in enumerate(zip(images, labels)):
            folder = root / split / workload.classes[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(folder / f"{i:05d}.png")
    return root
