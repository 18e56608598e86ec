"""Which images a report shows and their pictures: sampled rows of a split, predictions right and wrong, read from the dataset's Parquet files."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dataset.formats.parquet import images_from_column
from dataset.tensors.windows import read_rows
from reporting.pictures import GRID, MNIST_SHAPE, digit_grid_png, image_markdown
from storage_io import filesystem, list_files


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


def read_split_rows(split_dir: str, positions: np.ndarray | None = None, row_ids: Sequence[int] | None = None):
    """Read rows of a Parquet split (schema of ``dataset.formats.parquet``) by position or by ``row_id``.

    Args:
        split_dir: A split folder such as ``<dataset>/train``.
        positions: Row positions within the split, in file order.
        row_ids: ``row_id`` values to fetch instead (order of the result follows ``row_ids``).

    Returns:
        ``(row_ids, images (N, H*W*C) uint8, labels)`` as numpy arrays.
    """
    fs, where = filesystem(split_dir)  # a local folder or an S3 prefix
    files = [f"{where}/{name}" for name in list_files(split_dir, ".parquet") if "/" not in name]
    try:
        table = read_rows(fs, files, positions=positions, row_ids=row_ids)
    except KeyError as exc:
        raise KeyError(f"row_id(s) {exc.args[0]} not in {split_dir}") from None
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
    import pyarrow.parquet as pq  # pyarrow: only where rows are read

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
