"""``flows.predict`` reads the Parquet columns the model's run read (issue 66).

A run trained on Parquet files whose images and labels are in columns of other names
(``--download.image_column img --download.label_column digit``) records them in its configuration, which
the model card keeps; predict read only ``image`` and ``label`` and refused the same files. Real parts: a
real registry (a champion promoted with such a run's configuration and the shapes' classes) and Parquet
files written as the Hugging Face ``datasets`` library writes them, under those column names.
"""

from __future__ import annotations

import numpy as np
import pytest

from dataset.inputs.read import read_folder
from dataset.inputs.tables import InputError
from storage_io import StorageLayout
from tests.support.images import CLASSES, SIZE
from tests.support.parquet_hf import shapes, write_table
from tests.support.registry import candidate, make_dataset
from training.champion import lookup, registry
from training.champion.card_scoring import card_scoring

MODEL = "shapes-resnet18"


def test_predict_reads_the_image_and_label_columns_of_the_models_run(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    config = {"download": {"source": "parquet", "path": str(tmp_path / "data"), "image_column": "img", "label_column": "digit"}}
    data_spec = {"image": {"channels": 3, "height": SIZE, "width": SIZE}, "classes": list(CLASSES), "mean": 0.5, "std": 0.5}
    promoted = candidate(layout, "hf", 0.9, make_dataset(layout, "shapes-a")).model_copy(update={"config": config, "data_spec": data_spec})
    assert registry.promote(layout, MODEL, promoted).promoted
    _, folder, card = lookup.resolve(layout.root, MODEL, None)
    scoring = card_scoring(card, folder, 1, 100)
    assert scoring.source.kind == "parquet"  # the model's run's data source reads what it scores
    assert (scoring.source.cfg.image_column, scoring.source.cfg.label_column) == ("img", "digit")

    encoded, labels = shapes(2, seed=3)
    inputs = tmp_path / "inputs"
    write_table(inputs / "test-00000-of-00001.parquet", encoded, labels, image="img", label="digit")
    data = scoring.data
    table = scoring.read_inputs(inputs)  # what flows.predict and flows.score call
    assert len(table) == len(labels) and table.column("label").to_pylist() == labels
    assert table.schema.field("image").type.byte_width == 3 * SIZE * SIZE and np.asarray(table.column("row_id")).tolist() == list(range(len(labels)))

    with pytest.raises(InputError, match=r"needs an 'image' column .* has"):  # what predict did before: image and label only
        read_folder(inputs, data["shape"], data["classes"], data["image_size"])

    older = card_scoring({**card, "config": {}}, folder, 1, 100)  # a card without the columns: the defaults
    assert (older.source.cfg.image_column, older.source.cfg.label_column) == ("image", "label")
    moved = {**card, "config": {"download": {"source": "gone", "image_column": "img", "label_column": "digit"}}}
    kept = card_scoring(moved, folder, 1, 100).source  # a source no longer registered: the defaults' with the run's columns
    assert kept.kind == "idx" and (kept.cfg.image_column, kept.cfg.label_column) == ("img", "digit")
    assert len(card_scoring(moved, folder, 1, 100).read_inputs(inputs)) == len(labels)
