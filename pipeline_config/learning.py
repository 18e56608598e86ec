"""The training section of the configuration (the model's: `pipeline_config.model.ModelConfig`)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from pipeline_config.common import Section

# Fewer optimizer steps than this and a run is warned before training that it will hardly learn. The
# recipe benchmark (benchmarks/speed/recipe.py, docs/performance.md) shows the default recipe holding up from
# about 150 steps and not below; 100 leaves the warning to runs that are clearly too short.
FEW_STEPS = 100


def steps_per_epoch(train_rows: int, global_batch_size: int, workers: int = 1) -> int:
    """Optimizer steps in one epoch, as the training loop counts them (`training.worker.loop.start_attempt`):
    each of ``workers`` ranks takes ``global_batch_size // workers`` rows a step over its share of the rows."""
    batch = max(1, global_batch_size // workers)
    return max(1, math.ceil(train_rows / workers / batch))


def _count(n: int, word: str) -> str:
    """``2 steps``, ``1 step``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


class TrainConfig(Section):
    """Distributed training with Ray Train (TorchTrainer, Ray Train V2)."""

    mode: Literal["distributed", "single"] = Field(
        "distributed",
        description=(
            "distributed: Ray Train workers (TorchTrainer). single: the same model, recipe, data pipeline and "
            "checkpoint files in one process without Ray Train (the seeds' plain PyTorch section), to see the price "
            "of distribution on your hardware; it ignores the worker and Ray Train failure settings."
        ),
    )
    num_workers: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Ray Train workers (data-parallel ranks). 1 on a small CPU machine is fastest (one worker "
            "uses every core); raise it on a cluster."
        ),
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "Elastic training: when set, Ray Train runs with between min_workers and num_workers workers "
            "(ScalingConfig(num_workers=(min, max))), so losing a node restarts on what remains instead of "
            "waiting for it. The global batch stays the same: each worker takes global_batch_size / workers. Unset: fixed."
        ),
    )
    placement: Literal["PACK", "SPREAD"] = Field(
        "PACK",
        description=(
            "Where Ray places the workers (ScalingConfig.placement_strategy): PACK fills a node first, SPREAD puts "
            "them on different nodes when it can, so one lost node takes fewer of them."
        ),
    )
    epochs: int = Field(12, ge=1, le=1000, description="Passes over the training split (at most; see max_images).")
    max_images: int = Field(
        150_000,
        ge=0,
        le=10**10,
        description=(
            "Caps the epochs by data size: a run trains on about this many images at most, "
            "epochs = min(epochs, ceil(max_images / training rows)). The defaults give 12 epochs on the bundled "
            "3,800-image sample and 3 on full MNIST's 57,000. 0: no cap."
        ),
    )
    global_batch_size: int = Field(
        64, ge=1, le=65536, description=(
            "Images per optimizer step across all workers; each worker takes global ÷ workers. 64 by default: at 128 "
            "the bundled sample's run made half the steps and scored lower on some seeds (docs/performance.md)."
        ),
    )
    learning_rate: float = Field(3e-3, gt=0, le=10, description="Peak learning rate of the one-cycle AdamW schedule.")
    weight_decay: float = Field(5e-4, ge=0, le=1, description="AdamW weight decay.")
    label_smoothing: float = Field(0.1, ge=0, lt=1, description="Cross-entropy label smoothing.")
    ema_decay: float = Field(
        0.99,
        ge=0,
        lt=1,
        description=(
            "Upper bound of the decay of the moving average of the weights that is validated and saved (0 disables); "
            "a short run gets less, so the average spans at most a tenth of its optimizer steps (training.worker.recipe.plan_for)."
        ),
    )
    seed: int = Field(0, ge=0, description="Seed for weights, shuffling and augmentation.")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="Data-parallel strategy passed to prepare_model.")
    use_gpu: Literal["auto", "never", "always"] = Field(
        "auto",
        description=(
            "auto: use GPUs when the Ray cluster has them, one worker a GPU (fewer GPUs than num_workers: as many "
            "workers as GPUs, said in one line); never: CPUs only; always: GPUs or the run is refused."
        ),
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto",
        description=(
            "Arithmetic of the training step: bf16 or fp16 autocast (fp16 with a gradient scaler) or plain fp32. "
            "auto: bf16 on a GPU that supports it, else fp32 (so CPU runs stay fp32 unless asked). The weights "
            "stay fp32 either way; the precision used is recorded in the checkpoint, the model card and summary.json."
        ),
    )
    cuda_graph: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "The training step (forward, backward, AdamW, the weight average) captured once as a CUDA graph and "
            "replayed: the host launches one graph a step instead of hundreds of kernels. auto: on one GPU in bf16 or "
            "fp32 (several workers, FSDP and fp16 stay eager); on: also its eager form on a CPU; off: never."
        ),
    )
    resident_data: Literal["auto", "off"] = Field(
        "auto",
        description=(
            "Hold the training and validation splits in each training worker for the whole attempt (on its GPU, or in "
            "memory on a CPU) and build each epoch there, with the same order, sharding, augmentation and resumption as "
            "Ray Data's. auto: when both splits fit in memory (transform.in_memory_mb) and, on a GPU, in a quarter "
            "of its free memory; what does not fit streams through Ray Data. off: always Ray Data."
        ),
    )
    data_cpus: float = Field(
        1.0,
        ge=1,
        le=64,
        description=(
            "Logical CPUs left free for Ray Data while training runs; workers share the rest. "
            "At least 1: some Ray Data operators (file listing) always reserve a whole CPU. "
            "This is what keeps num_workers == CPU count from deadlocking."
        ),
    )
    max_failures: int = Field(2, ge=-1, le=100, description="Worker-group restarts Ray Train makes (FailureConfig); -1 = unlimited.")
    max_preemption_failures: int = Field(
        3,
        ge=-1,
        le=100,
        description=(
            "Restarts Ray Train makes after a node is preempted or drained (a spot reclaim, a node SIGTERMed), a "
            "budget apart from max_failures (FailureConfig.max_preemption_failures); -1 = unlimited."
        ),
    )
    preemption_check_steps: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description=(
            "Every this many optimizer steps the workers ask Ray Train whether a node of theirs is being preempted "
            "(ray.train.get_preemption_info, one small call shared by all ranks); if so they save a mid-epoch "
            "checkpoint at once, which the restart resumes from. 0: never ask."
        ),
    )
    preemption_check_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description=(
            "After the first epoch the preemption check runs about this many seconds apart (at least "
            "preemption_check_steps steps): on a GPU a step takes milliseconds and each check is a round trip through "
            "Ray Train. 0: every preemption_check_steps steps throughout."
        ),
    )
    stage_retries: int = Field(
        1,
        ge=0,
        le=20,
        description=(
            "Prefect retries of the training stage after Ray Train gives up (max_failures spent) on an "
            "infrastructure failure (a worker or node lost, a hang); each retry resumes the same Ray Train run "
            "from its latest checkpoint. Errors in the training code are never retried."
        ),
    )
    stage_retry_delay_s: float = Field(10.0, ge=0, le=3600, description="Seconds Prefect waits before retrying the training stage.")
    hang_timeout_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description=(
            "A training worker that does not reach the next step within this many seconds (stalled, deadlocked, stuck "
            "in a collective) fails the attempt with an error naming its rank; 0 disables the per-step check."
        ),
    )
    checkpoint_every_steps: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Also checkpoint every this many optimizer steps inside an epoch (0: only at epoch ends). Such a checkpoint "
            "records which rows the epoch has trained on, so a restart trains the rest of the epoch exactly once, "
            "with any number of workers."
        ),
    )
    num_to_keep: int = Field(2, ge=1, le=100, description="Checkpoints Ray Train keeps, best by checkpoint_score.")
    checkpoint_score: Literal["val_loss", "val_accuracy"] = Field(
        "val_loss",
        description=(
            "Validation metric that ranks checkpoints (CheckpointConfig) and picks the one evaluated. "
            "val_loss by default: on a small validation split accuracy moves in coarse steps, and a "
            "mid-training 100% picked a checkpoint that scored 98.4% on test (measured)."
        ),
    )

    def epochs_for(self, train_rows: int) -> int:
        """The epochs a run over ``train_rows`` training rows makes: ``epochs``, capped by ``max_images``."""
        if self.max_images == 0 or train_rows <= 0:
            return self.epochs
        return max(1, min(self.epochs, math.ceil(self.max_images / train_rows)))

    def optimizer_steps(self, train_rows: int, workers: int | None = None) -> int:
        """The optimizer steps a run over ``train_rows`` training rows makes: steps an epoch x `epochs_for`.

        ``workers``: the ranks sharing each global batch; unset, this config's (1 in single mode).
        """
        workers = self.train_workers() if workers is None else workers
        return steps_per_epoch(train_rows, self.global_batch_size, workers) * self.epochs_for(train_rows)

    def train_workers(self) -> int:
        """The ranks that share each global batch: ``num_workers``, 1 in single mode."""
        return 1 if self.mode == "single" else self.num_workers

    def few_steps_warning(self, train_rows: int) -> str | None:
        """What to say before training when the run makes fewer than `FEW_STEPS` optimizer steps, with the fix; else None."""
        workers = self.train_workers()
        steps, epochs = self.optimizer_steps(train_rows), self.epochs_for(train_rows)
        if steps >= FEW_STEPS:
            return None
        per_epoch = steps_per_epoch(train_rows, self.global_batch_size, workers)
        over = f" over {workers} workers" if workers > 1 else ""
        fixes = []
        batch = self._batch_for_enough_steps(train_rows)
        if batch is not None:
            fixes.append(f"lower train.global_batch_size (e.g. {batch} gives {steps_per_epoch(train_rows, batch, workers) * epochs})")
        fixes.append(self._epochs_fix(train_rows, per_epoch))
        return (
            f"this run makes {_count(steps, 'optimizer step')} ({train_rows} training images / global batch {self.global_batch_size}"
            f"{over} = {_count(per_epoch, 'step')} an epoch x {_count(epochs, 'epoch')}); "
            f"the default recipe needs about {FEW_STEPS} or more to learn: {' or '.join(fixes)}"
        )

    def _batch_for_enough_steps(self, train_rows: int) -> int | None:
        """The largest power-of-two global batch below this one (at least one row per worker) giving `FEW_STEPS` steps."""
        workers, epochs = self.train_workers(), self.epochs_for(train_rows)
        batch = 1 << (self.global_batch_size.bit_length() - 1)
        batch = batch // 2 if batch == self.global_batch_size else batch
        while batch >= workers:
            if steps_per_epoch(train_rows, batch, workers) * epochs >= FEW_STEPS:
                return batch
            batch //= 2
        return None

    def _epochs_fix(self, train_rows: int, per_epoch: int) -> str:
        """Raising train.epochs to reach `FEW_STEPS`, and train.max_images too when its cap would hold the epochs back."""
        epochs = math.ceil(FEW_STEPS / per_epoch)
        if self.max_images == 0 or math.ceil(self.max_images / max(train_rows, 1)) >= epochs:
            return f"raise train.epochs (e.g. {epochs} gives {epochs * per_epoch})"
        return f"raise train.epochs and train.max_images (e.g. {epochs} and {epochs * train_rows} give {epochs * per_epoch})"
