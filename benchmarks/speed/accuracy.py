"""Time to accuracy: wall seconds until the held-out accuracy first reaches a target.

Held-out accuracy is the training stage's own per-epoch validation: every
``parquet.validation_every``-th row of the training file (by row_id, which follows file order)
is never trained on; the test file stays with the evaluation stage, which sees only the final
checkpoint. On the bundled sample that is 200 of its 4,000 training images.

The data is either the bundled sample (the default) or a full-size mirror made by
``benchmarks.data.full_size.make_mirror`` (60,000 / 10,000 rows in full mode), which both sides then
read: the plain loop its IDX files, ours through the flow's stages from its ``file://`` URL. The
mirror's training digits are shifted copies (by up to two pixels) of the bundled sample's
training file: its 3,800 training digits and its 200 held-out ones, each copied about 15 times
at 60,000 rows. So the mirror's held-out rows are copies of digits the model also trains on, and
accuracy on them measures how long training takes to get there, not generalization.

Ours is the training stage as the flow runs it (Ray Train, the default preset's recipe and
worker count, the Ray Data pipeline, per-epoch validation and checkpoints), timed from the
stage's start to the end of the first epoch whose validation accuracy reaches the target; the
worker-group start is part of it. The baseline is a plain single-process PyTorch loop on
in-memory tensors with the same recipe: the same model, AdamW, one-cycle schedule, label
smoothing, weight EMA, batch, augmentation (shift, rotation, zoom, drawn anew every epoch), epochs
(``train.epochs`` capped by ``train.max_images``, as the stage does), threads, training rows and
validation rows, validated after every epoch; it stops at the target.
``benchmarks.run`` calls `measure`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from dataset.formats.idx import read_idx

VAL_CHUNK = 500  # validation images per forward pass of the plain loop


def _training_arrays(folder: Path | None) -> dict[str, np.ndarray]:
    """The training file's images and labels from ``folder`` (IDX .gz files), or from the bundled sample."""
    from pipeline_config.common import SAMPLE_DIR

    folder = Path(SAMPLE_DIR) if folder is None else folder
    return {"train_x": read_idx(folder / "train-images-idx3-ubyte.gz"), "train_y": read_idx(folder / "train-labels-idx1-ubyte.gz")}


def plain_time_to_accuracy(config, target: float, threads: int, folder: Path | None = None, device: str = "cpu") -> dict:
    """The plain loop with ``config``'s recipe on ``folder``'s IDX files (default: the bundled sample).

    Seconds until the held-out accuracy reaches ``target``. On ``device``: a GPU trains as our stage does
    there (``train.precision`` resolved for it, autocast, channels-last weights and batches); each epoch's
    augmented images are made on the host and copied over once, as one tensor.
    """
    import torch

    from benchmarks import build_model
    from dataset.tensors.augment import random_affine
    from dataset.tensors.batches import normalize
    from training.model.catalog import configure_cpu
    from training.worker.device import (
        autocast,
        backward_and_step,
        grad_scaler,
        images_for,
        prepare_for,
        resolve_precision,
    )
    from training.worker.recipe import inference_model, make_ema, make_optimizer, one_cycle_lr

    train_cfg, tf = config.train, config.transform
    data = _training_arrays(folder)
    # The stage's own split: every validation_every-th training row (by row_id, which follows
    # file order) is held out for per-epoch validation; the rest is trained on.
    held_out = np.arange(len(data["train_y"])) % config.parquet.validation_every == config.parquet.validation_every - 1
    train_images = data["train_x"][~held_out]
    # As the transform stage resolves them for an IDX source (dataset.tensors.normalization.resolve): the config's,
    # else the seeds' 0.5 / 0.5. Unset (None) values gave NaN inputs: a baseline stuck at chance.
    mean, std = tf.per_channel(1)
    target_device = torch.device(device)
    precision = resolve_precision(train_cfg.precision, target_device)
    val_x = images_for(torch.from_numpy(normalize(data["train_x"][held_out], mean, std)).to(target_device), target_device)
    val_y = torch.from_numpy(data["train_y"][held_out].astype(np.int64)).to(target_device)
    train_y = torch.from_numpy(data["train_y"][~held_out].astype(np.int64)).to(target_device)
    configure_cpu(threads)  # denormals flushed, as in our workers
    torch.manual_seed(train_cfg.seed)
    rng = np.random.default_rng(train_cfg.seed)
    model = prepare_for(build_model().to(target_device), target_device)
    optimizer = make_optimizer(model, train_cfg.learning_rate, train_cfg.weight_decay)
    scaler = grad_scaler(precision, target_device)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=train_cfg.label_smoothing)
    ema = make_ema(model, train_cfg.ema_decay)
    n = len(train_y)
    epochs, batch = train_cfg.epochs_for(n), train_cfg.global_batch_size  # as the stage caps them
    steps_per_epoch = math.ceil(n / batch)
    history: list[float] = []
    start = time.perf_counter()
    for epoch in range(epochs):
        # This epoch's augmented copy of the training set, in one batched call (random_affine pins
        # torch to one thread for Ray Data tasks; the loop takes its threads back afterwards).
        augmented = random_affine(train_images, tf.shift_px, tf.rotate_deg, tf.scale, rng.random((len(train_images), 4)))
        torch.set_num_threads(threads)
        train_x = torch.from_numpy(normalize(augmented, mean, std)).to(target_device)
        order = torch.from_numpy(rng.permutation(n)).to(target_device)
        model.train()
        for step in range(steps_per_epoch):
            idx = order[step * batch : (step + 1) * batch]
            for group in optimizer.param_groups:
                group["lr"] = one_cycle_lr((epoch + step / steps_per_epoch) / epochs, train_cfg.learning_rate)
            with autocast(precision, target_device):
                loss = criterion(model(images_for(train_x[idx], target_device)), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            backward_and_step(loss, optimizer, scaler)
            if ema is not None:
                ema.update_parameters(model)
        evaluated = inference_model(model, ema)
        evaluated.eval()
        with torch.no_grad(), autocast(precision, target_device):
            correct = sum(int((evaluated(val_x[i : i + VAL_CHUNK]).argmax(1) == val_y[i : i + VAL_CHUNK]).sum())
                          for i in range(0, len(val_y), VAL_CHUNK))
        history.append(correct / len(val_y))
        if history[-1] >= target:
            return {"seconds": time.perf_counter() - start, "epoch": epoch, "accuracy": history[-1], "history": history,
                    "precision": precision}
    return {"seconds": None, "epoch": None, "accuracy": max(history), "history": history, "precision": precision}


def ours_time_to_accuracy(config, work: Path, target: float) -> dict:
    """Our training stage with ``config``; seconds from its start to the first epoch at ``target``."""
    from benchmarks.speed.stages import stage_inputs
    from tasks.train import train

    spec, layout = stage_inputs(config, work, "bench-accuracy")
    start = time.time()
    trained = train.fn(spec, config.train, layout, model=config.model)
    stage_s = time.time() - start
    history = sorted(trained.history, key=lambda row: row["epoch"])
    accuracies = [row["val_accuracy"] for row in history]
    rows = {"train_rows": spec.dataset.rows["train"], "val_rows": spec.dataset.rows["val"]}
    for row in history:
        if row["val_accuracy"] >= target:
            return {"seconds": row["finished_at"] - start, "epoch": int(row["epoch"]), "accuracy": row["val_accuracy"],
                    "history": accuracies, "stage_s": stage_s, **rows}
    return {"seconds": None, "epoch": None, "accuracy": max(accuracies), "history": accuracies, "stage_s": stage_s, **rows}


def measure(work: Path, epochs: int, target: float, threads: int = 2, mirror: Path | None = None,
            checksums: dict[str, str] | None = None, device: str | None = None) -> dict:
    """One row: ours against the plain loop, both with the default recipe over ``epochs`` epochs.

    The data is the bundled sample, or the full-size mirror in ``mirror`` (with its ``checksums``,
    as `benchmarks.data.full_size.make_mirror` returns them). ``device`` (the GPU rows of
    `benchmarks.speed.device_rows`): both sides on it, ours with ``train.use_gpu: always`` on a GPU
    (``never`` on the CPU) and ``train.precision: auto``; unset, the CPU rows as before.
    """
    from benchmarks import model_name
    from benchmarks.data.full_size import mirror_download
    from benchmarks.speed.device_rows import device_name
    from pipeline_config import PipelineConfig

    download = {"source": "sample"} if mirror is None else mirror_download(mirror, checksums)
    train: dict = {"epochs": epochs}
    if device is not None:
        train |= {"use_gpu": "always" if device.startswith("cuda") else "never", "precision": "auto"}
    config = PipelineConfig.model_validate({"download": download, "model": {"name": model_name()}, "train": train})
    plain = plain_time_to_accuracy(config, target, threads, mirror, device=device or "cpu")
    ours = ours_time_to_accuracy(config, work, target)
    ratio = round(ours["seconds"] / plain["seconds"], 2) if ours["seconds"] and plain["seconds"] else None
    name = "time to accuracy" if mirror is None else "time to accuracy at full size"
    on_device = {} if device is None else {"device": device_name(device), "precision": plain["precision"]}
    return {
        "benchmark": name if device is None else f"{name} on the device",
        **on_device,
        "data": "bundled sample" if mirror is None else "full-size mirror (shifted copies of the bundled digits)",
        "train_rows": ours["train_rows"], "val_rows": ours["val_rows"], "target": target,
        "epochs": config.train.epochs_for(ours["train_rows"]),
        "workers": config.train.num_workers,
        "baseline": "plain PyTorch loop, same recipe, in-memory tensors",
        "baseline_s": _round(plain["seconds"]), "baseline_epoch": plain["epoch"], "baseline_history": _rounded(plain["history"]),
        "ours_s": _round(ours["seconds"]), "ours_epoch": ours["epoch"], "ours_history": _rounded(ours["history"]),
        "ours_stage_s": _round(ours["stage_s"]), "ratio": ratio, "goal": "<= 1.2x",
    }


def measure_time_to_accuracy(work: Path, mirror: Path, checksums: dict[str, str], epochs: int, target: float,
                             device: str | None = None) -> dict:
    """The GPU time-to-accuracy row: `benchmarks.speed.accuracy.measure` on the full-size mirror with both sides on
    the device (ours ``train.use_gpu: always``, ``train.precision: auto``; the plain loop at the precision
    that resolves to). ``device`` as in `measure`: unset, the GPU or a row saying there is none."""
    import torch

    from benchmarks.speed.device_rows import device_name

    if device is None:
        if not torch.cuda.is_available():
            return {"benchmark": "time to accuracy at full size on the device", "device": device_name(),
                    "skipped": "no GPU on this machine (torch.cuda.is_available() is False)"}
        device = "cuda"
    return measure(work, epochs=epochs, target=target, mirror=mirror, checksums=checksums, device=device)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]
