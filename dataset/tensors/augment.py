"""Training-time augmentation: what ``transform.augment`` names, done on a whole batch at once.

Every choice is a batched ``affine_grid`` + ``grid_sample`` (and, for flips, a mirror), drawn per
row from uniform numbers the caller passes (`dataset.tensors.batches.row_draws`: fixed by seed, epoch and
row, so an epoch is the same wherever it is built). `resolve_augment` turns ``auto`` into the
choice for the data, whose edge fill is the data's too (its source's `dataset.sources.interface.Defaults`): MNIST's
IDX sources keep the shift, rotation and zoom the digits always had, with black edges; an image folder gets shifts, with the edge pixels repeated into the uncovered
border (a picture's background is not black: black borders were a cue its test images never show,
and cost the recipe benchmark's RGB shapes 40 points at 150 steps, docs/performance.md).

Two implementations of the same steps: `augment` and `random_affine` (a Ray Data task's numpy batch, `_on_host`)
in numpy, so a Ray Data worker never imports torch (about 300 MB per worker, issue 67); `augment_tensor` in torch,
on a tensor on any device, for a split held by the training worker (`dataset.tensors.resident`, on a GPU too). They agree
to float32 rounding (under 1e-5 on the 0..1 scale, `tests/test_transform.py`). The numpy blend takes about 5
times torch's single-thread time (45 ms against 8 ms for 1,024 digits with ``affine``, Intel Xeon): a few
seconds of a 60,000-image epoch on the streamed path, where a Ray Data task shares the CPUs with training.
torch is imported inside `augment_tensor` only: the choices (`augmentation`) are read by stages that never
augment a batch (promotion, cleanup).
"""

from __future__ import annotations

import numpy as np

from dataset.sources.interface import defaults_for

CHOICES = ("none", "shifts", "crops", "flips", "affine")


def resolve_augment(choice: str, source: str) -> str:
    """``transform.augment`` for data from a source of kind ``source`` (``idx``, ``folder``, ...): ``auto`` made concrete."""
    return defaults_for(source).augment if choice == "auto" else choice


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
    return params | {"fill": defaults_for(source).fill}


def augment(
    images: np.ndarray, draws: np.ndarray, shift_px: int = 0, rotate_deg: float = 0.0, scale: float = 0.0,
    zoom_in: float = 0.0, flip: bool = False, fill: str = "zeros",
) -> np.ndarray:
    """(N, H, W) or (N, C, H, W) uint8 images augmented -> float32 on the 0..1 scale, same shape.

    ``zoom_in``: a crop, zoomed in by a factor in [1, 1 + zoom_in]; ``flip``: mirrored left to right
    when the row's first draw is below one half (the draw that sets the rotation, which flips do not use).
    The work is `augment_tensor`'s, in numpy on this process's CPU.
    """
    return _on_host(images, draws, shift_px=shift_px, rotate_deg=rotate_deg, scale=scale, zoom_in=zoom_in, flip=flip, fill=fill)


def random_affine(
    images: np.ndarray, shift_px: int, rotate_deg: float, scale: float, draws: np.ndarray, fill: str = "zeros"
) -> np.ndarray:
    """Shift, rotate and scale each (N, H, W) or (N, C, H, W) uint8 image; returns float32 on the 0..1 scale, same shape.

    ``draws``: (N, 4) uniform numbers in [0, 1) per image (angle, zoom, shift y, shift x), e.g.
    `row_draws` (the same for a row wherever its batch falls) or ``rng.random((n, 4))``.
    One batched bilinear resampling for the whole batch, as `augment_tensor`'s ``affine_grid`` + ``grid_sample``.
    ``fill``: what the uncovered edge shows, ``zeros`` (black: MNIST's background) or ``border`` (the nearest edge pixel,
    for pictures whose background is not black).
    """
    return _on_host(images, draws, shift_px=shift_px, rotate_deg=rotate_deg, scale=scale, fill=fill)


def _on_host(images: np.ndarray, draws: np.ndarray, **params) -> np.ndarray:
    """`augment_tensor`'s steps in numpy on uint8 images, (N, H, W) or (N, C, H, W), in a Ray Data task: float32 numpy,
    same shape. No torch: a Ray Data worker stays a light process (issue 67); the values agree with `augment_tensor`'s
    to float32 rounding (`tests/test_transform.py`)."""
    gray = images.ndim == 3  # (N, H, W): one channel
    pixels = np.ascontiguousarray(images, dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    pixels = pixels[:, None] if gray else pixels
    theta, draws = _theta(draws, pixels.shape, **{k: v for k, v in params.items() if k not in ("flip", "fill")})
    out = pixels if theta is None else _sample(pixels, theta, params.get("fill", "zeros"))
    if params.get("flip"):
        mirrored = draws[:, 0] < 0.5
        out[mirrored] = out[mirrored][..., ::-1]
    return out[:, 0] if gray else out


def _theta(
    draws: np.ndarray, shape: tuple, shift_px: int = 0, rotate_deg: float = 0.0, scale: float = 0.0,
    zoom_in: float = 0.0,
) -> tuple[np.ndarray | None, np.ndarray]:
    """(each row's 2x3 affine transform, float32, or None when nothing moves; the draws, zoom's adjusted) for images of
    ``shape`` (N, C, H, W): the per-row transforms computed with numpy (float64), as ``affine_grid`` takes them."""
    if zoom_in:
        draws = draws.copy()
        draws[:, 1] = 0.5 + 0.5 * draws[:, 1]  # zoom in [1, 1 + zoom_in] only: 1 + s * (2d - 1) with d in [0.5, 1)
        scale = zoom_in
    if not shape[0] or (shift_px == 0 and rotate_deg == 0 and scale == 0):
        return None, draws
    height, width = shape[-2:]
    angle = np.deg2rad(rotate_deg * (2 * draws[:, 0] - 1))
    zoom = 1 + scale * (2 * draws[:, 1] - 1)
    # Whole-pixel shifts in [-shift_px, shift_px]; affine_grid maps output to input coordinates in
    # [-1, 1], so one pixel is 2/width across and 2/height down (2/28 for MNIST).
    steps = np.floor(draws[:, 2:4] * (2 * shift_px + 1)) - shift_px
    shift = np.stack([steps[:, 0] * (2.0 / width), steps[:, 1] * (2.0 / height)], 1)
    cos, sin = np.cos(angle) / zoom, np.sin(angle) / zoom
    theta = np.stack([np.stack([cos, -sin, shift[:, 0]], 1), np.stack([sin, cos, shift[:, 1]], 1)], 1)
    return theta.astype(np.float32), draws


def _sample(pixels: np.ndarray, theta: np.ndarray, fill: str) -> np.ndarray:
    """``affine_grid`` + ``grid_sample`` (bilinear, ``align_corners=False``, ``padding_mode`` ``fill``) in float32
    numpy: each output pixel reads its input position through the row's ``theta`` and blends the four pixels around it."""
    n, channels, height, width = pixels.shape
    xs = np.linspace(-1, 1, width, dtype=np.float32) * np.float32((width - 1) / width)
    ys = np.linspace(-1, 1, height, dtype=np.float32) * np.float32((height - 1) / height)
    t = theta[:, :, :, None, None]  # (N, 2, 3, 1, 1) against the (H, W) grid
    gx = t[:, 0, 0] * xs[None, None, :] + t[:, 0, 1] * ys[None, :, None] + t[:, 0, 2]
    gy = t[:, 1, 0] * xs[None, None, :] + t[:, 1, 1] * ys[None, :, None] + t[:, 1, 2]
    ix = ((gx + 1) * width - 1) / 2  # pixel coordinates in the input, (N, H, W)
    iy = ((gy + 1) * height - 1) / 2
    if fill == "border":
        ix, iy = np.clip(ix, 0, width - 1), np.clip(iy, 0, height - 1)
    x0, y0 = np.floor(ix), np.floor(iy)
    wx1, wy1 = ix - x0, iy - y0
    wx0, wy0 = (x0 + 1) - ix, (y0 + 1) - iy
    x0, y0 = x0.astype(np.int64), y0.astype(np.int64)
    flat = pixels.reshape(n, channels, height * width)
    out = np.zeros_like(flat)
    for dx, dy, weight in ((0, 0, wx0 * wy0), (1, 0, wx1 * wy0), (0, 1, wx0 * wy1), (1, 1, wx1 * wy1)):
        x, y = x0 + dx, y0 + dy
        inside = (x >= 0) & (x < width) & (y >= 0) & (y < height)
        at = (np.clip(y, 0, height - 1) * width + np.clip(x, 0, width - 1)).reshape(n, 1, -1)
        values = np.take_along_axis(flat, np.broadcast_to(at, flat.shape), axis=2)  # the corner's pixel, every channel
        out += values * np.where(inside, weight, 0).reshape(n, 1, -1)
    return out.reshape(pixels.shape)


def augment_tensor(
    pixels, draws: np.ndarray, shift_px: int = 0, rotate_deg: float = 0.0, scale: float = 0.0, zoom_in: float = 0.0,
    flip: bool = False, fill: str = "zeros",
):
    """(N, C, H, W) float pixels on the 0..1 scale, on any device, augmented -> a tensor of the same shape there.

    The work behind `augment` and `random_affine` (same parameters; ``draws``: (N, 4) numpy uniforms per row,
    `row_draws`), so a batch augmented by a Ray Data task on the host and one augmented where the split is held
    (`dataset.tensors.resident`, on a GPU) go through the same steps. The per-row transforms are computed with numpy
    (float64) and handed to ``affine_grid`` as float32. With nothing to shift, rotate or scale, ``pixels`` is
    returned as given (mirrored in place when ``flip``).
    """
    import torch  # here, not at the top: see the module's docstring
    import torch.nn.functional as F  # torch: only where a model is built or run

    moves = {"shift_px": shift_px, "rotate_deg": rotate_deg, "scale": scale, "zoom_in": zoom_in}
    theta, draws = _theta(draws, tuple(pixels.shape), **moves)
    out = pixels
    if theta is not None:
        theta = torch.from_numpy(theta).to(pixels.device)
        grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
        out = F.grid_sample(pixels, grid, mode="bilinear", padding_mode=fill, align_corners=False)
    if flip:
        mirrored = torch.from_numpy(draws[:, 0] < 0.5).to(out.device)
        out[mirrored] = out[mirrored].flip(-1)
    return out
