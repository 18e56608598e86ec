"""A first run's gate means "learned something" (issue 66): the majority share is beaten by a one-sided test,
not matched; a class never predicted right fails it, named; a test split too small to tell is said before
training and passes only with evaluate.min_accuracy; a probe far below chance stops the run before training.

Real parts: real Parquet datasets in the conversion's layout (noise images, where nothing can be learned, and
the 8x8 digits of tests/test_gate.py), the real probe over them, real confusion matrices of the verdicts the
issue found (a model always answering the majority class, a model on random labels, two classes of three
images), and the conversion stage's real hook (`flows.stages.TO_PARQUET`) with a real stage recorder.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flows.stages import TO_PARQUET
from pipeline_config import EvaluateConfig, PipelineConfig
from runner.stages import StageRecorder
from storage_io import StorageLayout
from tasks.baseline import Baseline, centroid_probe
from tasks.gate import (
    MIN_CLASS_ROWS,
    LabelsDisagree,
    Z,
    beating,
    before_training,
    failures,
    gate_for,
    labels_disagree,
    lower_bound,
)
from tests.support.gate_data import TEST_ROWS, confusion_with, digit_dataset, digits_8x8, noise_dataset, parquet_dataset


def old_gate(dataset) -> float:
    """The first-run gate before issue 66: max(probe less 3 standard errors, majority share), passed at >=."""
    baseline = centroid_probe(dataset)
    return max(lower_bound(baseline.probe, baseline.rows), baseline.majority)


def test_beating_the_majority_share_is_a_one_sided_test_at_z_standard_errors():
    for baseline, n in ((0.5, 20), (0.51, 200), (0.97, 1000), (0.113, 540), (0.0, 50), (0.999, 100_000)):
        gate = beating(baseline, n)
        k = round(gate * n)
        assert k / n == gate
        se = math.sqrt(baseline * (1 - baseline) / n)
        assert (k / n - baseline) > Z * se  # the score test rejects "no better than the baseline" at k ...
        assert not ((k - 1) / n - baseline > Z * se)  # ... and not at one image fewer
        assert gate > baseline  # never a pass at equality
    assert beating(0.5, 2) is None and beating(1.0, 500) is None  # nothing on two images, nothing above 100%
    assert beating(0.5, 20) == 0.85  # two classes of 10: 17 of 20 right


def test_a_model_that_always_answers_the_majority_class_fails_naming_the_class_it_never_gets(tmp_path):
    """The issue's 97/3 folder: the always-majority model scored 96.50% against a 96.50% gate and was promoted."""
    dataset = noise_dataset(tmp_path / "imbalanced", train=[970, 30], test=[970, 30], classes=["common", "rare"])
    majority_only = np.array([[970, 0], [30, 0]])
    assert 0.97 >= old_gate(dataset)  # what passed before

    gate = gate_for(EvaluateConfig(), dataset, str(tmp_path / "root"), "imbalanced-resnet18")
    assert gate.min_accuracy == beating(0.97, 1000) and 0.98 < gate.min_accuracy < 0.99
    assert gate.origin.startswith("above the majority class's 97.00% by a one-sided test at 3 standard errors on 1000 test images")
    assert failures(gate, majority_only, dataset.classes) == [
        f"test accuracy 0.9700 is below the gate {gate.min_accuracy:.4f}",
        "class 'rare': recall 0 (none of its 30 test images predicted as 'rare')",
    ]


def test_a_model_of_random_labels_no_better_than_the_majority_fails(tmp_path):
    """The issue's random labels: 54% against a 51% gate, promoted. Now 54% of 200 is within noise of 51%."""
    dataset = noise_dataset(tmp_path / "random", train=[510, 490], test=[102, 98], classes=["a", "b"])
    assert 0.54 >= old_gate(dataset)
    gate = gate_for(EvaluateConfig(), dataset, str(tmp_path / "root"), "random-resnet18")
    assert gate.min_accuracy == beating(0.51, 200) > 0.6
    assert failures(gate, confusion_with([102, 98], 108), dataset.classes) == [
        f"test accuracy 0.5400 is below the gate {gate.min_accuracy:.4f}"]
    k = round(gate.min_accuracy * 200)  # the gate is a count of images: k passes, k - 1 does not
    assert failures(gate, confusion_with([102, 98], k), dataset.classes) == []
    assert failures(gate, confusion_with([102, 98], k - 1), dataset.classes) != []


def test_two_classes_of_three_images_are_too_few_to_tell_said_before_training_and_never_passed(tmp_path):
    """The issue's two classes of three images: 50% = 50%, promoted, no word about a 2-image test set."""
    dataset = noise_dataset(tmp_path / "tiny", train=[2, 2], test=[1, 1], classes=["a", "b"])
    half = np.array([[1, 0], [1, 0]])
    assert 0.5 >= old_gate(dataset)

    (warning,) = before_training(EvaluateConfig(), dataset)  # said after the conversion, before any training
    assert warning == (f"the test split is too small to tell: fewer than {MIN_CLASS_ROWS} test images in class(es) 'a' 1, "
                       "'b' 1: this run trains, but its gate fails unless evaluate.min_accuracy is set")
    gate = gate_for(EvaluateConfig(), dataset, str(tmp_path / "root"), "tiny-resnet18")
    assert gate.min_accuracy == 1.0 and gate.origin.startswith("no accuracy is above the majority class's 50.00%")
    assert "the test split is too small to tell" in failures(gate, half, dataset.classes)[-1]
    assert "the test split is too small to tell" in failures(gate, np.eye(2, dtype=int), dataset.classes)[0]  # even 100%

    chosen = EvaluateConfig(min_accuracy=0.5)  # the user's own gate: theirs to set, and passed
    assert before_training(chosen, dataset) == []
    assert failures(gate_for(chosen, dataset, str(tmp_path / "root"), "tiny-resnet18"), half, dataset.classes) == []


def test_a_class_never_predicted_right_fails_a_gate_its_accuracy_passes(tmp_path):
    dataset = digit_dataset(tmp_path / "digits")
    gate = gate_for(EvaluateConfig(), dataset, str(tmp_path / "root"), "digits-resnet18")
    counts = np.bincount(digits_8x8()[3], minlength=10)
    confusion = np.diag(counts)
    confusion[3, 3], confusion[3, 5] = 0, counts[3]  # every 3 taken for a 5
    assert np.trace(confusion) / TEST_ROWS > gate.min_accuracy  # ~90%: the accuracy alone passes
    assert failures(gate, confusion, dataset.classes) == [
        f"class '3': recall 0 (none of its {counts[3]} test images predicted as '3')"]
    assert failures(gate, np.diag(counts), dataset.classes) == []


def test_labels_that_disagree_between_splits_stop_the_run_before_training(tmp_path):
    """Test labels that name other classes than the training labels (each digit labelled as the next one): the
    probe scores far below chance, and the conversion stage's hook stops the run naming the likely cause."""
    train_x, train_y, test_x, test_y = digits_8x8()
    classes, shape = [str(d) for d in range(10)], (1, 8, 8)
    moved = parquet_dataset(tmp_path / "moved", {"train": (train_x, train_y), "test": (test_x, (test_y + 1) % 10)}, classes, shape)
    assert centroid_probe(moved).probe < 0.05

    config = PipelineConfig(storage_root=str(tmp_path / "storage"))
    recorder = StageRecorder(None, StorageLayout.create(config.storage_root, "moved"), config, {}, [TO_PARQUET])
    with pytest.raises(LabelsDisagree, match="far below chance") as stopped:
        TO_PARQUET.finished(recorder, {}, moved)
    assert "The labels likely mean different classes in the training and test files" in str(stopped.value)

    assert before_training(EvaluateConfig(), digit_dataset(tmp_path / "digits")) == []  # the same digits, labels agreeing
    shuffled = digit_dataset(tmp_path / "shuffled", shuffle_train_labels=True)  # nothing to learn: chance, not below it
    assert 0.03 < centroid_probe(shuffled).probe < 0.3 and before_training(EvaluateConfig(), shuffled) == []
    # A probe that learned nothing and answers mostly a rare class scores far below 1/classes, yet no lower than
    # answers unrelated to the labels would: no stop. The same score against answers that should score 10%: a stop.
    rare = Baseline(test_counts=[450, 50], probe=0.18, probe_classes=2, probe_answers=[50, 450])
    assert rare.unrelated == pytest.approx(0.18) and labels_disagree(rare) == ""
    assert "far below chance" in labels_disagree(rare.model_copy(update={"test_counts": [50, 450]}))
    flipped = parquet_dataset(tmp_path / "flipped", {"train": (train_x[:4], np.array([0, 0, 1, 1])),
                                                    "test": (train_x[:4], np.array([1, 1, 0, 0]))}, ["a", "b"], shape)
    assert centroid_probe(flipped).probe < 0.5  # flipped too, but 4 images cannot tell it from bad luck: it trains
    (warning,) = before_training(EvaluateConfig(), flipped)  # ... said to be too small to tell
    assert warning.startswith("the test split is too small to tell")


def test_the_closing_lines_and_the_failure_say_failed_for_a_gate_its_accuracy_alone_would_pass():
    """A gate failed on a class's recall: the closing lines say FAILED, and the failure names what failed and where
    the gate came from; with evaluate.min_accuracy unset it never says "below evaluate.min_accuracy"."""
    from runner import console
    from runner.summary import RunSummary
    from tasks.manifests import Evaluation
    from tasks.promote import gate_failed_message

    evaluation = Evaluation(
        checkpoint="ckpt", accuracy=0.9, precision=[1.0, 0.8], recall=[1.0, 0.0], confusion=[[90, 0], [10, 0]], rows=100,
        metrics_path="m.json", predictions_path="p", passed_gate=False, min_accuracy=0.8, gate="its champion m v1 (...)",
        gate_failures=["class 'b': recall 0 (none of its 10 test images predicted as 'b')"],
    )
    lines = console.summary_lines(RunSummary(run_name="r", evaluation=evaluation.model_dump()), None, 60, None, True)
    assert "  test accuracy  90.00% on 100 images (gate 80.00%: FAILED)" in lines
    from reporting.report_text import gate_verdict

    assert gate_verdict(0.9, 0.8, evaluation.gate_failures) == f"gate FAILED: {evaluation.gate_failures[0]}"
    assert gate_failed_message(evaluation) == ("class 'b': recall 0 (none of its 10 test images predicted as 'b'); the gate "
                                               "came from: its champion m v1 (...); every artifact is kept: metrics in m.json, "
                                               "checkpoint ckpt")
    older = evaluation.model_copy(update={"gate_failures": [], "accuracy": 0.7, "gate": "the data's own gate (idx data; "
                                          "evaluate.min_accuracy unset)"})  # a metrics.json from before the failures list
    assert gate_failed_message(older).startswith("test accuracy 0.7000 is below the gate 0.8000; the gate came from: the data's own")
