"""Stage 5: batch inference on the test split with a pool of model actors, metrics, the gate, promotion.

The best checkpoint scores the test split through a pool of model actors (`training.inference`,
the seeds' ``ModelWorker`` idea, batched). Results land in ``<run>/evaluation/`` and the reports
(confusion matrix, predictions, metrics, checkpoint) are published to the Prefect UI before the
gate decides, so a failed gate keeps every artifact and shows its evidence.

Last, champion promotion (`training.registry`): a model that passed the gate replaces the
champion under ``<root>/models/<promote.model_name>/`` (unset: ``<workload>-<model>``) only when it is better on the same test
set; every run, gate failed or not, adds its row to the model's run-comparison table.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from pydantic import BaseModel

from dataset.parquet import image_record
from dataset.transform import TransformSpec
from pipeline_config import DEFAULT_WORKLOAD, EvaluateConfig, PromoteConfig
from reporting import artifacts, environment, pictures
from reporting.logs import stage_logger
from storage_io import StorageLayout, atomic_write_bytes, atomic_write_json, join, lease_path, read_json, storage_writes
from training import registry, registry_files
from training.inference import confusion_matrix, metrics_from_confusion, predict
from training.trainer import TrainedModel


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
    promotion: registry.Promotion | None = None  # None: promotion is off (promote.enabled)
    classes: list[str] = []  # the class names: confusion[i][j] counts images of classes[i] predicted as classes[j]

    def terminal_detail(self) -> str:
        """What the evaluation stage's closing terminal line adds after its name and seconds."""
        promoted = ""
        if self.promotion is not None:
            promoted = f", promoted to {self.promotion.model} v{self.promotion.version}" if self.promotion.promoted else ", not promoted"
        verdict = "passed" if self.passed_gate else "FAILED"
        return f": test accuracy {self.accuracy:.2%} (gate {self.min_accuracy:.2%} {verdict}){promoted}"


@task(name="evaluate")
def evaluate(
    trained: TrainedModel,
    spec: TransformSpec,
    cfg: EvaluateConfig,
    layout: StorageLayout,
    promote: PromoteConfig | None = None,
    run_config: dict[str, Any] | None = None,
    raw_dir: str | None = None,
    workload: str = DEFAULT_WORKLOAD,
) -> Evaluation:
    """Score the best checkpoint on the held-out test split, apply the accuracy gate, promote a better model.

    ``promote``: the promotion settings (None: no promotion); ``run_config``: the run's whole
    configuration, for the model card; ``raw_dir``: the raw data the dataset was built from;
    ``workload``: names the reports' artifact keys and, with the trained model, the registry's
    model when ``promote.model_name`` is unset (``<workload>-<model>``).
    """
    logger = stage_logger(__name__)
    out = predict(spec, trained.best_checkpoint, cfg, trained.model)
    if len(out["row_id"]) != spec.dataset.rows["test"]:
        raise RuntimeError(f"evaluation saw {len(out['row_id'])} test rows, expected {spec.dataset.rows['test']}")
    confusion = confusion_matrix(out["label"], out["pred"], spec.dataset.num_classes)
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
        classes=list(spec.dataset.classes),
        **scores,
    )
    with storage_writes("evaluate"):
        atomic_write_json(result.metrics_path, result.model_dump())
    logger.info(
        "Test accuracy %.4f on %d images (without test-time augmentation %.4f; %s)",
        result.accuracy, result.rows, plain_accuracy, artifacts.gate_verdict(result.accuracy, cfg.min_accuracy),
    )
    # The evidence first, the verdict second: a failed gate's run page shows why it failed.
    artifacts.publish_evaluation_report(result, spec.dataset, trained, workload)
    if promote is not None and promote.enabled:
        name = promote.registry_name(workload, trained.model.name)
        result.promotion = promote_model(result, trained, spec, cfg, layout, promote, run_config or {}, raw_dir, name)
        with storage_writes("evaluate"):
            atomic_write_json(result.metrics_path, result.model_dump())
        logger.info("Model %s: %s", name, promotion_line(result.promotion))
    if not result.passed_gate:
        raise QualityGateError(
            f"test accuracy {result.accuracy:.4f} is below evaluate.min_accuracy {cfg.min_accuracy:.4f}; "
            f"every artifact is kept: metrics in {result.metrics_path}, checkpoint {result.checkpoint}"
        )
    return result


def promotion_line(promotion: registry.Promotion) -> str:
    """``promoted to v3 (...)`` or ``not promoted (...)``: the decision and its reason in one phrase."""
    if promotion.promoted:
        return f"promoted to v{promotion.version}: {promotion.reason}"
    return f"not promoted: {promotion.reason}"


def promote_model(
    result: Evaluation,
    trained: TrainedModel,
    spec: TransformSpec,
    cfg: EvaluateConfig,
    layout: StorageLayout,
    promote: PromoteConfig,
    run_config: dict[str, Any],
    raw_dir: str | None,
    model_name: str,
) -> registry.Promotion:
    """Compare the evaluated model with the champion of ``model_name``, promote it when better, and publish the run comparison."""
    from prefect.runtime import flow_run

    candidate = registry.Candidate(
        run_name=layout.run_name,
        flow_run_id=str(flow_run.id) if flow_run.id else None,
        checkpoint=result.checkpoint,
        accuracy=result.accuracy,
        passed_gate=result.passed_gate,
        data_hash=registry_files.data_hash(spec.dataset.directory),
        dataset_dir=spec.dataset.directory,
        raw_dir=raw_dir,
        metrics={
            "rows": result.rows,
            "accuracy_without_tta": result.accuracy_without_tta,
            "precision": result.precision,
            "recall": result.recall,
            "best_val_accuracy": trained.best_val_accuracy,
        },
        config=run_config,
        model=trained.model.model_dump(),
        code_version=environment.git_commit(),
        data_spec=data_spec(spec),
    )
    version_pictures = {"confusion_matrix.png": pictures.confusion_matrix_png(result.confusion, spec.dataset.classes)}
    if trained.history:
        version_pictures["training_curves.png"] = pictures.training_curves_png(trained.history)

    def rescore(folder: str) -> float:  # the champion on this run's test set, through the same actor pool
        card = read_json(join(folder, registry_files.CARD_FILE))
        theirs = registry_files.card_data(card if isinstance(card, dict) else {})
        if tuple(theirs["shape"]) != tuple(spec.dataset.image_shape) or list(theirs["classes"]) != list(spec.dataset.classes):
            raise ValueError(
                f"promote.model_name {promote.model_name}: its champion ({folder}) was trained on {theirs['shape']} images of "
                f"classes {theirs['classes']}, this run on {tuple(spec.dataset.image_shape)} images of classes "
                f"{list(spec.dataset.classes)}; they cannot be compared: give this workload its own promote.model_name"
            )
        out = predict(spec, folder, cfg, registry_files.version_model(folder))
        return float((out["label"] == out["pred"]).mean()) if len(out["label"]) else 0.0

    promotion = registry.promote(layout, model_name, candidate, promote.min_improvement, version_pictures, rescore)
    with storage_writes("evaluate"):
        registry.record_run(layout.root, model_name, run_row(result, trained, candidate, promotion, layout))
    runs = registry.recent_runs(layout.root, model_name, promote.recent_runs)
    artifacts.publish_run_comparison(model_name, runs, promotion.model_dump())
    return promotion


def data_spec(spec: TransformSpec) -> dict[str, Any]:
    """What ``flows.predict`` needs to score new images as evaluation scored the test split: the
    images' shape, the class names, and the normalization (``transform.mean``/``std``, ``image_size``)."""
    return {
        "image": image_record(tuple(spec.dataset.image_shape)),
        "classes": list(spec.dataset.classes),
        "mean": spec.config.mean,
        "std": spec.config.std,
        "image_size": spec.config.image_size,
    }


def run_row(
    result: Evaluation, trained: TrainedModel, candidate: registry.Candidate, promotion: registry.Promotion, layout: StorageLayout
) -> dict[str, Any]:
    """This run's row of the model's comparison table."""
    epochs = [row for row in trained.history if "epoch" in row]
    last = epochs[-1] if epochs else {}
    speeds = [row["images_per_s"] for row in epochs if isinstance(row.get("images_per_s"), (int, float))]
    lease = read_json(lease_path(layout))
    started = lease.get("started") if isinstance(lease, dict) else None
    return {
        "run": layout.run_name,
        "flow_run_id": candidate.flow_run_id,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "data_hash": candidate.data_hash,
        "test_accuracy": result.accuracy,
        "passed_gate": result.passed_gate,
        "val_loss": last.get("val_loss"),
        "epochs": len(epochs),
        "train_images_per_s": sum(speeds) / len(speeds) if speeds else None,
        "wall_s": time.time() - started if isinstance(started, (int, float)) else None,  # run start to this decision
        "promoted": promotion.promoted,
        "version": promotion.version if promotion.promoted else None,
        "reason": promotion.reason,
    }
