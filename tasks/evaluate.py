"""Stage 5: batch inference on the test split with a pool of model actors, metrics, the gate's verdict.

The best checkpoint scores the test split through a pool of model actors (`training.inference`,
the seeds' ``ModelWorker`` idea, batched). Results land in ``<run>/evaluation/`` and the reports
(confusion matrix, predictions, metrics, checkpoint) are published to the Prefect UI. The stage
says whether the model passed its gate (`tasks.gate`: ``evaluate.min_accuracy`` when set, else the
workload's own, its champion's on this test split or the data's baseline) and, when not, what failed;
the next stage (`tasks.promote`) records the run in the model's history and acts on that verdict, so a
failed gate keeps every artifact, shows its evidence and still has its row in the run comparison.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task

from dataset.tensors.memory import release_memory
from dataset.tensors.spec import TransformSpec
from pipeline_config import DEFAULT_WORKLOAD, EvaluateConfig
from reporting import artifacts, report_text
from reporting.logs import stage_logger
from storage_io import StorageLayout, atomic_write_bytes, atomic_write_json, join, storage_writes
from tasks import gate as gates
from tasks.manifests import Evaluation
from training.inference import confusion_matrix, metrics_from_confusion, predict
from training.manifests import TrainedModel


@task(name="evaluate")
def evaluate(
    trained: TrainedModel,
    spec: TransformSpec,
    cfg: EvaluateConfig,
    layout: StorageLayout,
    workload: str = DEFAULT_WORKLOAD,
    registry_name: str | None = None,
) -> Evaluation:
    """Score the best checkpoint on the held-out test split and say whether it passed the accuracy gate.

    ``workload`` names the reports' artifact keys. The gate is `tasks.gate.gate_for`'s: ``evaluate.min_accuracy``
    when set, else the data's own gate, its champion's (``registry_name``'s; None: promotion is off) or its
    baseline; a champion scored on other data is scored on this run's test split first. The verdict is
    ``passed_gate``, with ``gate_failures`` saying what failed; the promote stage records it and fails the run
    when the gate failed.
    """
    logger = stage_logger(__name__)
    rescore = gates.champion_scorer(spec, cfg, registry_name)
    gate = gates.gate_for(cfg, spec.dataset, layout.root, registry_name, rescore)  # before scoring: the champion before this run
    out = predict(spec, trained.best_checkpoint, cfg, trained.model)
    if len(out["row_id"]) != spec.dataset.rows["test"]:
        raise RuntimeError(f"evaluation saw {len(out['row_id'])} test rows, expected {spec.dataset.rows['test']}")
    confusion = confusion_matrix(out["label"], out["pred"], spec.dataset.num_classes)
    scores = metrics_from_confusion(confusion)
    failed = gates.failures(gate, confusion, spec.dataset.classes)
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
        passed_gate=not failed,
        min_accuracy=gate.min_accuracy,
        gate=gate.origin,
        gate_failures=failed,
        champion=gate.champion,
        tta=cfg.tta,
        accuracy_without_tta=plain_accuracy,
        classes=list(spec.dataset.classes),
        **scores,
    )
    with storage_writes("evaluate"):
        atomic_write_json(result.metrics_path, result.model_dump())
    logger.info(
        "Test accuracy %.4f on %d images (without test-time augmentation %.4f; %s; the gate: %s)",
        result.accuracy, result.rows, plain_accuracy, report_text.gate_verdict(result.accuracy, gate.min_accuracy, failed), gate.origin,
    )
    # The evidence before any verdict acts: a failed gate's run page shows why it failed.
    artifacts.publish_evaluation_report(result, spec.dataset, trained, workload)
    release_memory()  # this Ray worker is reused: it should not idle holding the scoring's peak
    return result
