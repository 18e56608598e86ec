"""What happens after training: evaluation and its gate, champion promotion, cleanup."""

from __future__ import annotations

from pydantic import Field, field_validator

from pipeline_config.common import MODEL_NAME_PATTERN, Section, registry_model_name

# The data kinds (`dataset.formats.parquet.ParquetDataset.source`) with a gate of their own, which evaluate.min_accuracy
# unset stands for. MNIST's IDX digits: the default recipe scored 98.6-99.1% on the bundled sample over seeds
# 0-4 (docs/performance.md); 97.5% sits 1.1 points (about 3 binomial standard deviations on 1,000 test images)
# below the worst, and a broken pipeline (every training label shuffled) still fails it (tests/test_flow_e2e.py).
# Other data has no number of its own: its gate comes from its champion or its own baseline (`tasks.gate`).
OWN_GATES = {"idx": 0.975}


class EvaluateConfig(Section):
    """Batch inference on the test split and the quality gate."""

    min_accuracy: float | None = Field(
        None,
        ge=0,
        le=1,
        description=(
            "Gate: the flow fails (keeping every artifact) below this test accuracy. Unset: the workload's own gate: "
            "97.5% on MNIST's digits; on other data its champion's accuracy on this run's test split less 3 standard "
            "errors, or, with no champion yet, the data's baseline (a nearest-centroid classifier on the training "
            "pixels, less 3 standard errors), and in both the model must beat the majority class's share by a one-sided "
            "test at 3 standard errors and get some images of every class right; a test split with fewer than 10 "
            "images in a class cannot pass it. The run's summary names the gate and where it came from."
        ),
    )
    num_actors: int = Field(1, ge=1, le=256, description="Model actors in the Ray Data inference pool. 1 on one machine without GPUs: no actor, the stage's own process scores.")
    batch_rows: int = Field(250, ge=1, le=65536, description="Images per inference batch.")
    tta: bool = Field(
        True,
        description=(
            "Test-time augmentation: predict from the softmax averaged over each test image and its four "
            "one-pixel shifts (5 forward passes per image); metrics.json also reports the accuracy without it. "
            "On by default: with the 12-epoch recipe it added 0.1-0.2 points on average over seeds (docs/performance.md)."
        ),
    )


class PromoteConfig(Section):
    """Champion promotion, the stage after evaluation: a model that passed the gate becomes the
    champion under <storage_root>/models/<model_name>/ only when it beats the current one on the same test set."""

    enabled: bool = Field(
        True,
        description="Compare every model that passed the gate with the champion and promote it when better; off: compare nothing.",
    )
    model_name: str | None = Field(
        None,
        description=(
            "Names the folder models/<model_name>/ (numbered versions, the champion pointer) and the run-comparison "
            "artifacts. Unset: <workload>-<model.name>, e.g. mnist-resnet18 (mnist-small-cnn for training.model.catalog:small_cnn)."
        ),
    )
    min_improvement: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Test accuracy (0..1) a candidate must gain over the champion to replace it: promoted only when "
            "accuracy > champion's + min_improvement. A tie is not promoted."
        ),
    )
    recent_runs: int = Field(20, ge=1, le=1000, description="Runs listed in the run-comparison table and picture.")
    skip_unchanged: bool = Field(
        False,
        description=(
            "End the run before training, as 'nothing new to train on', when its data, model and recipe are those of "
            "the champion's run (the nightly preset sets it; set it false to train anyway)."
        ),
    )

    @field_validator("model_name")
    @classmethod
    def _check_model_name(cls, value: str | None) -> str | None:
        if value is not None and not MODEL_NAME_PATTERN.fullmatch(value):
            raise ValueError(f"{value!r}: use lowercase letters, digits and '-', starting with a letter or digit (at most 63)")
        return value

    def registry_name(self, workload: str, model_name: str) -> str:
        """``model_name`` when set, else the name the workload and model give (`registry_model_name`)."""
        return self.model_name or registry_model_name(workload, model_name)


class CleanupConfig(Section):
    """Retention policy, applied after a successful evaluation; deletes only inside the storage root."""

    keep_checkpoints: int = Field(
        0,
        ge=0,
        le=1000,
        description="Keep the best N checkpoints of this run (the evaluated one always stays); 0 keeps all.",
    )
    delete_raw: bool = Field(
        False, description="Delete the downloaded IDX files of this run's data source (never a download.source=folder image folder)."
    )
    delete_parquet: bool = Field(False, description="Delete this run's Parquet dataset.")
    dry_run: bool = Field(False, description="Only list what the policy would delete.")
