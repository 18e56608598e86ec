"""A second workload the tests make: a labelled image folder of small RGB pictures (not MNIST).

Three classes of 20x20 RGB PNGs drawn with numpy and written with PIL: a red square, a green
disc and a blue cross, each at a random place on a noisy dark background, with their colours
jittered. Distinct in colour and shape, so the small model learns them in a few seconds.
The layout is an image folder's (torchvision ImageFolder, Hugging Face imagefolder):
``<root>/train/<class>/*.png``, ``<root>/test/<class>/*.png`` and, when asked, ``val/``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CLASSES = ("blue_cross", "green_disc", "red_square")  # sorted: label i is CLASSES[i]
SIZE = 20


def draw(kind: str, rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """One (size, size, 3) uint8 picture of ``kind``."""
    image = rng.integers(0, 40, (size, size, 3)).astype(np.int32)
    half = max(2, size // 5)
    cy, cx = rng.integers(half + 1, size - half - 1, 2)
    yy, xx = np.mgrid[:size, :size]
    if kind == "red_square":
        mask, colour = (abs(yy - cy) <= half) & (abs(xx - cx) <= half), (220, 40, 40)
    elif kind == "green_disc":
        mask, colour = (yy - cy) ** 2 + (xx - cx) ** 2 <= (half + 1) ** 2, (40, 210, 60)
    else:
        mask, colour = ((abs(yy - cy) <= 1) & (abs(xx - cx) <= half + 1)) | ((abs(xx - cx) <= 1) & (abs(yy - cy) <= half + 1)), (50, 70, 230)
    jitter = rng.integers(-25, 26, 3)
    image[mask] = np.clip(np.array(colour) + jitter, 0, 255)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_image_folder(
    root: Path,
    per_class: dict[str, int] | None = None,
    seed: int = 0,
    size: int = SIZE,
    gray: bool = False,
    classes: tuple[str, ...] = CLASSES,
) -> Path:
    """Write the workload under ``root``: ``per_class`` maps a split (train, test, val) to images per class."""
    from PIL import Image

    per_class = per_class or {"train": 40, "test": 15}
    rng = np.random.default_rng(seed)
    for split, count in per_class.items():
        for kind in classes:
            folder = root / split / kind
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                picture = Image.fromarray(draw(kind, rng, size))
                (picture.convert("L") if gray else picture).save(folder / f"{kind}-{i:03d}.png")
    return root
