"""Scoring images with a checkpoint: a pool of model actors over a Ray Data split, and the metrics.

The seeds' ``ModelWorker`` idea, batched: Ray Data streams normalized batches through
``num_actors`` actors that each load the checkpoint once (`Predictor`), optionally averaging
over one-pixel shifts (test-time augmentation). The evaluation stage (`tasks.evaluate`) scores
the test split with it, ``flows.predict`` a folder of images. On a cluster with GPUs every actor
holds a share of one (`actor_gpus`) and scores on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import ray.data

from dataset.tensors.batches import prepare_batch
from dataset.tensors.read_ahead import read_ahead, split_batches
from dataset.tensors.spec import TransformSpec
from dataset.tensors.transform import blocks, build_datasets
from pipeline_config import EvaluateConfig, TransformConfig
from training.checkpoint.model_files import load_model
from training.model.catalog import ModelSpec, configure_cpu

if TYPE_CHECKING:  # annotations only: torch is imported where a model scores (the evaluation stage's module is
    import torch  # imported by every Ray worker that runs a stage, and the stages that do not score skip torch)


# Test-time augmentation: the image itself and its four one-pixel shifts (dy, dx).
TTA_SHIFTS = ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))
# Input values (images x channels x height x width) one forward pass on CPU takes at most: 8.4 M, so 250
# MNIST digits or 64x64 RGB images go in one pass, 128x128 RGB ones in passes of 170.
FORWARD_VALUES = 1 << 23


def shifted(images: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """(N, C, H, W) images moved by (dy, dx) pixels; the uncovered edge repeats the nearest edge pixels
    (black for MNIST's digits, whose edges are black; a picture's own background for an image folder)."""
    import torch.nn.functional as F  # torch: only where a model is built or run

    if dy == 0 and dx == 0:
        return images
    h, w = images.shape[-2:]
    padded = F.pad(images, (1, 1, 1, 1), mode="replicate")
    return padded[..., 1 - dy : 1 - dy + h, 1 - dx : 1 - dx + w]


class Predictor:
    """Ray Data actor: loads the checkpoint once, then predicts batch after batch.

    ``pred`` is the class with the highest softmax averaged over the image and its four one-pixel
    shifts when ``tta`` is on (`shifted`), else the plain argmax;
    ``pred_plain`` is always the plain argmax, so both accuracies are reported.
    """

    def __init__(
        self, checkpoint_dir: str, torch_threads: int = 1, tta: bool = False, model: dict | None = None, use_gpu: bool = False,
    ):
        import torch  # torch: only where a model is built or run

        from training.worker.device import (  # with torch, as this class is: see the module's note on torch
            pick_device,
            visible_gpus,
        )

        configure_cpu(torch_threads)
        # A folder or an s3:// URI; ``model`` (a ModelSpec's fields) says what to build, else the checkpoint's record.
        self.model = load_model(checkpoint_dir, ModelSpec.model_validate(model) if model else None)
        self.device = pick_device("auto" if use_gpu else "never", visible_gpus())  # the GPU Ray gave this actor
        self.model.to(self.device)
        # On CPU, channels-last tensors: oneDNN's convolutions run faster on them (measured on 2 cores, the small
        # CNN on 64x64 RGB with TTA: 368 img/s against 203; ResNet-18 on MNIST: 546 against 504).
        self.layout = torch.channels_last if self.device.type == "cpu" else torch.contiguous_format
        self.model.to(memory_format=self.layout)
        self.tta = tta

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch  # torch: only where a model is built or run

        with torch.inference_mode():
            return self._predict(batch)

    def _predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch  # torch: only where a model is built or run

        plain, averaged = self._softmax(torch.from_numpy(batch["image"]))
        return {"row_id": batch["row_id"], "label": batch["label"], "pred": averaged.argmax(1).cpu().numpy(),
                "pred_plain": plain.argmax(1).cpu().numpy()}

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """Each image's class probabilities, (N, classes): the softmax, averaged over the TTA views when ``tta`` is on,
        whose argmax is ``pred`` (what a served model answers, `deployments.serve_model`)."""
        import torch  # torch: only where a model is built or run

        with torch.inference_mode():
            return self._softmax(torch.from_numpy(images))[1].cpu().numpy()

    def _softmax(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(plain, TTA-averaged) softmax of ``images`` (N, C, H, W), on this predictor's device."""
        import torch  # torch: only where a model is built or run

        # On CPU, forward passes of at most FORWARD_VALUES input values: the activations of a batch of large
        # images (a 128x128 RGB batch of 250, with TTA's views all at once, took 3 GB) stay bounded.
        step = len(images) if self.device.type != "cpu" else max(1, FORWARD_VALUES // max(1, images[0].numel()))
        plains, averages = [], []
        for start in range(0, len(images), step):
            chunk = self._laid_out(images[start : start + step].to(self.device))
            plain = self.model(chunk).softmax(1)
            averaged = plain
            if self.tta:  # one view at a time, for the same reason
                total = plain.clone()
                for dy, dx in TTA_SHIFTS[1:]:
                    total += self.model(self._laid_out(shifted(chunk, dy, dx))).softmax(1)
                averaged = total / len(TTA_SHIFTS)
            plains.append(plain)
            averages.append(averaged)
        return torch.cat(plains), torch.cat(averages)

    def _laid_out(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` (N, C, H, W) as one dense tensor in this predictor's memory layout (a shifted view is a
        strided slice: a convolution on it took twice as long)."""
        return images.contiguous(memory_format=self.layout) if images.dim() == 4 else images.contiguous()


def confusion_matrix(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted]; ValueError when a label or a prediction is not one of the ``num_classes`` classes
    (a model with more outputs than the data has classes), which would otherwise be counted in another cell."""
    labels, preds = np.asarray(labels, dtype=np.int64), np.asarray(preds, dtype=np.int64)
    for what, values in (("prediction", preds), ("label", labels)):
        outside = (values < 0) | (values >= num_classes)
        if outside.any():
            raise ValueError(
                f"{int(outside.sum())} {what}(s) outside the {num_classes} classes (0-{num_classes - 1}), e.g. "
                f"{int(values[outside][0])}: the model's outputs do not match the data's classes; not scored"
            )
    return np.bincount(labels * num_classes + preds, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def metrics_from_confusion(confusion: np.ndarray) -> dict:
    """Accuracy and per-class precision / recall (0 where a class was never predicted / present)."""
    true_pos = np.diag(confusion).astype(np.float64)
    predicted, actual = confusion.sum(0), confusion.sum(1)
    return {
        "accuracy": float(true_pos.sum() / max(confusion.sum(), 1)),
        "precision": np.divide(true_pos, predicted, out=np.zeros_like(true_pos), where=predicted > 0).round(5).tolist(),
        "recall": np.divide(true_pos, actual, out=np.zeros_like(true_pos), where=actual > 0).round(5).tolist(),
    }


def actor_resources(cluster_cpus: float, num_actors: int, data_cpus: float = 1.0) -> tuple[float, int]:
    """(logical CPUs per model actor, torch threads per actor).

    Actors leave ``data_cpus`` free so the read and normalize tasks feeding them can run (an
    actor pool holding every CPU waits forever for its input); threads follow the physical split.
    """
    logical = max(0.25, round((cluster_cpus - data_cpus) / num_actors, 3))
    return logical, max(1, int(cluster_cpus // num_actors))


def actor_gpus(cluster_gpus: float, num_actors: int) -> float:
    """The share of a GPU each of ``num_actors`` model actors holds: 0 without GPUs, else up to a whole one
    (2 actors on 1 GPU: half each, both on it; scoring needs a fraction of a GPU's memory)."""
    gpus = int(cluster_gpus)
    return 0.0 if gpus < 1 else min(1.0, math.floor(gpus / num_actors * 1000) / 1000)


def predict(spec: TransformSpec, checkpoint: str, cfg: EvaluateConfig, model: ModelSpec | None = None) -> dict[str, np.ndarray]:
    """Run the actor pool over the test split; return row_id, label, pred and pred_plain arrays.

    ``model``: what the checkpoint holds (unset: what its extra_state.pt records).

    A test split that this process scores (`scores_here`) is also read here (`dataset.tensors.read_ahead.split_batches`:
    whole when it fits in memory, else window by window), by a thread that keeps up to two batches ahead of the
    scoring (`dataset.tensors.read_ahead.read_ahead`), not through Ray Data, which would start its own actors and task
    workers for the stage (docs/performance.md). Through Ray Data, the streamed split's
    read-ahead limit held the reader's finished window back while scoring ran, and Ray Data's scheduling
    loop (a thread of this process) went round about a thousand times a second, taking a core from the
    scoring: 8,000 64x64 RGB test images took 30-35 s, against 14-17 s read here and 13.6-14.0 s read
    ahead (2-core AMD EPYC Zen 4, docs/performance.md)."""
    if scores_here(ray.cluster_resources(), cfg.num_actors):
        batches = read_ahead(split_batches(spec, "test", cfg.batch_rows))  # read while the last batch is scored
        return _score_here(batches, checkpoint, cfg, model, threads=_cpus_here())
    test = build_datasets(spec, splits=("test",))["test"]
    return score(test, checkpoint, cfg, spec.config, model)


def predict_table(
    table: pa.Table, checkpoint: str, cfg: EvaluateConfig, transform: TransformConfig, model: ModelSpec | None = None,
    shape: tuple[int, int, int] = (1, 28, 28),
) -> dict[str, np.ndarray]:
    """Score Parquet-schema rows (row_id, image, label; label -1 when unknown) the way evaluation scores the test split.

    ``shape``: the images' (channels, height, width), the model card's."""
    rows = blocks(table, transform.block_rows).map_batches(
        prepare_batch,
        batch_format="pyarrow",
        batch_size=transform.batch_rows,
        fn_kwargs={"mean": transform.mean, "std": transform.std, "shape": tuple(shape)},
        num_cpus=transform.cpus_per_task,
    )
    return score(rows, checkpoint, cfg, transform, model)


def scores_here(cluster: dict, num_actors: int) -> bool:
    """Whether to score in the calling process instead of a pool of model actors: one actor asked for, on
    one node without GPUs. That actor would be a new process importing torch and loading the checkpoint
    (4-8 s on 2 cores for the bundled sample's 1,000 test images, most of the stage); the stage's own
    process has both already. A cluster, a GPU or ``num_actors`` > 1 keeps the pool."""
    if num_actors != 1 or cluster.get("GPU", 0):
        return False
    return sum(1 for node in ray.nodes() if node.get("Alive")) == 1


def score(
    images: ray.data.Dataset, checkpoint: str, cfg: EvaluateConfig, transform: TransformConfig, model: ModelSpec | None = None,
) -> dict[str, np.ndarray]:
    """The actor pool over normalized batches (image, label, row_id): row_id, label, pred and pred_plain, by row_id.

    On one node without GPUs and with one actor (`scores_here`), this process scores the batches as they
    stream in, with a torch thread per CPU, instead: same batches, same `Predictor`, same outputs."""
    cluster = ray.cluster_resources()
    if scores_here(cluster, cfg.num_actors):
        batches = images.iter_batches(batch_size=cfg.batch_rows, batch_format="numpy")
        return _score_here(batches, checkpoint, cfg, model, threads=_cpus_here(cluster))
    actor_cpus, threads = actor_resources(float(cluster.get("CPU", 1)), cfg.num_actors)
    gpus = actor_gpus(cluster.get("GPU", 0), cfg.num_actors)  # on a GPU machine the actors score on the GPUs
    predictions = images.map_batches(
        Predictor,
        fn_constructor_kwargs={
            "checkpoint_dir": checkpoint,
            "torch_threads": threads,
            "tta": cfg.tta,
            "model": model.model_dump() if model is not None else None,
            "use_gpu": gpus > 0,
        },
        batch_size=cfg.batch_rows,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=cfg.num_actors),
        num_cpus=actor_cpus,
        **({"num_gpus": gpus} if gpus else {}),
    )
    rows = predictions.to_arrow_refs()
    table = pa.concat_tables(ray.get(rows)).sort_by("row_id")
    return {name: table.column(name).to_numpy() for name in ("row_id", "label", "pred", "pred_plain")}


def _cpus_here(cluster: dict | None = None) -> int:
    """Torch threads for scoring in this process: the (one-node) cluster's CPUs."""
    return max(1, int((cluster or ray.cluster_resources()).get("CPU", 1)))


def _score_here(
    batches: Iterable[dict[str, np.ndarray]], checkpoint: str, cfg: EvaluateConfig, model: ModelSpec | None, threads: int,
) -> dict[str, np.ndarray]:
    """`score` in this process over normalized numpy ``batches`` (from Ray Data, or read here): `Predictor`
    scores them one by one (memory stays at a few batches whatever the split's size). The torch thread
    count is restored after."""
    import torch  # torch: only where a model is built or run

    before = torch.get_num_threads()
    try:
        predictor = Predictor(checkpoint, threads, cfg.tta, model.model_dump() if model is not None else None)
        parts = [predictor(batch) for batch in batches]
    finally:
        torch.set_num_threads(before)
    names = ("row_id", "label", "pred", "pred_plain")
    if not parts:
        return {name: np.zeros(0, dtype=np.int64) for name in names}
    out = {name: np.concatenate([part[name] for part in parts]) for name in names}
    order = np.argsort(out["row_id"], kind="stable")
    return {name: values[order] for name, values in out.items()}
