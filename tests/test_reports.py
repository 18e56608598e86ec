"""Report rendering and the failure summary, on tiny synthetic data: no Prefect server, no Ray cluster."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from dataset.formats.parquet import convert
from pipeline_config import ParquetConfig
from reporting import artifacts, pictures, report_text, samples, training_progress
from runner import hooks
from runner.summary import RunSummary
from tests.support.digits import write_raw

RED = (200, 80, 80)  # a title pixel counts as red when R > 200 and G, B < 80


def decode(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    image.load()
    assert image.format == "PNG"
    return image.convert("RGB")


def red_pixels(image: Image.Image) -> int:
    pixels = np.asarray(image).astype(int)
    return int(((pixels[..., 0] > RED[0]) & (pixels[..., 1] < RED[1]) & (pixels[..., 2] < RED[2])).sum())


def markdown_image(markdown: str) -> Image.Image:
    """The PNG embedded in a report's markdown as a data URI, decoded."""
    match = re.search(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert match, markdown[:200]
    return decode(base64.b64decode(match.group(1)))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    """A real Parquet dataset (train/val/test) converted from synthetic IDX files."""
    root = tmp_path_factory.mktemp("reports")
    raw = write_raw(root / "raw", n_train=120, n_test=40)
    out = root / "dataset"
    convert(Path(raw["directory"]), out, ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=10))
    return out


def test_keys_are_stable_and_valid_prefect_artifact_keys():
    assert len(set(artifacts.KEYS.values())) == len(artifacts.KEYS)
    assert all(re.fullmatch(r"[a-z0-9-]+", key) for key in artifacts.KEYS.values())


def test_digit_grid_marks_misclassified_titles_red():
    images = np.zeros((9, 784), dtype=np.uint8)
    images[:, 300:500] = 255
    plain = decode(pictures.digit_grid_png(images, [str(i) for i in range(9)]))
    marked = decode(pictures.digit_grid_png(images, [f"label: {i}; pred: 0" for i in range(9)], wrong=[i % 2 == 1 for i in range(9)]))
    assert plain.width > 300 and abs(plain.width - plain.height) < plain.width * 0.2  # a square-ish 3x3 grid
    assert red_pixels(plain) == 0 and red_pixels(marked) > 50
    assert np.asarray(plain).max() == 255  # the white strokes are drawn


def test_digit_grid_rejects_mismatched_titles_and_too_many_images():
    with pytest.raises(ValueError):
        pictures.digit_grid_png(np.zeros((3, 784), np.uint8), ["a", "b"])
    with pytest.raises(ValueError):
        pictures.digit_grid_png(np.zeros((10, 784), np.uint8), [str(i) for i in range(10)])


def test_training_curves_render_one_and_many_epochs():
    history = [
        {"epoch": e, "train_loss": 2 / (e + 1), "val_loss": 2.2 / (e + 1), "train_accuracy": 0.5 + e / 20, "val_accuracy": 0.4 + e / 20}
        for e in range(6)
    ]
    wide = decode(pictures.training_curves_png(list(reversed(history))))
    assert wide.width > 1.8 * wide.height  # loss and accuracy side by side
    assert decode(pictures.training_curves_png(history[:1])).width > 0
    with pytest.raises(ValueError):
        pictures.training_curves_png([{"train_loss": 1.0}])


def test_confusion_matrix_png_and_shape_check():
    confusion = (np.eye(10, dtype=int) * 90 + 1).tolist()
    assert decode(pictures.confusion_matrix_png(confusion)).width > 300
    with pytest.raises(ValueError):
        pictures.confusion_matrix_png([[1, 2, 3]])


def test_image_markdown_embeds_the_png_as_a_data_uri():
    png = pictures.digit_grid_png(np.full((1, 784), 128, np.uint8), ["x"])
    markdown = pictures.image_markdown("A title", png, "caption text")
    assert markdown.startswith("## A title\n")
    assert "caption text" in markdown
    assert base64.b64decode(markdown.split("base64,")[1].split(")")[0]) == png


def test_metrics_rows_per_class_and_overall():
    confusion = np.zeros((10, 10), dtype=int)
    np.fill_diagonal(confusion, 9)
    confusion[3, 5] = 1  # one 3 predicted as 5
    precision = [1.0] * 10
    precision[5] = 0.9
    recall = [1.0] * 10
    recall[3] = 0.9
    gate = report_text.gate_verdict(90 / 91, 0.995)
    rows = report_text.metrics_rows(confusion.tolist(), precision, recall, gate)
    assert len(rows) == 11
    assert rows[4] == {"class": "3", "support": 10, "correct": 9, "precision": 1.0, "recall": 0.9, "accuracy": None, "gate": None}
    assert rows[0]["class"] == "all" and rows[0]["support"] == 91 and rows[0]["accuracy"] == round(90 / 91, 4)
    assert rows[0]["gate"] == "gate FAILED: 98.90% < 99.50%"


def test_gate_verdict_says_passed_or_failed_with_both_numbers():
    assert report_text.gate_verdict(0.989, 0.985) == "gate passed: 98.90% >= 98.50%"
    assert report_text.gate_verdict(0.985, 0.985) == "gate passed: 98.50% >= 98.50%"
    assert report_text.gate_verdict(0.984, 0.985) == "gate FAILED: 98.40% < 98.50%"


def test_checkpoint_markdown_names_the_evaluated_checkpoint():
    kept = [
        {"path": "/s/runs/r/checkpoint_000000", "epoch": 0, "val_accuracy": 0.9},
        {"path": "/s/runs/r/checkpoint_000001", "epoch": 1, "val_accuracy": 0.95},
    ]
    markdown = report_text.checkpoint_markdown(kept[1]["path"], kept, "/s/runs/r", 0.9612, "gate FAILED: 96.12% < 98.50%")
    assert markdown.startswith("## Checkpoint used for evaluation (gate FAILED: 96.12% < 98.50%)\n")
    assert "`/s/runs/r/checkpoint_000001`" in markdown and "0.9612" in markdown
    assert "| `checkpoint_000001` (evaluated) | 2 | 0.9500 |" in markdown


def test_pick_predictions_shows_some_mistakes_and_is_stable():
    labels = np.arange(100) % 10
    preds = labels.copy()
    preds[[4, 17, 33, 58, 71]] = 0
    first = samples.pick_predictions(labels, preds)
    assert len(first) == 9 and (labels[first] != preds[first]).sum() == 3
    assert np.array_equal(first, samples.pick_predictions(labels, preds))
    assert len(samples.pick_predictions(labels, labels)) == 9  # no mistakes: nine correct ones


def test_read_split_rows_by_row_id_returns_the_right_images(dataset_dir):
    # synthetic_digits encodes the row index in the top-left pixel: row_id n has pixel n % 256
    wanted = [139, 121, 150]  # test rows, in a chosen order
    row_ids, images, labels = samples.read_split_rows(str(dataset_dir / "test"), row_ids=wanted)
    assert row_ids.tolist() == wanted
    assert images[:, 0].tolist() == [(rid - 120) % 256 for rid in wanted]
    assert labels.tolist() == [(rid - 120) % 10 for rid in wanted]
    with pytest.raises(KeyError):
        samples.read_split_rows(str(dataset_dir / "test"), row_ids=[5])  # a train row


def test_sample_digits_report_reads_nine_training_digits(dataset_dir):
    train_rows = pq.read_table(dataset_dir / "train").num_rows
    markdown = samples.sample_digits_markdown(str(dataset_dir / "train"), train_rows)
    assert markdown.startswith("## Sample training digits")
    assert markdown_image(markdown).width > 300


def test_predictions_report_joins_predictions_to_test_images(dataset_dir, tmp_path):
    test = pq.read_table(dataset_dir / "test")
    labels = test.column("label").to_numpy()
    preds = labels.copy()
    preds[:5] = (preds[:5] + 1) % 10
    path = tmp_path / "predictions.parquet"
    pq.write_table(pa.table({"row_id": test.column("row_id"), "label": labels, "pred": preds}), path)
    markdown = samples.predictions_markdown(str(path), str(dataset_dir / "test"))
    assert "5 of 40 test images are misclassified" in markdown
    assert red_pixels(markdown_image(markdown)) > 50  # the misclassified ones are marked


def test_progress_reaches_100_on_the_last_epoch():
    assert [training_progress.progress_percent(e, 4) for e in range(4)] == [25.0, 50.0, 75.0, 100.0]
    assert training_progress.progress_percent(7, 4) == 100.0
    line = training_progress.epoch_line({"epoch": 2, "train_loss": 0.5, "val_accuracy": 0.97}, 20)
    assert line == "epoch 3/20: train loss 0.5000, val accuracy 0.9700"


def test_a_failing_publisher_warns_and_returns_none(caplog):
    assert artifacts.publish_training_report(object()) is None  # no history: the report fails, quietly
    assert "publish_training_report not published" in caplog.text


# ------------------------------------------------------------------------- failure summary


SUMMARY = {
    "run_name": "nightly-7",
    "storage_root": "/data/mnist",
    "run_dir": "/data/mnist/runs/nightly-7",
    "stages": {
        "download": {"status": "completed", "seconds": 1.0},
        "to-parquet": {"status": "completed", "seconds": 2.0},
        "transform": {"status": "completed", "seconds": 3.0},
        "train": {"status": "failed", "seconds": 4.0, "error": "RuntimeError: Ray Train run failed: worker died."},
    },
}


def test_failure_summary_names_stage_cause_and_resume_command():
    report = hooks.failure_summary("witty-fox", "Flow run encountered an exception", RunSummary.model_validate(SUMMARY))
    text = report["text"]
    assert report["stage"] == "train" and report["run_name"] == "nightly-7"
    assert "failed in stage 'train': RuntimeError: Ray Train run failed: worker died." in text
    assert "Stages completed before it: download, to-parquet, transform." in text
    assert "--run-name nightly-7 --storage-root /data/mnist" in text
    assert "config.run_name = nightly-7" in text and "/data/mnist/runs/nightly-7" in text
    assert "\n" not in text  # one paragraph


def test_failure_summary_of_a_failed_gate_names_accuracy_gate_and_artifacts():
    summary = SUMMARY | {
        "stages": {**SUMMARY["stages"], "train": {"status": "completed"}, "evaluate": {"status": "completed"},
                   "promote": {"status": "failed", "error": "QualityGateError: below"}},
        "evaluation": {"accuracy": 0.984, "min_accuracy": 0.985, "rows": 1000},
    }
    text = hooks.failure_summary("witty-fox", None, RunSummary.model_validate(summary))["text"]
    assert "failed in stage 'promote': QualityGateError: below." in text
    assert "Test accuracy 98.40% on 1000 images, gate FAILED: 98.40% < 98.50%" in text
    assert all(key in text for key in ("mnist-confusion-matrix", "mnist-test-predictions", "mnist-test-metrics", "mnist-checkpoint"))
    assert "\n" not in text


def test_failure_summary_before_any_stage_uses_the_state_message():
    message = "Validation of flow parameters failed with error: ParameterTypeError:\n - config: train.global_batch_size (2) is smaller"
    report = hooks.failure_summary("witty-fox", message, None, {"config": {}})
    assert report["stage"] is None and "\n" not in report["text"]
    assert "failed before any stage started" in report["text"] and "ParameterTypeError: - config: train.global_batch_size" in report["text"]


class _Hook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.headers["Content-Type"], json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_post_webhook_sends_the_json_to_a_real_http_server():
    _Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        payload = hooks.failure_summary("witty-fox", None, RunSummary.model_validate(SUMMARY))
        assert hooks.post_webhook(f"http://127.0.0.1:{server.server_port}/hook", payload) == 204
    finally:
        server.shutdown()
        server.server_close()
    assert _Hook.received == [("application/json", payload)]
