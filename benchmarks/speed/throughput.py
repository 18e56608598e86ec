"""Training throughput, the two sides the training rows of ``benchmarks.run`` compare.

* `benchmarks.speed.device_rows.plain_images_per_s`: a plain single-process PyTorch loop on one in-memory batch of random
  tensors (ResNet-18 of ``training.checkpoint.model_files``, fused AdamW lr 1e-3 as ours, ``CrossEntropyLoss(label_smoothing=0.1)``),
  ``threads`` torch threads; two warm-up steps are not timed, then images/s over ``steps`` steps.
* `ray_train_images_per_s`: our training stage (``tasks.train``, Ray Train with ``workers`` workers
  or ``train.mode=single``) on a data source (the bundled sample unless told otherwise, e.g. the
  full-size mirror of ``benchmarks.data.full_size``), with the default recipe but no weight EMA; the
  stages before it (download, conversion, transform) run first and are not timed. It reports
  the images/s the loop measured per epoch: the median of the epochs after the first (the first
  pays the data pipeline's cold start), or the only epoch's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

SAMPLE = {"source": "sample"}


def ray_train_images_per_s(work: Path, epochs: int, mode: str = "distributed", workers: int = 1,
                           download: dict | None = None, batch: int = 128, train_fields: dict | None = None) -> dict:
    """Our training stage (Ray Train with ``workers`` workers, or ``train.mode=single``; global batch ``batch``,
    the plain loop's) on ``download``.

    ``download`` is the run's ``download`` config section (default: the bundled sample); ``train_fields``, more
    ``train`` fields (``use_gpu``, ``precision``: the GPU rows of `benchmarks.speed.device_rows`). Returns
    the median images/s of its epochs after the first (the first pays the data pipeline's cold
    start), or the only epoch's.
    """
    from benchmarks import model_name
    from benchmarks.speed.stages import stage_inputs
    from pipeline_config import PipelineConfig
    from tasks.train import train

    config = PipelineConfig.model_validate(
        {"download": download or SAMPLE, "model": {"name": model_name()}, "train": {"epochs": epochs, "ema_decay": 0.0, "num_workers": workers, "mode": mode, "global_batch_size": batch, **(train_fields or {})}}
    )
    spec, layout = stage_inputs(config, work, f"bench-{mode}-{workers}")
    start = time.perf_counter()
    trained = train.fn(spec, config.train, layout, model=config.model)
    history = sorted(trained.history, key=lambda row: row["epoch"])
    rates = [row["images_per_s"] for row in history[1:] or history]
    return {"images_per_s": statistics.median(rates), "epochs_images_per_s": rates, "epochs": len(history),
            "train_rows": spec.dataset.rows["train"], "stage_seconds": time.perf_counter() - start}
