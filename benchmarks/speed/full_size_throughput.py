"""Training throughput at full size: our training stage on the full-size mirror against the plain loop.

Ours is the training stage (``tasks.train``) with 1 Ray Train worker x 2 torch threads (this
process's local Ray has 2 CPUs), the default recipe without weight EMA and the global batch of
128, reading the full-size mirror of ``benchmarks.data.full_size`` (60,000 / 10,000 rows in full
mode; shifted copies of the bundled digits) through the flow's stages: download from the
``file://`` mirror, Parquet, the Ray Data pipeline with its augmentation, per-epoch validation
and checkpoints. Its figure is the images/s its loop measured per epoch, the median of the epochs
after the first (the first pays the data pipeline's cold start), or the only epoch's. The stages
before training are not timed.

The baseline is the plain single-process loop of ``benchmarks.speed.throughput`` (in-memory random
tensors, same model, optimizer, batch and threads), run before and after ours; the row quotes
the median of those runs, so the two sides alternate. ``benchmarks.run`` calls `measure`.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def measure(work: Path, download: dict, epochs: int, steps: int, batch: int = 128, threads: int = 2) -> dict:
    """One row: plain loop, ours (``epochs`` epochs on ``download``), plain loop again."""
    from benchmarks.speed.device_rows import plain_images_per_s
    from benchmarks.speed.throughput import ray_train_images_per_s

    plains = [plain_images_per_s(steps=steps, batch=batch, threads=threads)]
    ours = ray_train_images_per_s(work, epochs, workers=1, download=download, batch=batch)
    plains.append(plain_images_per_s(steps=steps, batch=batch, threads=threads))
    plain = statistics.median(plains)
    return {
        "benchmark": "training throughput at full size (1 worker x 2 threads, batch 128)",
        "train_rows": ours["train_rows"], "epochs": ours["epochs"], "workers": 1, "threads": threads,
        "baseline": "plain PyTorch loop, in-memory tensors", "baseline_images_per_s": round(plain, 1),
        "ours_images_per_s": round(ours["images_per_s"], 1), "ratio": round(ours["images_per_s"] / plain, 3),
        "baseline_runs": [round(p, 1) for p in plains], "ours_epochs": [round(r, 1) for r in ours["epochs_images_per_s"]],
        "ours_stage_s": round(ours["stage_seconds"], 1), "goal": ">= 0.95x",
    }
