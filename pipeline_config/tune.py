"""The search's configuration: ranges, the search space, the tune section and `TunePipelineConfig`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline_config.common import Section
from pipeline_config.model import PipelineConfig


class Range(Section):
    """A closed interval Tune samples from; low == high fixes the knob at that value."""

    low: float = Field(description="Smallest value sampled.")
    high: float = Field(description="Largest value sampled.")

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is larger than high ({self.high:g}); swap them")
        return self


class SearchSpace(Section):
    """The recipe's knobs a search samples, one distribution each (fix one with low == high or a single choice)."""

    learning_rate: Range = Field(
        default=Range(low=3e-4, high=1e-2),
        description="Peak learning rate (train.learning_rate), sampled log-uniformly; low must be > 0.",
    )
    weight_decay: Range = Field(
        default=Range(low=1e-5, high=1e-2),
        description="AdamW weight decay (train.weight_decay), sampled log-uniformly; low must be > 0.",
    )
    global_batch_size: list[int] = Field(
        default=[64, 128, 256],
        min_length=1,
        max_length=16,
        description="Images per optimizer step (train.global_batch_size), one of these, uniformly.",
    )
    augmentation: Range = Field(
        default=Range(low=0.0, high=1.5),
        description=(
            "Augmentation strength, sampled uniformly: a factor on transform.shift_px, rotate_deg and scale "
            "(0 turns augmentation off, 1 keeps the configured values; each is capped at its own field's limit)."
        ),
    )
    label_smoothing: Range = Field(
        default=Range(low=0.0, high=0.2),
        description="Cross-entropy label smoothing (train.label_smoothing), sampled uniformly.",
    )

    @model_validator(mode="after")
    def _check(self) -> SearchSpace:
        for name in ("learning_rate", "weight_decay"):
            if getattr(self, name).low <= 0:
                raise ValueError(f"{name}.low must be > 0: it is sampled log-uniformly")
        if self.learning_rate.high > 10:
            raise ValueError("learning_rate.high must be at most 10 (train.learning_rate's limit)")
        if self.weight_decay.high > 1:
            raise ValueError("weight_decay.high must be at most 1 (train.weight_decay's limit)")
        if self.augmentation.low < 0 or self.augmentation.high > 10:
            raise ValueError("augmentation must lie in 0..10 (a factor on the configured augmentation)")
        if self.label_smoothing.low < 0 or self.label_smoothing.high >= 1:
            raise ValueError("label_smoothing must lie in 0..1 (1 excluded)")
        bad = [size for size in self.global_batch_size if not 1 <= size <= 65536]
        if bad:
            raise ValueError(f"global_batch_size choices {bad} are outside 1..65536")
        return self


class TuneConfig(Section):
    """Hyperparameter search with Ray Tune: every trial is a Ray Train run of the training loop."""

    num_samples: int = Field(8, ge=1, le=10_000, description="Trials: configurations sampled from the search space.")
    epochs: int = Field(
        4, ge=1, le=1000, description="Each trial's epoch budget (the most a trial trains; ASHA stops weak ones sooner)."
    )
    scheduler: Literal["asha", "none"] = Field(
        "asha",
        description="asha: stop trials that fall behind at each rung (Async Successive Halving); none: every trial runs its epochs.",
    )
    grace_period: int = Field(1, ge=1, le=1000, description="ASHA: epochs every trial trains before it can be stopped.")
    reduction_factor: float = Field(
        2.0, ge=1.1, le=100, description="ASHA: at each rung only the best 1/reduction_factor of trials go on."
    )
    metric: Literal["val_ce", "val_loss", "val_accuracy"] = Field(
        "val_ce",
        description=(
            "Validation metric that ranks trials (ASHA's stops and the best trial). val_ce: cross-entropy without "
            "label smoothing, comparable across trials that sample different smoothing; val_loss: the training "
            "criterion (smoothing included); val_accuracy: coarse on a small validation split."
        ),
    )
    mode: Literal["min", "max"] | None = Field(
        None, description="min or max; unset: min for the losses, max for val_accuracy. A mode that contradicts the metric is refused."
    )
    max_concurrent_trials: int = Field(
        0,
        ge=0,
        le=1024,
        description=(
            "Trials running at once. 0: as many as the cluster holds, one whole CPU per training worker after "
            "train.data_cpus are set aside for Ray Data (1 on a 2-CPU machine). More than the cluster holds is refused."
        ),
    )
    seed: int | None = Field(0, ge=0, description="Seed of the search's sampling (same seed, same trial configs); unset: random.")
    max_failures: int = Field(
        0, ge=0, le=100, description="Times Tune restarts a failed trial (inside a trial, Ray Train restarts lost workers: train.max_failures)."
    )
    train_best: bool = Field(
        False,
        description="Then train the best config with train.epochs and evaluate it through the normal stages (gate included) in the same flow run.",
    )
    search_space: SearchSpace = Field(default=SearchSpace(), description="What each trial samples.")

    @property
    def direction(self) -> str:
        """``mode``, or the one the metric implies."""
        return self.mode or ("max" if self.metric == "val_accuracy" else "min")

    @model_validator(mode="after")
    def _check(self) -> TuneConfig:
        implied = "max" if self.metric == "val_accuracy" else "min"
        if self.mode is not None and self.mode != implied:
            raise ValueError(f"mode={self.mode} contradicts metric={self.metric} (better is {implied}); leave mode unset")
        if self.scheduler == "asha" and self.grace_period > self.epochs:
            raise ValueError(
                f"grace_period ({self.grace_period}) is larger than epochs ({self.epochs}): ASHA could never stop a trial; "
                "lower grace_period or raise epochs"
            )
        return self


class TunePipelineConfig(PipelineConfig):
    """Ray Tune over the pipeline's model and workload: the pipeline's stages with a tune stage (and optionally the best config trained)."""

    tune: TuneConfig = Field(default=TuneConfig(), description="Hyperparameter search.")

    @model_validator(mode="after")
    def _check_tune(self) -> TunePipelineConfig:
        small = [size for size in self.tune.search_space.global_batch_size if size < self.train.num_workers]
        if small:
            raise ValueError(
                f"tune.search_space.global_batch_size choices {small} are smaller than train.num_workers "
                f"({self.train.num_workers}): every worker needs at least one image per step"
            )
        if self.train.mode == "single":
            raise ValueError("tune runs every trial with Ray Train; use train.mode=distributed")
        return self
