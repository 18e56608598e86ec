"""A champion's gate is its accuracy on THIS run's test split (issue 66): a champion scored on other data is
scored again here before its number becomes the gate, and promotion reuses that score instead of scoring it twice.

Found: a champion that scores 0.00% on the new test split set a gate of 81.63% (its accuracy on the old data).
Real parts: a real model registry whose champion is a real small CNN (seeded weights) promoted on another
dataset, this run's 8x8 digits in the Parquet layout, the evaluation's real scoring (`training.inference`)
on a real local Ray, and the champion's accuracy checked against the same weights run by torch directly.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from dataset.formats.parquet import image_record
from dataset.tensors.spec import TransformSpec
from pipeline_config import EvaluateConfig, TransformConfig
from storage_io import StorageLayout, atomic_write_bytes, join
from tasks.baseline import class_counts
from tasks.gate import beating, champion_scorer, gate_for, lower_bound
from tasks.manifests import Evaluation
from tasks.promote import known_scores
from tests.support.gate_data import TEST_ROWS, digit_dataset, digits_8x8, noise_dataset
from tests.support.registry import make_dataset
from training.champion import registry, registry_files
from training.checkpoint.files import MODEL_FILE
from training.model.catalog import ModelSpec

MODEL = "digits-small-cnn"


SMALL = ModelSpec(name="training.model.catalog:small_cnn", in_channels=1, num_classes=10)


def small_champion(layout: StorageLayout, dataset_dir: str, classes: list[str]) -> registry.Candidate:
    """A promotion candidate recorded at 90% on ``dataset_dir``: a real small CNN (seeded weights) for 8x8 digits."""
    import torch

    torch.manual_seed(0)
    checkpoint = join(layout.runs_dir, "old-data", "checkpoint_000000")
    buffer = io.BytesIO()
    torch.save(SMALL.build().state_dict(), buffer)
    atomic_write_bytes(join(checkpoint, MODEL_FILE), buffer.getvalue())
    return registry.Candidate(
        run_name="old-data", checkpoint=checkpoint, accuracy=0.9, passed_gate=True, data_hash=registry_files.data_hash(dataset_dir),
        dataset_dir=dataset_dir, model=SMALL.model_dump(), data_spec={"image": image_record((1, 8, 8)), "classes": classes},
    )


def accuracy_by_torch(folder: str, mean: float, std: float) -> float:
    """The champion's plain accuracy on the digits' test split, its weights run by torch here (no project scoring)."""
    import torch

    model = SMALL.build()
    model.load_state_dict(torch.load(f"{folder}/{MODEL_FILE}", map_location="cpu", weights_only=True))
    _, _, test_x, test_y = digits_8x8()
    images = torch.from_numpy((test_x.astype(np.float32) / 255 - mean) / std).reshape(-1, 1, 8, 8)
    with torch.inference_mode():
        predicted = model.eval()(images).argmax(1).numpy()
    return float((predicted == test_y).mean())


def test_a_champion_from_other_data_is_scored_on_this_test_split_before_it_sets_the_gate(tmp_path, local_ray):
    root = str(tmp_path / "root")
    layout = StorageLayout.create(root, "setup")
    dataset = digit_dataset(tmp_path / "digits")
    old = small_champion(layout, make_dataset(layout, "old"), list(dataset.classes))  # 90% on the data it was trained on
    assert registry.promote(layout, MODEL, old).promoted
    assert registry_files.read_champion(root, MODEL)["data_hash"] != registry_files.data_hash(dataset.directory)

    cfg = EvaluateConfig(tta=False)
    spec = TransformSpec(dataset=dataset, config=TransformConfig(mean=0.5, std=0.5), checks={}, manifest=dataset.directory)
    gate = gate_for(cfg, dataset, root, MODEL, champion_scorer(spec, cfg, None))

    folder = registry_files.version_dir(root, MODEL, 1)
    on_this_data = accuracy_by_torch(folder, 0.5, 0.5)
    assert on_this_data < 0.5  # untrained weights: nothing like its recorded 90%
    assert gate.champion.model_dump() == {"version": 1, "accuracy": pytest.approx(on_this_data), "rescored": True}
    majority = class_counts(dataset).majority
    assert gate.min_accuracy == pytest.approx(max(lower_bound(on_this_data, TEST_ROWS), beating(majority, TEST_ROWS)))
    assert gate.min_accuracy < lower_bound(0.9, TEST_ROWS) - 0.3  # not the recorded 90%'s gate
    assert f"its champion {MODEL} v1 ({on_this_data:.2%}, scored again on this run's test split: the data changed)" in gate.origin

    # Promotion compares with the same champion on the same test split: the gate's score, not a second scoring.
    evaluation = Evaluation(checkpoint="c", accuracy=0.95, precision=[], recall=[], confusion=[], rows=TEST_ROWS,
                            metrics_path="m", predictions_path="p", passed_gate=True, champion=gate.champion)

    def never(folder: str) -> float:
        raise AssertionError(f"{folder} scored a second time")

    assert known_scores(evaluation, root, MODEL, never)(folder) == gate.champion.accuracy
    with pytest.raises(AssertionError, match="scored a second time"):  # another version (a champion promoted since)
        known_scores(evaluation, root, MODEL, never)(registry_files.version_dir(root, MODEL, 2))


def majority_only_checkpoint(folder, spec) -> str:
    """A real small CNN whose last layer answers class 0 whatever the image: zero weights, bias for class 0."""
    import torch

    from training.checkpoint.model_files import save_checkpoint_files

    model = spec.build()
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(torch.tensor([1.0] + [0.0] * (spec.num_classes - 1)))
    folder.mkdir(parents=True)
    save_checkpoint_files(folder, model, torch.optim.SGD(model.parameters(), lr=0.1), {"epoch": 0, "model": spec.model_dump()})
    return str(folder)


def test_a_model_that_always_answers_the_majority_class_is_not_promoted_and_the_failure_says_why(tmp_path, local_ray, shared_server):
    """The issue's 97/3 case through the evaluation and promotion stages (their ``.fn``): a real model that always
    answers the majority class scores 97% and fails its gate, naming the minority class it never gets and where
    the gate's number came from, never "below evaluate.min_accuracy" (unset)."""
    from pipeline_config import PromoteConfig
    from tasks.evaluate import evaluate
    from tasks.promote import QualityGateError, promote
    from tests.support.prefect_server import using_api
    from training.manifests import CheckpointInfo, TrainedModel

    layout = StorageLayout.create(str(tmp_path / "root"), "imbalanced")
    dataset = noise_dataset(tmp_path / "imbalanced", train=[970, 30], test=[970, 30], classes=["common", "rare"])
    model = ModelSpec(name="training.model.catalog:small_cnn", in_channels=1, num_classes=2)
    checkpoint = majority_only_checkpoint(tmp_path / "root" / "runs" / "imbalanced" / "checkpoint_000000", model)
    trained = TrainedModel(run_dir=layout.run_dir, model=model, best_checkpoint=checkpoint, best_val_accuracy=0.97,
                           checkpoints=[CheckpointInfo(path=checkpoint, epoch=0, val_accuracy=0.97)], history=[],
                           num_workers=1, cpus_per_worker=1.0)
    spec = TransformSpec(dataset=dataset, config=TransformConfig(mean=0.5, std=0.5), checks={}, manifest=dataset.directory)
    cfg = EvaluateConfig(tta=False)

    with using_api(shared_server.api):  # the stages publish their reports there
        result = evaluate.fn(trained, spec, cfg, layout, "imbalanced", "imbalanced-small-cnn")
    assert result.accuracy == 0.97 and result.recall == [1.0, 0.0]
    assert not result.passed_gate and result.min_accuracy == beating(0.97, 1000)
    assert result.gate_failures == [f"test accuracy 0.9700 is below the gate {result.min_accuracy:.4f}",
                                    "class 'rare': recall 0 (none of its 30 test images predicted as 'rare')"]
    with using_api(shared_server.api), pytest.raises(QualityGateError) as failed:
        promote.fn(result, trained, spec, PromoteConfig(), cfg, layout, workload="imbalanced")
    message = str(failed.value)
    assert "class 'rare': recall 0" in message and f"the gate came from: {result.gate}" in message
    assert "evaluate.min_accuracy" not in message.split("; every artifact")[0]
    assert registry_files.read_champion(layout.root, "imbalanced-small-cnn") is None  # never promoted


def test_a_damaged_champion_from_other_data_is_not_scored_and_the_datas_baseline_holds(tmp_path):
    """Its weights fail their checksum: scoring them would fail the evaluation; the baseline holds instead, and
    promotion names the damage (`training.champion.registry`)."""
    root = str(tmp_path / "root")
    layout = StorageLayout.create(root, "setup")
    dataset = digit_dataset(tmp_path / "digits")
    assert registry.promote(layout, MODEL, small_champion(layout, make_dataset(layout, "old"), list(dataset.classes))).promoted
    weights = tmp_path / "root" / "models" / MODEL / "v1" / MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:-8] + b"damaged!")

    def never(folder: str) -> float:
        raise AssertionError(f"{folder} was scored")

    gate = gate_for(EvaluateConfig(), dataset, root, MODEL, never)
    assert gate.champion is None and gate.origin.startswith("the data's baseline: a nearest-centroid probe scored")
