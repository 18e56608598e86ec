"""Pictures of a run: PNG bytes from arrays, histories and rows on storage, and the markdown that embeds them.

Pure rendering: arrays, manifests and files on storage in; PNG bytes or markdown out; no
Prefect, no Ray, testable on tiny arrays (`reporting.artifacts` publishes them).

Why pictures are inline ``data:image/png;base64`` URIs inside markdown artifacts: the Prefect
server stores artifacts but serves no files, and the UI that Prefect (3.8.8, 3.9.1) opens by default
(V2, React) renders markdown with react-markdown + rehype-sanitize and a URL transform that
explicitly keeps ``data:image/`` sources on ``<img>`` (the browser test checks the pictures load
with a non-zero natural width). So a report needs no file server, works offline and lives in
the Prefect database as long as the artifact does.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

GRID = 3  # the seeds' 3x3 pictures
MNIST_SHAPE = (1, 28, 28)  # (channels, height, width) when a caller names none: the seeds' digits


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


def accuracy_over_runs_png(runs: Sequence[dict[str, Any]]) -> bytes:
    """Test accuracy of each run in finish order: promoted runs as stars, the current champion ringed,
    gate failures as red crosses.

    Args:
        runs: Run rows oldest first (``training.champion.registry.recent_runs``).

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


