"""A Parquet dataset as the Hugging Face ``datasets`` library writes one, made with pyarrow alone.

``datasets`` stores an ``Image`` feature as a struct ``{bytes: binary, path: string}`` (the encoded PNG or
JPEG and its original file name), a ``ClassLabel`` as int64 with the class names in the schema's metadata
under the key ``huggingface`` (JSON: ``{"info": {"features": {"label": {"names": [...], "_type":
"ClassLabel"}}}}``), and a hub repository's splits as ``data/<split>-00000-of-00001.parquet``. The pictures
are the tests' RGB shapes (`tests.support.images.draw`): three classes a small model learns in seconds.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.support.images import CLASSES, SIZE, draw

IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    """``pixels`` encoded as a PNG."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(out, format="PNG")
    return out.getvalue()


def hf_metadata(names: list[str] | tuple[str, ...] | None, label: str = "label", image: str = "image") -> dict[bytes, bytes]:
    """The schema metadata ``datasets`` writes: the features, the label a ClassLabel when ``names`` are given."""
    features = {image: {"_type": "Image"}, label: {"names": list(names), "_type": "ClassLabel"} if names else {"dtype": "int64", "_type": "Value"}}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def write_table(path: Path, encoded: list[bytes | None], labels: list, names: list[str] | tuple[str, ...] | None = CLASSES,
                image: str = "image", label: str = "label", struct: bool = True) -> Path:
    """One Parquet file of ``encoded`` images and ``labels`` (ints or strings), as ``datasets`` writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if struct:
        images = pa.array([None if data is None else {"bytes": data, "path": f"{i}.png"} for i, data in enumerate(encoded)],
                          type=IMAGE_TYPE)
    else:
        images = pa.array(encoded, type=pa.binary())
    label_type = pa.string() if labels and isinstance(labels[0], str) else pa.int64() if all(isinstance(v, int) for v in labels) else None
    table = pa.table({image: images, label: pa.array(labels, type=label_type)})
    pq.write_table(table.replace_schema_metadata(hf_metadata(names, label, image)), path)
    return path


def shapes(count_per_class: int, seed: int, size: int = SIZE, gray: bool = False) -> tuple[list[bytes], list[int]]:
    """(PNG bytes, labels) of ``count_per_class`` pictures of each class, classes interleaved."""
    rng = np.random.default_rng(seed)
    encoded, labels = [], []
    for i in range(count_per_class):
        for label, kind in enumerate(CLASSES):
            pixels = draw(kind, rng, size)
            encoded.append(png(pixels.mean(axis=2).astype(np.uint8)) if gray else png(pixels))
            labels.append(label)
    return encoded, labels


def write_hf_dataset(root: Path, per_class: dict[str, int] | None = None, seed: int = 0, size: int = SIZE,
                     layout: str = "data", names: bool = True) -> Path:
    """The shapes as a hub repository's Parquet files under ``root``: ``per_class`` maps a split (train, validation,
    test) to pictures per class. ``layout``: ``data`` (``data/train-00000-of-00001.parquet``) or ``folders``
    (``default/train/0000.parquet``). ``names``: the ClassLabel's names in the metadata (else plain integers)."""
    per_class = per_class or {"train": 40, "test": 15}
    for offset, (split, count) in enumerate(per_class.items()):
        encoded, labels = shapes(count, seed + offset, size)
        rel = f"data/{split}-00000-of-00001.parquet" if layout == "data" else f"default/{split}/0000.parquet"
        write_table(root / rel, encoded, labels, CLASSES if names else None)
    return root
