"""Stage 4: distributed training with Ray Train (TorchTrainer, Ray Train V2).

The flow, not the trainer, names the run: ``RunConfig(storage_path=<root>/runs, name=<run>)``,
so calling this stage again with the same run name resumes that Ray Train run from its latest
checkpoint instead of starting over.

Which layer owns which failure:

* Ray Train owns lost workers and nodes and hangs: it restarts the worker group from the latest
  checkpoint, up to ``train.max_failures`` times (``FailureConfig``).
* Prefect owns the case where Ray Train gives up: the stage is retried ``train.stage_retries``
  times (``retry_infrastructure_failures`` decides), and each retry calls ``fit()`` again with
  the same storage path and run name, which resumes the run from its latest checkpoint. A bug in
  the training code (every failed rank raised an ordinary exception) is not retried.
* The flow owns a lost driver: ``python -m flows.mnist --run-name <same name>`` skips finished
  stages whose outputs verify on storage and this stage resumes from the latest checkpoint.
* Nobody retries a storage root that takes no more writes (full, read-only, over quota): the
  stage fails with a `StorageWriteError` naming the stage, the folder and the cause. Rank 0
  removes the checkpoint folder whose upload failed (each checkpoint's folder name is known
  before its upload: ``checkpoint_epoch-0003``, ``checkpoint_epoch-0003_step-000120``), so it
  neither holds the space a restart needs nor looks like a checkpoint; cleanup removes any such
  folder that still got left behind.

Total budget before a run fails: (max_failures + 1) x (stage_retries + 1) training attempts.

``train.mode: single`` runs the same loop in this stage's own process without Ray Train
(training.single_process), as a baseline for the price of distribution. The trainer, its
resources in `training.trainer`, the failure rules in `training.failures`; this stage is their Prefect task.
"""

from __future__ import annotations

import ray
from prefect import task

from dataset.tensors.spec import TransformSpec
from pipeline_config import DEFAULT_WORKLOAD, ModelConfig, TrainConfig
from reporting.logs import stage_logger
from reporting.training_progress import training_progress_callbacks
from storage_io import StorageLayout
from training.failures import is_infrastructure_failure
from training.manifests import TrainedModel
from training.model import weights
from training.model.catalog import ModelSpec
from training.resources import plan_cluster
from training.trainer import fit, fit_in_process, torch_trainer


def retry_infrastructure_failures(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn`` of the training stage: retry infrastructure failures only."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - classifying it is the point
        return is_infrastructure_failure(exc)
    return False


@task(name="train")
def train(
    spec: TransformSpec, cfg: TrainConfig, layout: StorageLayout, model: ModelConfig | None = None, workload: str = DEFAULT_WORKLOAD,
) -> TrainedModel:
    """Train ``model.name`` (default ResNet-18) with Ray Train on the transformed data; checkpoints go to the run folder.

    ``workload`` names the live progress artifact (``<workload>-training-progress``).
    """
    logger = stage_logger(__name__)
    network = ModelSpec.for_data((model or ModelConfig()).name, spec.dataset)
    logger.info("Model %s for %d-channel images and %d classes", network.name, network.in_channels, network.num_classes)
    start, said = weights.for_training((model or ModelConfig()).weights, layout.root, network)  # WeightsError naming it
    if start:
        logger.info("%s", said)
    loaded = start.model_dump() if start else None  # what every worker loads for a fresh start
    resources = ray.cluster_resources()
    if cfg.mode == "single":
        threads = max(1, int(resources.get("CPU", 1)))
        logger.info("Training in one process without Ray Train (train.mode=single), %d torch threads", threads)
        trained = fit_in_process(spec, cfg, network, layout.run_dir, threads, loaded)
    else:
        plan = plan_cluster(cfg, resources.get("CPU", 0), resources.get("GPU", 0))
        # plan.note (use_gpu=auto, fewer GPUs than workers) was said once, by the flow's check before any stage.
        cfg, cpus = plan.config_for(cfg), plan.cpus_per_worker
        left = resources.get("CPU", 0) - cfg.num_workers * cpus
        logger.info("Training with %d workers x %.3g CPUs (gpu=%s, %d torch threads each), %.3g CPUs left to Ray Data",
                    cfg.num_workers, cpus, plan.use_gpu, plan.threads, left)
        # Live progress in the Prefect UI: the callback runs in the Train controller process.
        callbacks = training_progress_callbacks(cfg.epochs_for(spec.dataset.rows["train"]), layout.run_name, workload)
        trainer = torch_trainer(spec, cfg, network, layout.run_dir, plan.use_gpu, cpus, plan.threads, callbacks, loaded)
        trained = fit(trainer, cfg, layout.run_dir, cpus)
    if start:
        trained = trained.model_copy(update={"weights": start.record()})
    if len(trained.attempts) > 1:
        logger.info("Training took %d attempts, starting at epochs %s", len(trained.attempts), [a["start_epoch"] for a in trained.attempts])
    logger.info("Best checkpoint %s (val accuracy %.4f)%s", trained.best_checkpoint, trained.best_val_accuracy,
                "".join(f", {key} {value}" for key, value in trained.compute().items()))
    few_steps = cfg.few_steps_warning(spec.dataset.rows["train"])  # the flow said it before training; the report shows it
    return trained.model_copy(update={"warnings": [few_steps]}) if few_steps else trained
