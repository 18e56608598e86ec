"""A Parquet folder's conversion in bounded memory (`dataset.formats.parquet_stream`, issue 66 item 6): the same dataset as
when every split's encoded images were held in memory, and no split held at once.

Real Parquet files written with pyarrow in tmp_path (tests/support/parquet_hf.py: an Image struct or plain binary,
several files and row groups), converted by `dataset.sources.parquet_source.convert_layout` itself. The expected dataset is
built here the way the conversion built it before: every file's image column read whole, each planned row decoded
in plan order. Python's own allocations are measured with tracemalloc: the encoded images reach Python as
``bytes`` objects, so a split held in memory shows in its peak.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataset.formats import images
from dataset.formats.parquet import schema_for, to_table
from dataset.formats.parquet_files import ParquetSourceError, check_layout
from dataset.formats.parquet_scan import scan
from dataset.sources.parquet_source import convert_layout, plan_rows
from pipeline_config import ParquetConfig
from tests.support.parquet_hf import png, shapes, write_hf_dataset, write_table

CFG = ParquetConfig(rows_per_file=100, rows_per_group=64, split_seed=5)


def expected(layout, cfg: ParquetConfig, shape, size) -> dict[str, pa.Table]:
    """Each split as the conversion wrote it before streaming: every file's images read whole, decoded in plan order."""
    channels, height, width = shape
    out = {}
    for split, planned in plan_rows(layout, cfg).items():
        held = {}
        for rel in dict.fromkeys(rel for rel, _, _, _ in planned):
            column = pq.read_table(f"{layout.path}/{rel}", columns=[layout.image_column]).column(0).combine_chunks()
            held[rel] = (column.field("bytes") if pa.types.is_struct(column.type) else column).to_pylist()
        pixels = np.stack([images.decode(held[rel][row], rel, channels, size, None).reshape(-1) for rel, row, _, _ in planned]) \
            if planned else np.zeros((0, channels * height * width), np.uint8)
        ids = np.array([row_id for _, _, row_id, _ in planned], dtype=np.int64)
        labels = np.array([label for _, _, _, label in planned], dtype=np.int64)
        out[split] = to_table(ids, pixels, labels).cast(schema_for(channels * height * width))
    return out


def written(folder) -> tuple[pa.Table, list[int]]:
    """A converted split's rows, and the rows of each of its row groups, file by file."""
    files = sorted(folder.glob("*.parquet"))
    groups = [pq.ParquetFile(f).metadata.row_group(i).num_rows for f in files for i in range(pq.ParquetFile(f).metadata.num_row_groups)]
    return pa.concat_tables([pq.read_table(f) for f in files]), groups


@pytest.mark.parametrize("validation", [False, True])
@pytest.mark.parametrize("image_size", [None, 12])
def test_the_streamed_conversion_writes_the_dataset_the_held_one_did(tmp_path, validation, image_size):
    per_class = {"train": 70, "validation": 6, "test": 9} if validation else {"train": 70, "test": 9}
    root = write_hf_dataset(tmp_path / "hf", per_class)
    encoded, labels = shapes(40, seed=9)  # a second training file: plain binary, row groups of 37 rows
    pq.write_table(pq.read_table(write_table(tmp_path / "x.parquet", encoded, labels, struct=False)),
                   root / "data" / "train-00001-of-00002.parquet", row_group_size=37)
    layout = check_layout(str(root))
    shape = scan(layout, image_size, None)
    size = (image_size, image_size) if image_size else None
    counts = convert_layout(layout, tmp_path / "out", CFG, shape, image_size is not None, None)

    for split, table in expected(layout, CFG, shape, size).items():
        got, groups = written(tmp_path / "out" / split)
        assert got.equals(table), split
        assert counts[split] == table.num_rows and all(n <= 64 for n in groups) and sum(groups) == table.num_rows
    assert counts["val"] == 18 if validation else 0 < counts["val"] < counts["train"]  # held out of train without files
    assert not list((tmp_path / "out").glob(".*"))  # no spill file left


def test_no_split_is_held_in_memory_while_it_is_converted(tmp_path):
    rng = np.random.default_rng(0)
    noise = [png(rng.integers(0, 256, (80, 80, 3), dtype=np.uint8)) for _ in range(900)]  # about 19 KB each
    write_table(tmp_path / "hf" / "train.parquet", noise, [i % 3 for i in range(900)])  # one row group: one column chunk
    write_table(tmp_path / "hf" / "test.parquet", noise[:30], [i % 3 for i in range(30)])
    layout = check_layout(str(tmp_path / "hf"))
    shape = scan(layout, None, None)
    tracemalloc.start()
    try:
        convert_layout(layout, tmp_path / "out", CFG, shape, False, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    split_bytes = sum(len(data) for data in noise)
    assert peak < split_bytes / 2, f"{peak / 1e6:.1f} MB at the peak for a split of {split_bytes / 1e6:.1f} MB"


def test_an_empty_image_is_named_by_file_and_row_in_the_planned_order(tmp_path):
    encoded, labels = shapes(4, seed=2)
    encoded[5], encoded[7] = None, b""
    path = write_table(tmp_path / "hf" / "train.parquet", encoded, labels)
    write_table(tmp_path / "hf" / "test.parquet", encoded[:3], labels[:3])
    layout = check_layout(str(tmp_path / "hf"))
    first = next(row for rel, row, _, _ in plan_rows(layout, CFG)["train"] if row in (5, 7))
    with pytest.raises(ParquetSourceError, match=f"{path} row {first}: no image"):
        convert_layout(layout, tmp_path / "out", CFG, (3, 20, 20), False, None)
    assert not list((tmp_path / "out").glob(".*"))


def test_the_benchmark_prints_its_peaks_and_their_ratio(capsys):
    from benchmarks.data import parquet_memory as bench

    assert bench.main(["--small", "20", "--large", "60", "--size", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Parquet conversion, RGB 8x8 PNGs; ")
    assert [line.split()[0] for line in lines[2:4]] == ["20", "60"]
    peaks = [float(line.split()[3]) for line in lines[2:4]]
    assert lines[4] == f"peak ratio 60 / 20 images: {peaks[1] / peaks[0]:.3f}"
