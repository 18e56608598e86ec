"""Run reports as Prefect artifacts: pictures, tables and links built from stage outputs.

Two layers. Rendering is pure: arrays, manifests and files on storage in; PNG bytes, markdown
or table rows out; no Prefect, no Ray, testable on tiny arrays. Publishing is thin: one Prefect
artifact per report under a stable key (``artifact_keys(workload)``), so every key versions across runs in the
UI's Artifacts page, and a report that fails logs a warning instead of failing the run.

Why pictures are inline ``data:image/png;base64`` URIs inside markdown artifacts: the Prefect
server stores artifacts but serves no files, and the UI that Prefect (3.8.8, 3.9.1) opens by default
(V2, React) renders markdown with react-markdown + rehype-sanitize and a URL transform that
explicitly keeps ``data:image/`` sources on ``<img>`` (the browser test checks the pictures load
with a non-zero natural width). So a report needs no file server, works offline and lives in
the Prefect database as long as the artifact does.
"""

from __future__ import annotations

import base64
import functools
import io
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from ray.train import UserCallback

from dataset.parquet import images_from_column
from pipeline_config.model import DEFAULT_WORKLOAD
from reporting.environment import environment_rows
from reporting.logs import stage_logger
from storage_io import filesystem, list_files

# Artifact keys: lowercase letters, digits and dashes (Prefect's rule); stable across runs, each
# starting with the workload's name (pipeline_config's `workload`, e.g. mnist-test-metrics).
_KEY_SUFFIXES = {
    "samples": "sample-digits",
    "progress": "training-progress",
    "curves": "training-curves",
    "confusion": "confusion-matrix",
    "predictions": "test-predictions",
    "metrics": "test-metrics",
    "checkpoint": "checkpoint",
    "environment": "run-environment",
}
# What the tune flow's search adds (its train_best stages publish the keys above too).
_TUNE_KEY_SUFFIXES = {"trials": "tune-trials", "trial_curves": "tune-curves"}


def artifact_keys(workload: str = DEFAULT_WORKLOAD) -> dict[str, str]:
    """The pipeline's artifact keys for ``workload`` (``mnist-test-metrics``, ...)."""
    return {name: f"{workload}-{suffix}" for name, suffix in _KEY_SUFFIXES.items()}


def tune_keys(workload: str = DEFAULT_WORKLOAD) -> dict[str, str]:
    """The search's artifact keys for ``workload`` (``mnist-tune-trials``, ...)."""
    return {name: f"{workload}-{suffix}" for name, suffix in _TUNE_KEY_SUFFIXES.items()}


KEYS = artifact_keys()  # the default workload's (MNIST's) keys
TUNE_KEYS = tune_keys()
GRID = 3  # the seeds' 3x3 pictures
MNIST_SHAPE = (1, 28, 28)  # (channels, height, width) when a caller names none: the seeds' digits
_T = TypeVar("_T")


# --------------------------------------------------------------------------- pure rendering


def _figure(width: float, height: float):
    # The object-oriented Figure renders through Agg without pyplot, so no global backend
    # switch and no GUI state (a report may be built inside a worker or a served flow run).
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def png_bytes(fig) -> bytes:
    """Encode a matplotlib figure as PNG bytes.

    Args:
        fig: A ``matplotlib.figure.Figure``.

    Returns:
        The PNG file content.
    """
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def digit_grid_png(
    images: np.ndarray, titles: Sequence[str], wrong: Sequence[bool] | None = None, shape: tuple[int, int, int] = MNIST_SHAPE
) -> bytes:
    """A grid of images with a title above each (the seeds' 3x3 layout), gray or RGB, any size.

    Args:
        images: ``(N, H*W*C)`` uint8 pixels as stored (height x width x channels), at most ``GRID * GRID`` of them.
        titles: One title per image, e.g. ``"7"`` or ``"label: 7; pred: 1"``.
        wrong: Optional flags; a flagged image gets a red title (a misclassified image).
        shape: The images' (channels, height, width): the dataset's.

    Returns:
        PNG bytes.
    """
    channels, height, width = shape
    images = np.asarray(images, dtype=np.uint8).reshape(-1, height, width, channels)
    if channels == 1:
        images = images[..., 0]
    if len(images) != len(titles) or not 0 < len(images) <= GRID * GRID:
        raise ValueError(f"need 1..{GRID * GRID} images with one title each, got {len(images)} and {len(titles)}")
    wrong = list(wrong) if wrong is not None else [False] * len(images)
    fig = _figure(6, 6.4)
    for i, (image, title, bad) in enumerate(zip(images, titles, wrong)):
        ax = fig.add_subplot(GRID, GRID, i + 1)
        ax.imshow(image, cmap="gray" if channels == 1 else None, vmin=0, vmax=255)
        ax.set_title(title, color="tab:red" if bad else "black", fontsize=11)
        ax.axis("off")
    fig.tight_layout()
    return png_bytes(fig)


def training_curves_png(history: Sequence[dict[str, float]]) -> bytes:
    """Loss and accuracy per epoch, training and validation, side by side.

    Args:
        history: One dict per reported epoch with ``epoch`` (0-based) and any of
            ``train_loss``, ``val_loss``, ``train_accuracy``, ``val_accuracy``.

    Returns:
        PNG bytes.
    """
    rows = sorted((row for row in history if "epoch" in row), key=lambda row: row["epoch"])
    if not rows:
        raise ValueError("no epochs in the training history")
    epochs = [int(row["epoch"]) + 1 for row in rows]
    fig = _figure(10, 3.8)
    for index, (metric, label) in enumerate((("loss", "Loss"), ("accuracy", "Accuracy"))):
        ax = fig.add_subplot(1, 2, index + 1)
        for split, style in (("train", "o-"), ("val", "s--")):
            values = [row.get(f"{split}_{metric}") for row in rows]
            if any(v is not None for v in values):
                ax.plot(epochs, [np.nan if v is None else v for v in values], style, label=split)
        ax.set_xlabel("epoch")
        ax.set_title(label)
        ax.set_xticks(epochs if len(epochs) <= 20 else ax.get_xticks())
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return png_bytes(fig)


def trial_curves_png(trials: Sequence[dict[str, Any]], metric: str, best_id: str | None = None) -> bytes:
    """``metric`` per epoch for every trial of a search: one line each, early-stopped ones dashed and
    ended with an x, the best one thick.

    Args:
        trials: One dict per trial with ``trial_id``, ``status`` and ``history`` (rows with ``epoch``
            0-based and ``metric``).
        metric: The history key to draw (``val_ce``, ``val_loss`` or ``val_accuracy``).
        best_id: The best trial's id, drawn thick and named in the legend.

    Returns:
        PNG bytes.
    """
    drawn = [trial for trial in trials if any(metric in row for row in trial.get("history") or [])]
    if not drawn:
        raise ValueError(f"no trial reported {metric}")
    fig = _figure(8, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for trial in drawn:
        rows = sorted((row for row in trial["history"] if metric in row), key=lambda row: row["epoch"])
        epochs = [int(row["epoch"]) + 1 for row in rows]
        values = [row[metric] for row in rows]
        stopped = trial.get("status") == "stopped early"
        best = trial["trial_id"] == best_id
        label = f"{trial['trial_id']}{' (best)' if best else ''}{' stopped early' if stopped else ''}"
        (line,) = ax.plot(epochs, values, "--" if stopped else "-", marker="o", linewidth=3 if best else 1.3, label=label)
        if stopped:
            ax.plot(epochs[-1:], values[-1:], "x", color=line.get_color(), markersize=12, markeredgewidth=2.5)
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per epoch, {len(drawn)} trial(s)")
    last = max(int(row["epoch"]) + 1 for trial in drawn for row in trial["history"])
    ax.set_xticks(range(1, last + 1) if last <= 20 else ax.get_xticks())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return png_bytes(fig)


def trial_rows(trials: Sequence[dict[str, Any]], metric: str, best_id: str | None = None) -> list[dict[str, Any]]:
    """The trial table, one row per trial in the given order: id, sampled config, best metric, epochs run, how it ended."""
    rows = []
    for trial in trials:
        config = trial.get("config") or {}
        value = trial.get("best_metric")
        rows.append(
            {
                "trial": trial["trial_id"] + (" (best)" if trial["trial_id"] == best_id else ""),
                "learning_rate": f"{config.get('learning_rate', float('nan')):.3g}",
                "weight_decay": f"{config.get('weight_decay', float('nan')):.3g}",
                "global_batch_size": config.get("global_batch_size"),
                "augmentation": f"{config.get('augmentation', float('nan')):.2f}",
                "label_smoothing": f"{config.get('label_smoothing', float('nan')):.3f}",
                f"best {metric}": "-" if value is None else f"{value:.4f}",
                "epochs run": trial.get("epochs_run"),
                "stopped early": "yes" if trial.get("status") == "stopped early" else "no",
                "status": trial.get("status"),
            }
        )
    return rows


def confusion_matrix_png(confusion: Sequence[Sequence[int]], classes: Sequence[str] | None = None) -> bytes:
    """The confusion matrix (rows: true class, columns: predicted) with a count in every cell.

    Args:
        confusion: A square matrix of counts, ``confusion[true][pred]``.
        classes: The class names, for the axes (unset: the class numbers).

    Returns:
        PNG bytes.
    """
    matrix = np.asarray(confusion, dtype=np.int64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.size == 0:
        raise ValueError(f"confusion matrix must be square, got shape {matrix.shape}")
    n = matrix.shape[0]
    fig = _figure(6.4, 5.6)
    ax = fig.add_subplot(1, 1, 1)
    shown = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(shown, ax=ax, fraction=0.046)
    threshold = matrix.max() / 2 if matrix.max() else 1
    for true in range(n):
        for pred in range(n):
            count = matrix[true, pred]
            color = "white" if count > threshold else "black"
            ax.text(pred, true, str(count), ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    if classes is not None and len(classes) == n:
        ax.set_xticklabels(list(classes), rotation=45 if max(map(len, classes)) > 2 else 0, ha="right" if max(map(len, classes)) > 2 else "center")
        ax.set_yticklabels(list(classes))
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"Confusion matrix ({int(matrix.sum())} test images)")
    fig.tight_layout()
    return png_bytes(fig)


def comparison_keys(model: str) -> dict[str, str]:
    """Artifact keys of a model's run comparison (table and picture), stable across its runs."""
    return {"table": f"{model}-run-comparison", "picture": f"{model}-accuracy-over-runs"}


def comparison_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recent runs of one model, newest first, as rows of the run-comparison table.

    Args:
        runs: Run rows as the evaluation stage records them (``training.registry.record_run``),
            each possibly marked ``champion`` (the current one).

    Returns:
        Rows with date, run, data hash, test accuracy, validation loss, epochs, train images/s,
        wall time and whether the run was promoted (its version, and ``champion`` for the current one).
    """

    def rounded(value: Any, digits: int) -> Any:
        return round(value, digits) if isinstance(value, (int, float)) else None

    table = []
    for run in reversed(runs):
        promoted = "no: gate failed" if not run.get("passed_gate") else "no"
        if run.get("version") and run.get("promoted"):
            promoted = f"v{run['version']}" + (" (champion)" if run.get("champion") else "")
        table.append({  # what decides first (the UI cuts a wide table at the right)
            "date": str(run.get("finished_at", ""))[:19].replace("T", " "),
            "run": run.get("run"),
            "test_accuracy": rounded(run.get("test_accuracy"), 4),
            "promoted": promoted,
            "val_loss": rounded(run.get("val_loss"), 4),
            "epochs": run.get("epochs"),
            "train_images_per_s": rounded(run.get("train_images_per_s"), 1),
            "wall_s": rounded(run.get("wall_s"), 1),
            "data": str(run.get("data_hash") or "")[:12],
        })
    return table


def accuracy_over_runs_png(runs: Sequence[dict[str, Any]]) -> bytes:
    """Test accuracy of each run in finish order: promoted runs as stars, the current champion ringed,
    gate failures as red crosses.

    Args:
        runs: Run rows oldest first (``training.registry.recent_runs``).

    Returns:
        PNG bytes.
    """
    points = [(i + 1, run) for i, run in enumerate(runs) if isinstance(run.get("test_accuracy"), (int, float))]
    if not points:
        raise ValueError("no run has a test accuracy")
    fig = _figure(8, 4)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([x for x, _ in points], [run["test_accuracy"] for _, run in points], "-", color="lightgray", zorder=1)
    groups = (
        ("not promoted", "o", "tab:blue", lambda r: r.get("passed_gate") and not r.get("promoted")),
        ("promoted", "*", "tab:orange", lambda r: r.get("promoted")),
        ("gate failed", "x", "tab:red", lambda r: not r.get("passed_gate")),
    )
    for label, marker, color, chosen in groups:
        picked = [(x, run["test_accuracy"]) for x, run in points if chosen(run)]
        if picked:
            ax.scatter(*zip(*picked), marker=marker, s=140 if marker == "*" else 50, color=color, label=label, zorder=2)
    for x, run in points:
        if run.get("champion"):
            ax.scatter([x], [run["test_accuracy"]], s=420, facecolors="none", edgecolors="black", label="champion", zorder=3)
            ax.annotate(f"v{run.get('version')}", (x, run["test_accuracy"]), textcoords="offset points", xytext=(0, 12), ha="center")
    low, high = ax.get_ylim()
    ax.set_ylim(low, min(high, 1.005))  # no accuracy above 100%
    ax.set_xlabel("run (oldest first)")
    ax.set_ylabel("test accuracy")
    ax.set_xticks([x for x, _ in points])
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return png_bytes(fig)


def data_uri(png: bytes) -> str:
    """A ``data:image/png;base64`` URI the Prefect UI's markdown keeps on ``<img>``."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_markdown(title: str, png: bytes, caption: str = "") -> str:
    """Markdown with a heading, the inline picture and an optional caption below it.

    Args:
        title: Heading text; also the image's alt text.
        png: PNG bytes to embed.
        caption: Markdown shown under the picture.

    Returns:
        The markdown document.
    """
    parts = [f"## {title}", f"![{title}]({data_uri(png)})"]
    if caption:
        parts.append(caption)
    return "\n\n".join(parts) + "\n"


def gate_verdict(accuracy: float, min_accuracy: float) -> str:
    """``gate passed: 98.90% >= 98.50%`` or ``gate FAILED: 98.40% < 98.50%``."""
    if accuracy >= min_accuracy:
        return f"gate passed: {accuracy:.2%} >= {min_accuracy:.2%}"
    return f"gate FAILED: {accuracy:.2%} < {min_accuracy:.2%}"


def metrics_rows(
    confusion: Sequence[Sequence[int]], precision: Sequence[float], recall: Sequence[float], gate: str | None = None,
    classes: Sequence[str] | None = None,
) -> list[dict]:
    """An ``all`` row, then one row per class (support, correct, precision, recall), named by ``classes`` (unset: numbers).

    Args:
        confusion: ``confusion[true][pred]`` counts.
        precision: Per-class precision.
        recall: Per-class recall.
        gate: The gate's verdict (``gate_verdict``), shown in the ``all`` row's ``gate`` column.

    Returns:
        Rows for a Prefect table artifact; the ``all`` row has macro-averaged precision and
        recall, the overall ``accuracy`` and the ``gate`` verdict (empty on the per-class rows).
    """
    matrix = np.asarray(confusion, dtype=np.int64)
    support, correct = matrix.sum(1), np.diag(matrix)
    per_class = [
        {
            "class": str(classes[digit]) if classes is not None and len(classes) == len(matrix) else str(digit),
            "support": int(support[digit]),
            "correct": int(correct[digit]),
            "precision": round(float(precision[digit]), 4),
            "recall": round(float(recall[digit]), 4),
            "accuracy": None,
            "gate": None,
        }
        for digit in range(len(matrix))
    ]
    total = int(matrix.sum())
    overall = {
        "class": "all",
        "support": total,
        "correct": int(correct.sum()),
        "precision": round(float(np.mean(precision)), 4),
        "recall": round(float(np.mean(recall)), 4),
        "accuracy": round(float(correct.sum() / max(total, 1)), 4),
        "gate": gate,
    }
    return [overall, *per_class]  # overall first: the UI pages tables ten rows at a time


def checkpoint_markdown(
    checkpoint: str, checkpoints: Sequence[dict], run_dir: str, accuracy: float | None, gate: str | None = None
) -> str:
    """Where the evaluated checkpoint lives, what it scored, and how to load it.

    Args:
        checkpoint: Path of the checkpoint evaluation used.
        checkpoints: Kept checkpoints as dicts with ``path``, ``epoch`` and ``val_accuracy``.
        run_dir: The run folder.
        accuracy: Test accuracy of ``checkpoint`` (None when unknown).
        gate: The gate's verdict (``gate_verdict``), added to the title.

    Returns:
        The markdown document.
    """
    lines = [
        "## Checkpoint used for evaluation" + (f" ({gate})" if gate else ""),
        "",
        f"`{checkpoint}`",
        "",
    ]
    if accuracy is not None:
        lines += [f"Test accuracy: **{accuracy:.4f}**", ""]
    lines += ["| kept checkpoint | epoch | val accuracy |", "| --- | --- | --- |"]
    for info in sorted(checkpoints, key=lambda c: c["epoch"]):
        marker = " (evaluated)" if info["path"] == checkpoint else ""
        lines.append(f"| `{Path(info['path']).name}`{marker} | {int(info['epoch']) + 1} | {info['val_accuracy']:.4f} |")
    lines += [
        "",
        f"Run folder: `{run_dir}`. Load it with `training.model.load_model(\"{checkpoint}\")`.",
    ]
    return "\n".join(lines) + "\n"


def pick_rows(n_rows: int, count: int = GRID * GRID, seed: int = 0) -> np.ndarray:
    """``count`` distinct row positions out of ``n_rows`` in random order, the same ones every run.

    Random order, not sorted: the bundled sample's files are sorted by class, so sorted
    positions would draw the digits in ascending order.
    """
    if n_rows <= 0:
        raise ValueError("no rows to pick from")
    rng = np.random.default_rng(seed)
    return rng.choice(n_rows, size=min(count, n_rows), replace=False)


def pick_predictions(labels: np.ndarray, preds: np.ndarray, count: int = GRID * GRID, seed: int = 0) -> np.ndarray:
    """Positions of test predictions to show: up to a third misclassified, the rest correct.

    A purely random pick of a 99%-accurate model shows nine correct digits; showing a few
    mistakes next to correct ones is what tells a person something.

    Args:
        labels: True labels.
        preds: Predicted labels.
        count: How many to pick.
        seed: Fixes the pick so the same rows appear in every run.

    Returns:
        Positions into ``labels``, mistakes and correct ones shuffled together.
    """
    rng = np.random.default_rng(seed)
    wrong = np.flatnonzero(labels != preds)
    right = np.flatnonzero(labels == preds)
    take_wrong = min(len(wrong), count // 3)
    chosen = list(rng.choice(wrong, size=take_wrong, replace=False)) if take_wrong else []
    take_right = min(len(right), count - take_wrong)
    chosen += list(rng.choice(right, size=take_right, replace=False)) if take_right else []
    return rng.permutation(np.asarray(chosen, dtype=np.int64))


# --------------------------------------------------------------------------- reading storage


def read_split_rows(split_dir: str, positions: np.ndarray | None = None, row_ids: Sequence[int] | None = None):
    """Read rows of a Parquet split (schema of ``dataset.parquet``) by position or by ``row_id``.

    Args:
        split_dir: A split folder such as ``<dataset>/train``.
        positions: Row positions within the split, in file order.
        row_ids: ``row_id`` values to fetch instead (order of the result follows ``row_ids``).

    Returns:
        ``(row_ids, images (N, H*W*C) uint8, labels)`` as numpy arrays.
    """
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    fs, where = filesystem(split_dir)  # a local folder or an S3 prefix
    files = [f"{where}/{name}" for name in list_files(split_dir, ".parquet") if "/" not in name]
    dataset = ds.dataset(files, format="parquet", filesystem=fs)
    if row_ids is not None:
        table = dataset.to_table(filter=pc.field("row_id").isin(list(map(int, row_ids))))
        order = {rid: i for i, rid in enumerate(table.column("row_id").to_pylist())}
        missing = [rid for rid in row_ids if rid not in order]
        if missing:
            raise KeyError(f"row_id(s) {missing} not in {split_dir}")
        table = table.take([order[int(rid)] for rid in row_ids])
    else:
        table = dataset.take(positions)
    return (
        table.column("row_id").to_numpy(),
        images_from_column(table.column("image")),
        table.column("label").to_numpy(),
    )


def _name(classes: Sequence[str] | None, label: int) -> str:
    return str(classes[label]) if classes is not None and 0 <= label < len(classes) else str(label)


def sample_digits_markdown(
    train_dir: str, train_rows: int, shape: tuple[int, int, int] = MNIST_SHAPE, classes: Sequence[str] | None = None
) -> str:
    """The sample-digits report: nine training images with their labels (the seeds' first picture)."""
    _, images, labels = read_split_rows(train_dir, positions=pick_rows(train_rows))
    png = digit_grid_png(images, [_name(classes, int(label)) for label in labels], shape=shape)
    caption = f"Nine training digits with their labels, the same rows every run, read back from `{train_dir}`."
    return image_markdown("Sample training digits", png, caption)


def predictions_markdown(
    predictions_path: str, test_dir: str, gate: str | None = None,
    shape: tuple[int, int, int] = MNIST_SHAPE, classes: Sequence[str] | None = None,
) -> str:
    """The test-predictions report: images with true and predicted labels (the seeds' last picture)."""
    import pyarrow.parquet as pq

    fs, where = filesystem(predictions_path)
    table = pq.read_table(where, columns=["row_id", "label", "pred"], filesystem=fs)
    row_ids, labels, preds = (table.column(name).to_numpy() for name in ("row_id", "label", "pred"))
    chosen = pick_predictions(labels, preds)
    _, images, _ = read_split_rows(test_dir, row_ids=row_ids[chosen].tolist())
    wrong = labels[chosen] != preds[chosen]
    titles = [f"label: {_name(classes, int(t))}; pred: {_name(classes, int(p))}" for t, p in zip(labels[chosen], preds[chosen])]
    png = digit_grid_png(images, titles, wrong=wrong, shape=shape)
    errors = int((labels != preds).sum())
    caption = (
        f"{len(chosen)} test digits with true and predicted labels (red: misclassified). "
        f"{errors} of {len(labels)} test images are misclassified in total."
    )
    return image_markdown("Test predictions" + (f" ({gate})" if gate else ""), png, caption)


# --------------------------------------------------------------------------- publishing


def _best_effort(fn: Callable[..., _T]) -> Callable[..., _T | None]:
    """Run a publisher; on any error log a warning and return None (a report never fails a run)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T | None:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            stage_logger(__name__).warning("Report %s not published: %s: %s", fn.__name__, type(exc).__name__, exc)
            return None

    return wrapper


@_best_effort
def publish_environment_report(env: dict[str, Any], workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish what the run runs on (``reporting.environment.describe()``) as a table; returns the artifact ids."""
    from prefect.artifacts import create_table_artifact

    description = f"Python {env.get('python')}, torch {env.get('packages', {}).get('torch')}, commit {env.get('git_commit')}"
    return [create_table_artifact(environment_rows(env), key=artifact_keys(workload)["environment"], description=description)]


@_best_effort
def publish_dataset_report(dataset, workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish the sample-digits picture for a ``ParquetDataset``; returns the artifact ids."""
    from prefect.artifacts import create_markdown_artifact

    markdown = sample_digits_markdown(dataset.split_dir("train"), dataset.rows["train"], tuple(dataset.image_shape), dataset.classes)
    return [create_markdown_artifact(markdown, key=artifact_keys(workload)["samples"], description="Nine training digits with labels")]


@_best_effort
def publish_training_report(trained, workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish the training curves of a ``TrainedModel``; returns the artifact ids."""
    from prefect.artifacts import create_markdown_artifact

    best = f"Best validation accuracy {trained.best_val_accuracy:.4f}."
    markdown = image_markdown("Training curves", training_curves_png(trained.history), best)
    return [create_markdown_artifact(markdown, key=artifact_keys(workload)["curves"], description="Loss and accuracy per epoch")]


@_best_effort
def publish_tuning_report(
    trials: Sequence[dict[str, Any]], metric: str, best_id: str, config_path: str, workload: str = DEFAULT_WORKLOAD
) -> list:
    """Publish the trial table and the per-epoch curves of a search; returns the artifact ids."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    keys = tune_keys(workload)
    stopped = sum(trial.get("status") == "stopped early" for trial in trials)
    description = f"{len(trials)} trial(s), {stopped} stopped early; best {best_id}, its config: {config_path}"
    table = create_table_artifact(trial_rows(trials, metric, best_id), key=keys["trials"], description=description)
    caption = f"Dashed lines ending in x: trials ASHA stopped early. Best trial {best_id}; its config: {config_path}"
    picture = image_markdown(f"Trials: {metric} per epoch", trial_curves_png(trials, metric, best_id), caption)
    curves = create_markdown_artifact(picture, key=keys["trial_curves"], description=f"{metric} per epoch for every trial")
    return [table, curves]


@_best_effort
def publish_evaluation_report(evaluation, dataset, trained, workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish confusion matrix, test predictions, metrics table and checkpoint; returns the artifact ids.

    Called by the evaluation stage before its gate decides, so every report says whether the
    gate passed (in its title, the metrics table's ``gate`` column and the descriptions).
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    keys = artifact_keys(workload)
    gate = gate_verdict(evaluation.accuracy, evaluation.min_accuracy)
    confusion = image_markdown(
        f"Confusion matrix ({gate})",
        confusion_matrix_png(evaluation.confusion, dataset.classes),
        f"Test accuracy **{evaluation.accuracy:.4f}** on {evaluation.rows} images; {gate}.",
    )
    checkpoints = [c.model_dump() for c in trained.checkpoints]
    return [
        create_markdown_artifact(confusion, key=keys["confusion"], description=f"True vs predicted digit counts; {gate}"),
        create_markdown_artifact(
            predictions_markdown(evaluation.predictions_path, dataset.split_dir("test"), gate, tuple(dataset.image_shape), dataset.classes),
            key=keys["predictions"],
            description=f"Test digits with true and predicted labels; {gate}",
        ),
        create_table_artifact(
            metrics_rows(evaluation.confusion, evaluation.precision, evaluation.recall, gate, dataset.classes),
            key=keys["metrics"],
            description=f"Per-class test metrics; accuracy {evaluation.accuracy:.4f}; {gate}",
        ),
        create_markdown_artifact(
            checkpoint_markdown(evaluation.checkpoint, checkpoints, trained.run_dir, evaluation.accuracy, gate),
            key=keys["checkpoint"],
            description=f"Path of the checkpoint evaluation used; {gate}",
        ),
    ]


@_best_effort
def publish_run_comparison(model: str, runs: Sequence[dict[str, Any]], promotion: dict[str, Any] | None) -> list:
    """Publish a model's recent runs as a table and the accuracy-over-runs picture (stable keys per model)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    keys = comparison_keys(model)
    verdict = f"this run: {'promoted' if promotion and promotion.get('promoted') else 'not promoted'}"
    if promotion:
        verdict += f" ({promotion.get('reason')})"
    description = f"Recent runs of {model}, newest first; {verdict}"
    table = create_table_artifact(comparison_rows(runs), key=keys["table"], description=description)
    caption = f"Stars: promoted runs; ringed: the current champion; red crosses: gate failed. {verdict.capitalize()}."
    picture = image_markdown(f"{model}: test accuracy over runs", accuracy_over_runs_png(runs), caption)
    chart = create_markdown_artifact(picture, key=keys["picture"], description=f"Test accuracy of recent runs of {model}")
    return [table, chart]


def progress_percent(epoch: int, epochs: int) -> float:
    """Progress after finishing 0-based ``epoch`` of ``epochs``, in percent (0..100)."""
    return round(min(max((epoch + 1) / max(epochs, 1) * 100.0, 0.0), 100.0), 2)


def epoch_line(metrics: dict[str, Any], epochs: int) -> str:
    """One line describing a finished epoch, e.g. ``epoch 3/20: train loss 0.41, val accuracy 0.9812``."""
    parts = [f"epoch {int(metrics['epoch']) + 1}/{epochs}"]
    if "train_loss" in metrics:
        parts.append(f"train loss {metrics['train_loss']:.4f}")
    if "val_accuracy" in metrics:
        parts.append(f"val accuracy {metrics['val_accuracy']:.4f}")
    return parts[0] + (": " + ", ".join(parts[1:]) if len(parts) > 1 else "")


class TrainingProgress(UserCallback):
    """Ray Train callback that moves the Prefect progress artifact after every reported epoch.

    Runs in the Ray Train controller process, which reaches the flow's Prefect API through
    ``PREFECT_API_URL`` in the Ray job's runtime environment. An update that fails is logged and
    dropped: progress is informational and must never stop training.
    """

    def __init__(self, artifact_id: str, epochs: int):
        self.artifact_id, self.epochs = str(artifact_id), epochs

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or "epoch" not in metrics[0] or metrics[0].get("mid_epoch"):
            return
        from prefect.artifacts import update_progress_artifact

        try:
            # _sync: the controller calls callbacks from inside its asyncio loop, where Prefect
            # would otherwise hand back an un-awaited coroutine and update nothing.
            update_progress_artifact(
                artifact_id=self.artifact_id,
                progress=progress_percent(int(metrics[0]["epoch"]), self.epochs),
                description=f"Training: {epoch_line(metrics[0], self.epochs)}",
                _sync=True,
            )
        except Exception as exc:
            logging.getLogger(__name__).warning("Progress artifact %s not updated: %s", self.artifact_id, exc)


def training_progress_callbacks(epochs: int, run_name: str, workload: str = DEFAULT_WORKLOAD) -> list[TrainingProgress]:
    """Create the training progress artifact (at 0%) and return the callback that moves it.

    Returns an empty list, with a warning, when the artifact cannot be created (no Prefect
    API, for example): training then runs without live progress. Outside a Prefect task run (the
    stage function called directly, as the benchmarks do) there is no run to attach it to, and
    creating it would start a temporary Prefect server here and another one in the Ray Train
    controller: no callback then.
    """
    from prefect.context import TaskRunContext

    if TaskRunContext.get() is None:
        return []
    try:
        from prefect.artifacts import create_progress_artifact

        artifact_id = create_progress_artifact(
            0.0, key=artifact_keys(workload)["progress"], description=f"Training {run_name}: starting, {epochs} epoch(s)", _sync=True
        )
    except Exception as exc:
        stage_logger(__name__).warning("No training progress artifact: %s: %s", type(exc).__name__, exc)
        return []
    return [TrainingProgress(str(artifact_id), epochs)]
