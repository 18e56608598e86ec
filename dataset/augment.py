"""Training-time augmentation: what ``transform.augment`` names, done on a whole batch at once.

Every choice is a batched ``affine_grid`` + ``grid_sample`` (and, for flips, a mirror), drawn per
row from uniform numbers the caller passes (`dataset.transform.row_draws`: fixed by seed, epoch and
row, so an epoch is the same wherever it is built). `resolve_augment` turns ``auto`` into the
choice for the data: MNIST's IDX sources keep the shift, rotation and zoom the digits always had,
with black edges; an image folder gets shifts, with the edge pixels repeated into the uncovered
border (a picture's background is not black: black borders were a cue its test images never show,
and cost the recipe benchmark's RGB shapes 40 points at 150 steps, docs/performance.md).

torch is imported inside the functions that use it (`augment_tensor`, and `_on_host` for a Ray Data
task's numpy batch): the choices (`augmentation`) are read by stages that never augment a batch
(promotion, cleanup), and their workers stay without torch. `augment_tensor` works on a tensor on any
device, so a split held on a GPU (`dataset.resident`) is augmented there by the same steps.
"""

from __future__ import annotations

import numpy as np

CHOICES = ("none", "shifts", "crops", "flips", "affine")


def resolve_augment(choice: str, source: str) -> str:
    """``transform.augment`` for data from ``source`` (``idx`` or ``folder``): ``auto`` made concrete."""
    if choice != "auto":
        return choice
    return "affine" if source == "idx" else "shifts"


def augmentation(cfg, source: str = "idx") -> dict | None:
    """The `augment` keyword arguments for training with ``cfg`` (a TransformConfig), or None when it does nothing."""
    choice = resolve_augment(cfg.augment, source)
    params = {
        "none": {},
        "shifts": {"shift_px": cfg.shift_px},
        "crops": {"shift_px": cfg.shift_px, "zoom_in": cfg.scale},
        "flips": {"shift_px": cfg.shift_px, "flip": True},
        "affine": {"shift_px": cfg.shift_px, "rotate_deg": cfg.rotate_deg, "scale": cfg.scale},
    }[choice]
    if not any(params.values()):
        return None
    return params | {"fill": "zeros" if source == "idx" else "border"}


def augment(
    images: np.ndarray, draws: np.ndarray, shift_px: int = 0, rotate_deg: float = 0.0, scale: float = 0.0,
    zoom_in: float = 0.0, flip: bool = False, fill: str = "zeros",
) -> np.ndarray:
    """(N, H, W) or (N, C, H, W) uint8 images augmented -> float32 on the 0..1 scale, same shape.

    ``zoom_in``: a crop, zoomed in by a factor in [1, 1 + zoom_in]; ``flip``: mirrored left to right
    when the row's first draw is below one half (the draw that sets the rotation, which flips do not use).
    The work is `augment_tensor`'s, on this process's CPU.
    """
    return _on_host(images, draws, shift_px=shift_px, rotate_deg=rotate_deg, scale=scale, zoom_in=zoom_in, flip=flip, fill=fill)


def random_affine(
    images: np.ndarray, shift_px: int, rotate_deg: float, scale: float, draws: np.ndarray, fill: str = "zeros"
) -> np.ndarray:
    """Shift, rotate and scale each (N, H, W) or (N, C, H, W) uint8 image; returns float32 on the 0..1 scale, same shape.

    ``draws``: (N, 4) uniform numbers in [0, 1) per image (angle, zoom, shift y, shift x), e.g.
    `row_draws` (the same for a row wherever its batch falls) or ``rng.random((n, 4))``.
    One batched ``affine_grid`` + ``grid_sample`` (bilinear) for the whole batch (`augment_tensor`). ``fill``: what the
    uncovered edge shows, ``zeros`` (black: MNIST's background) or ``border`` (the nearest edge pixel,
    for pictures whose background is not black).
    """
    return _on_host(images, draws, shift_px=shift_px, rotate_deg=rotate_deg, scale=scale, fill=fill)


def _on_host(images: np.ndarray, draws: np.ndarray, **params) -> np.ndarray:
    """`augment_tensor` on numpy uint8 images, (N, H, W) or (N, C, H, W), in a Ray Data task: float32 numpy, same shape."""
    import torch  # here, not at the top: see the module's docstring

    torch.set_num_threads(1)  # a data task owns a fraction of a CPU; the cores belong to training
    gray = images.ndim == 3  # (N, H, W): one channel
    pixels = torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8)).float().div_(255.0)
    out = augment_tensor(pixels.unsqueeze(1) if gray else pixels, draws, **params)
    return (out.squeeze(1) if gray else out).numpy()


def augment_tensor(
    pixels, draws: np.ndarray, shift_px: int = 0, rotate_deg: float = 0.0, scale: float = 0.0, zoom_in: float = 0.0,
    flip: bool = False, fill: str = "zeros",
):
    """(N, C, H, W) float pixels on the 0..1 scale, on any device, augmented -> a tensor of the same shape there.

    The work behind `augment` and `random_affine` (same parameters; ``draws``: (N, 4) numpy uniforms per row,
    `row_draws`), so a batch augmented by a Ray Data task on the host and one augmented where the split is held
    (`dataset.resident`, on a GPU) go through the same steps. The per-row transforms are computed with numpy
    (float64) and handed to ``affine_grid`` as float32. With nothing to shift, rotate or scale, ``pixels`` is
    returned as given (mirrored in place when ``flip``).
    """
    import torch  # here, not at the top: see the module's docstring
    import torch.nn.functional as F

    if zoom_in:
        draws = draws.copy()
        draws[:, 1] = 0.5 + 0.5 * draws[:, 1]  # zoom in [1, 1 + zoom_in] only: 1 + s * (2d - 1) with d in [0.5, 1)
        scale = zoom_in
    out = pixels
    if len(pixels) and (shift_px != 0 or rotate_deg != 0 or scale != 0):
        height, width = pixels.shape[-2:]
        angle = np.deg2rad(rotate_deg * (2 * draws[:, 0] - 1))
        zoom = 1 + scale * (2 * draws[:, 1] - 1)
        # Whole-pixel shifts in [-shift_px, shift_px]; affine_grid maps output to input coordinates in
        # [-1, 1], so one pixel is 2/width across and 2/height down (2/28 for MNIST).
        steps = np.floor(draws[:, 2:4] * (2 * shift_px + 1)) - shift_px
        shift = np.stack([steps[:, 0] * (2.0 / width), steps[:, 1] * (2.0 / height)], 1)
        cos, sin = np.cos(angle) / zoom, np.sin(angle) / zoom
        theta = np.stack([np.stack([cos, -sin, shift[:, 0]], 1), np.stack([sin, cos, shift[:, 1]], 1)], 1)
        theta = torch.from_numpy(theta).float().to(pixels.device)
        grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
        out = F.grid_sample(pixels, grid, mode="bilinear", padding_mode=fill, align_corners=False)
    if flip:
        mirrored = torch.from_numpy(draws[:, 0] < 0.5).to(out.device)
        out[mirrored] = out[mirrored].flip(-1)
    return out
