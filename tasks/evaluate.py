"""Stage 5: batch inference on the test split with a pool of model actors, metrics, and the gate.

The seeds' ``ModelWorker`` idea, batched: Ray Data streams normalized test batches through
``num_actors`` actors that each load the best checkpoint once. Results land in
``<run>/evaluation/`` and the reports (confusion matrix, predictions, metrics, checkpoint) are
published to the Prefect UI before the gate decides, so a failed gate keeps every artifact and
shows its evidence.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
import torch
import torch.nn.functional as F
from prefect import task
from pydantic import BaseModel

from pipeline_config import EvaluateConfig
from tasks.common import reports
from tasks.common.model import load_model
from tasks.common.logs import stage_logger
from tasks.common.storage import StorageLayout, atomic_write_bytes, atomic_write_json, join, storage_writes
from tasks.train import TrainedModel
from tasks.transform import TransformSpec, build_datasets

NUM_CLASSES = 10


class QualityGateError(RuntimeError):
    """Test accuracy below ``evaluate.min_accuracy``."""


class Evaluation(BaseModel):
    """Test-set metrics of the evaluated checkpoint and where they were saved."""

    checkpoint: str
    accuracy: float
    precision: list[float]
    recall: list[float]
    confusion: list[list[int]]
    rows: int
    metrics_path: str
    predictions_path: str
    passed_gate: bool
    min_accuracy: float = 0.0  # the gate it was held to
    tta: bool = False
    accuracy_without_tta: float | None = None


# Test-time augmentation: the image itself and its four one-pixel shifts (dy, dx).
TTA_SHIFTS = ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))


def shifted(images: torch.Tensor, dy: int, dx: int, fill: float) -> torch.Tensor:
    """(N, 1, 28, 28) images moved by (dy, dx) pixels; uncovered pixels become ``fill`` (background)."""
    if dy == 0 and dx == 0:
        return images
    h, w = images.shape[-2:]
    padded = F.pad(images, (1, 1, 1, 1), value=fill)
    return padded[..., 1 - dy : 1 - dy + h, 1 - dx : 1 - dx + w]


class Predictor:
    """Ray Data actor: loads the checkpoint once, then predicts batch after batch.

    ``pred`` is the class with the highest softmax averaged over the image and its four one-pixel
    shifts when ``tta`` is on (``background`` fills the uncovered edge), else the plain argmax;
    ``pred_plain`` is always the plain argmax, so both accuracies are reported.
    """

    def __init__(self, checkpoint_dir: str, torch_threads: int = 1, tta: bool = False, background: float = -1.0):
        torch.set_num_threads(torch_threads)
        self.model = load_model(checkpoint_dir)  # a folder or an s3:// URI
        self.tta, self.background = tta, background

    @torch.inference_mode()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = torch.from_numpy(batch["image"])
        plain = self.model(images).softmax(1)
        averaged = plain
        if self.tta:
            views = [shifted(images, dy, dx, self.background) for dy, dx in TTA_SHIFTS[1:]]
            averaged = (plain + self.model(torch.cat(views)).softmax(1).view(len(views), len(images), -1).sum(0)) / len(TTA_SHIFTS)
        return {
            "row_id": batch["row_id"],
            "label": batch["label"],
            "pred": averaged.argmax(1).numpy(),
            "pred_plain": plain.argmax(1).numpy(),
        }


def confusion_matrix(labels: np.ndarray, preds: np.ndarray, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """counts[true, predicted]."""
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


def predict(spec: TransformSpec, checkpoint: str, cfg: EvaluateConfig) -> dict[str, np.ndarray]:
    """Run the actor pool over the test split; return row_id, label, pred and pred_plain arrays."""
    test = build_datasets(spec, splits=("test",))["test"]
    actor_cpus, threads = actor_resources(float(ray.cluster_resources().get("CPU", 1)), cfg.num_actors)
    predictions = test.map_batches(
        Predictor,
        fn_constructor_kwargs={
            "checkpoint_dir": checkpoint,
            "torch_threads": threads,
            "tta": cfg.tta,
            "background": (0.0 - spec.config.mean) / spec.config.std,  # a black pixel, normalized
        },
        batch_size=cfg.batch_rows,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=cfg.num_actors),
        num_cpus=actor_cpus,
    )
    rows = predictions.to_arrow_refs()
    table = pa.concat_tables(ray.get(rows)).sort_by("row_id")
    return {name: table.column(name).to_numpy() for name in ("row_id", "label", "pred", "pred_plain")}


@task(name="evaluate")
def evaluate(trained: TrainedModel, spec: TransformSpec, cfg: EvaluateConfig, layout: StorageLayout) -> Evaluation:
    """Score the best checkpoint on the held-out test split and apply the accuracy gate."""
    logger = stage_logger(__name__)
    out = predict(spec, trained.best_checkpoint, cfg)
    if len(out["row_id"]) != spec.dataset.rows["test"]:
        raise RuntimeError(f"evaluation saw {len(out['row_id'])} test rows, expected {spec.dataset.rows['test']}")
    confusion = confusion_matrix(out["label"], out["pred"])
    scores = metrics_from_confusion(confusion)
    plain_accuracy = float((out["label"] == out["pred_plain"]).mean()) if len(out["label"]) else 0.0
    folder = layout.evaluation_dir
    predictions_path = join(folder, "predictions.parquet")
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table(out), buffer)
    with storage_writes("evaluate"):
        atomic_write_bytes(predictions_path, buffer.getvalue().to_pybytes())
    result = Evaluation(
        checkpoint=trained.best_checkpoint,
        confusion=confusion.tolist(),
        rows=int(confusion.sum()),
        metrics_path=join(folder, "metrics.json"),
        predictions_path=predictions_path,
        passed_gate=scores["accuracy"] >= cfg.min_accuracy,
        min_accuracy=cfg.min_accuracy,
        tta=cfg.tta,
        accuracy_without_tta=plain_accuracy,
        **scores,
    )
    with storage_writes("evaluate"):
        atomic_write_json(result.metrics_path, result.model_dump())
    logger.info(
        "Test accuracy %.4f on %d images (without test-time augmentation %.4f; %s)",
        result.accuracy, result.rows, plain_accuracy, reports.gate_verdict(result.accuracy, cfg.min_accuracy),
    )
    # The evidence first, the verdict second: a failed gate's run page shows why it failed.
    reports.publish_evaluation_report(result, spec.dataset, trained)
    if not result.passed_gate:
        raise QualityGateError(
            f"test accuracy {result.accuracy:.4f} is below evaluate.min_accuracy {cfg.min_accuracy:.4f}; "
            f"every artifact is kept: metrics in {result.metrics_path}, checkpoint {result.checkpoint}"
        )
    return result
