"""Stage 6: the gate's verdict acted on: the run recorded in its model's history, a better model promoted.

Every evaluated run, gate passed or not, adds its row to the model's run-comparison table under
``<root>/models/<promote.model_name>/`` (unset: ``<workload>-<model>``), published to the Prefect
UI under keys stable across runs, and is remembered as the last trained run there
(`training.champion.unchanged.remember`: what ``promote.skip_unchanged`` compares a run with besides the champion). A
model that passed its gate (`tasks.gate`) replaces the champion only when it is better on the same test
set (`training.champion.registry`); a champion the gate already scored on this test set is not scored again.
The decision is added to the run's ``evaluation/metrics.json``.

Then the gate: a model that failed it fails this stage and the run (saying what failed, the gate and
where its number came from), with its evidence already published by evaluation and its row already in
the comparison. With promotion off (``promote.enabled``) the stage only applies the gate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from prefect import task
from prefect.runtime import flow_run
from pydantic import BaseModel

from dataset.formats.parquet import image_record
from dataset.tensors.spec import TransformSpec
from pipeline_config import DEFAULT_WORKLOAD, EvaluateConfig, PromoteConfig
from reporting import artifacts, environment, pictures
from reporting.logs import stage_logger
from storage_io import StorageLayout, atomic_write_json, lease_path, read_json, storage_writes
from tasks.gate import champion_scorer
from tasks.manifests import Evaluation
from training.champion import registry, registry_files, unchanged
from training.manifests import TrainedModel


class QualityGateError(RuntimeError):
    """The evaluated model failed its gate (`tasks.gate`): below its accuracy, or a class it never gets right."""


class PromotionOutcome(BaseModel):
    """What the promote stage decided: the registry's decision, or None when promotion is off."""

    promotion: registry.Promotion | None = None

    def terminal_detail(self) -> str:
        """What the promote stage's closing terminal line adds after its name and seconds."""
        if self.promotion is None:
            return ": promotion is off (promote.enabled)"
        if self.promotion.promoted:
            return f": {self.promotion.model} v{self.promotion.version} is the champion"
        return f": {self.promotion.model} not promoted ({self.promotion.reason})"


@task(name="promote")
def promote(
    evaluation: Evaluation,
    trained: TrainedModel,
    spec: TransformSpec,
    cfg: PromoteConfig,
    evaluate_cfg: EvaluateConfig,
    layout: StorageLayout,
    run_config: dict[str, Any] | None = None,
    raw_dir: str | None = None,
    workload: str = DEFAULT_WORKLOAD,
) -> PromotionOutcome:
    """Record the evaluated run in its model's history, promote it when it passed the gate and is
    better than the champion, then fail on a failed gate (`QualityGateError`).

    ``evaluate_cfg``: how the champion is scored again when the test set changed (the same actor
    pool as evaluation); ``run_config``: the run's whole configuration, for the model card;
    ``raw_dir``: the raw data the dataset was built from; ``workload``: with the trained model, the
    registry's model when ``promote.model_name`` is unset (``<workload>-<model>``).
    """
    outcome = PromotionOutcome()
    if cfg.enabled:
        name = cfg.registry_name(workload, trained.model.name)
        outcome.promotion = promote_model(evaluation, trained, spec, evaluate_cfg, layout, cfg, run_config or {}, raw_dir, name)
        evaluation = evaluation.model_copy(update={"promotion": outcome.promotion})
        with storage_writes("promote"):
            atomic_write_json(evaluation.metrics_path, evaluation.model_dump())
        stage_logger(__name__).info("Model %s: %s", name, promotion_line(outcome.promotion))
    if not evaluation.passed_gate:
        raise QualityGateError(gate_failed_message(evaluation))
    return outcome


def gate_failed_message(evaluation: Evaluation) -> str:
    """What failed the gate, the gate and where its number came from, and where the evidence is."""
    failed = evaluation.gate_failures or [
        f"test accuracy {evaluation.accuracy:.4f} is below the gate {evaluation.min_accuracy:.4f}"]  # an older metrics.json
    origin = f"; the gate came from: {evaluation.gate}" if evaluation.gate else ""
    return (
        f"{'; '.join(failed)}{origin}; every artifact is kept: "
        f"metrics in {evaluation.metrics_path}, checkpoint {evaluation.checkpoint}"
    )


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
    candidate = make_candidate(result, trained, spec, layout, run_config, raw_dir)
    version_pictures = {"confusion_matrix.png": pictures.confusion_matrix_png(result.confusion, spec.dataset.classes)}
    if trained.history:
        version_pictures["training_curves.png"] = pictures.training_curves_png(trained.history)
    rescore = known_scores(result, layout.root, model_name, champion_scorer(spec, cfg, promote.model_name))
    promotion = registry.promote(layout, model_name, candidate, promote.min_improvement, version_pictures, rescore)
    with storage_writes("promote"):
        registry.record_run(layout.root, model_name, run_row(result, trained, candidate, promotion, layout))
        unchanged.remember(layout.root, model_name, candidate, promotion)  # promote.skip_unchanged compares with it too
    runs = registry.recent_runs(layout.root, model_name, promote.recent_runs)
    artifacts.publish_run_comparison(model_name, runs, promotion.model_dump())
    return promotion


def make_candidate(
    result: Evaluation, trained: TrainedModel, spec: TransformSpec, layout: StorageLayout, run_config: dict[str, Any],
    raw_dir: str | None,
) -> registry.Candidate:
    """The evaluated model as the registry sees it: its scores, its data and recipe, what its card will say."""
    return registry.Candidate(
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
        weights=trained.weights,
        training=trained.compute(),  # device and precision of the training step
        code_version=environment.git_commit(),
        data_spec=data_spec(spec),
    )


def known_scores(evaluation: Evaluation, root: str, model: str, rescore: Callable[[str], float]) -> Callable[[str], float]:
    """``rescore``, except for the champion the evaluation's gate already scored on this test split (the
    same version folder): its accuracy then, without scoring it a second time."""
    known = evaluation.champion

    def score(folder: str) -> float:
        if known is not None and known.rescored and folder == registry_files.version_dir(root, model, known.version):
            return known.accuracy
        return rescore(folder)

    return score


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
