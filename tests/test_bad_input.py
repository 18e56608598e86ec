"""Every bad file or value is a clear error (issue 37): exit 2, the file or field named, before any work, within seconds.

Real damaged files on disk (IDX files cut short, corrupt gzip streams, headers that lie, gzip
bombs, Parquet files that are not Parquet), real --output targets of every kind, real YAML
files built to expand, and a real registry for `flows.predict` to score with. `flows.predict`
is called in-process (its `main`) and once as a command; none of these cases may start Ray.
"""

from __future__ import annotations

import gzip
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from dataset.formats.idx import iter_idx_rows, read_idx
from dataset.formats.parquet import to_table
from dataset.inputs.read import read_folder
from dataset.inputs.tables import MAX_IMAGES
from pipeline_config import PipelineConfig
from pipeline_config.data import MirrorChecksums
from pipeline_config.settings import MAX_CONFIG_VALUES, TuneSettings, parse_cli
from pipeline_config.tune import TuneConfig
from storage_io import StorageLayout
from tests.support.cli import ROOT
from tests.support.digits import idx_bytes, synthetic_digits
from tests.support.registry import candidate, make_dataset
from training.champion import registry, registry_files

MODEL = "mnist-resnet18"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """A storage root with a champion (a real ResNet-18's weights) for flows.predict to resolve."""
    layout = StorageLayout.create(str(tmp_path_factory.mktemp("predict") / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    assert registry.promote(layout, MODEL, candidate(layout, "good", 0.967, data)).promoted
    return layout.root


def predict(root: str, *args: str, capsys) -> tuple[int, str, float]:
    """flows.predict's main in this process: (exit code, stderr, seconds); Ray must not have started."""
    import ray

    from flows import predict as cli

    started = time.monotonic()
    code = cli.main(["--storage-root", root, *args])
    seconds = time.monotonic() - started
    assert not ray.is_initialized()
    return code, capsys.readouterr().err, seconds


def images_file(folder: Path, data: bytes, name: str = "new-images-idx3-ubyte.gz") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder


def good_idx(n: int = 20) -> bytes:
    return idx_bytes(synthetic_digits(n)[0])


def corrupt_middle(data: bytes) -> bytes:
    blob = bytearray(data)
    for i in range(len(blob) // 3, len(blob) // 3 + 16):
        blob[i] ^= 0xFF
    return bytes(blob)


DAMAGED_IDX = {  # file content -> what the error says
    "gzip cut short": (lambda: gzip.compress(good_idx())[:-30], "damaged gzip stream"),
    "not gzip at all": (lambda: b"this is not gzip" * 10, "damaged gzip stream"),
    "corrupt deflate data": (lambda: corrupt_middle(gzip.compress(good_idx())), "damaged gzip stream"),
    "header cut short": (lambda: gzip.compress(b"\x00\x00\x08\x03\x00\x00"), "header ends early"),
    "header announces more": (lambda: gzip.compress(good_idx(20)[:-784 * 5]), "ends early"),
    "trailing data": (lambda: gzip.compress(good_idx(20) + b"\x00" * 100), "trailing data"),
    "wrong magic": (lambda: gzip.compress(b"\x00\x00\x09\x03" + good_idx()[4:]), "not an IDX uint8 file"),
    "27x27 images": (lambda: gzip.compress(idx_bytes(np.zeros((3, 27, 27), np.uint8))), "expected 28x28"),
    "too many images announced": (
        lambda: gzip.compress(b"\x00\x00\x08\x03" + (MAX_IMAGES + 1).to_bytes(4, "big") + b"\x00\x00\x00\x1c" * 2),
        "more than the 1,000,000",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGED_IDX))
def test_damaged_idx_files_are_named_with_exit_2(tmp_path, root, capsys, damage):
    make, why = DAMAGED_IDX[damage]
    folder = images_file(tmp_path / "in", make())
    code, err, seconds = predict(root, "--input", str(folder), capsys=capsys)
    assert code == 2 and why in err and "new-images-idx3-ubyte.gz" in err, err
    assert "Traceback" not in err and seconds < 30


def test_bad_labels_are_named(tmp_path, root, capsys):
    folder = images_file(tmp_path / "in", good_idx(10), "x-images-idx3-ubyte")
    (folder / "x-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([1, 2, 12, 3, 4, 5, 6, 7, 8, 9], np.uint8)))
    code, err, _ = predict(root, "--input", str(folder), capsys=capsys)
    assert code == 2 and "x-labels-idx1-ubyte: label 12 at row 2 is not a digit" in err
    (folder / "x-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(9, np.uint8)))
    code, err, _ = predict(root, "--input", str(folder), capsys=capsys)
    assert code == 2 and "has 10 images but" in err and "has 9 labels" in err


def test_a_gzip_bomb_is_refused_after_reading_what_its_header_announces(tmp_path):
    """20 images announced, then 300 MB of zeros that compress to ~300 KB: refused at once, nothing expanded."""
    compressor = gzip.GzipFile(tmp_path / "bomb-images-idx3-ubyte.gz", "wb")
    compressor.write(good_idx(20))
    zeros = b"\x00" * (1 << 20)
    for _ in range(300):
        compressor.write(zeros)
    compressor.close()
    assert (tmp_path / "bomb-images-idx3-ubyte.gz").stat().st_size < 1_000_000
    started = time.monotonic()
    with pytest.raises(ValueError, match="bomb-images-idx3-ubyte.gz: holds more values than its header"):
        read_folder(tmp_path)
    assert time.monotonic() - started < 5


DAMAGED_PARQUET = {
    "not parquet": (lambda path: path.write_bytes(b"PAR1 but not really"), "not a readable Parquet file"),
    "cut short": (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), "not a readable Parquet file"),
    "image as strings": (lambda path: pq.write_table(pa.table({"image": ["x"]}), path), "needs an 'image' column"),
    "label as text": (
        lambda path: pq.write_table(pa.table({"image": pa.array([b"\x00" * 784], pa.binary(784)), "label": ["7"]}), path),
        "column 'label' is string",
    ),
    "label 12": (
        lambda path: pq.write_table(pa.table({"image": pa.array([b"\x00" * 784], pa.binary(784)), "label": [12]}), path),
        "label 12 at row 0 is not a digit",
    ),
    "null image": (
        lambda path: pq.write_table(pa.table({"image": pa.array([b"\x00" * 784, None], pa.binary(784))}), path),
        "column 'image' has 1 empty",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGED_PARQUET))
def test_damaged_parquet_files_are_named_with_exit_2(tmp_path, root, capsys, damage):
    folder = tmp_path / "in" / "test"
    folder.mkdir(parents=True)
    images, labels = synthetic_digits(10)
    pq.write_table(to_table(np.arange(10), images.reshape(10, -1), labels), folder / "part-0.parquet")
    pq.write_table(to_table(np.arange(10, 20), images.reshape(10, -1), labels), folder / "part-1.parquet")
    make, why = DAMAGED_PARQUET[damage]
    make(folder / "part-1.parquet")
    code, err, seconds = predict(root, "--input", str(tmp_path / "in"), capsys=capsys)
    assert code == 2 and "part-1.parquet" in err and why in err, err
    assert "Traceback" not in err and seconds < 30


def test_output_targets_are_checked_before_any_work(tmp_path, root, capsys):
    folder = images_file(tmp_path / "in", gzip.compress(good_idx()))
    existing = tmp_path / "preds.parquet"
    existing.write_bytes(b"keep me")
    existing.chmod(0o644)
    link = tmp_path / "link.parquet"
    link.symlink_to(existing)
    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    cases = {
        str(tmp_path): "is a folder",
        str(existing): "exists already; pass --overwrite",
        str(link): "is a symbolic link",
        str(fifo): "not a regular file",
        str(a_file / "out.parquet"): "is a file, not a folder",
        str(tmp_path / "a\nb.parquet"): "control character",
    }
    for output, why in cases.items():
        code, err, seconds = predict(root, "--input", str(folder), "--output", output, capsys=capsys)
        assert code == 2 and why in err and seconds < 30, (output, err)
    assert existing.read_bytes() == b"keep me" and stat.S_IMODE(existing.stat().st_mode) == 0o644


def test_an_overwritten_output_keeps_its_mode_and_a_new_one_follows_the_umask(tmp_path):
    from flows.predict import _new_file_mode, check_output

    existing = tmp_path / "preds.parquet"
    existing.write_bytes(b"old")
    existing.chmod(0o640)
    assert check_output(str(existing), overwrite=True) == 0o640
    assert check_output(str(tmp_path / "new" / "preds.parquet"), overwrite=False) is None
    old = os.umask(0o027)
    try:
        assert _new_file_mode() == 0o640
    finally:
        os.umask(old)


def test_a_damaged_registry_exits_2_naming_the_file_before_ray(tmp_path, capsys):
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    registry.promote(layout, MODEL, candidate(layout, "good", 0.967, data))
    folder = images_file(tmp_path / "in", gzip.compress(good_idx()))
    pointer = Path(registry_files.champion_path(layout.root, MODEL))
    pointer.write_text("garbage")
    code, err, _ = predict(layout.root, "--input", str(folder), capsys=capsys)
    assert code == 2 and f"{pointer}: damaged" in err and "no champion yet" not in err
    pointer.unlink()
    code, err, _ = predict(layout.root, "--input", str(folder), capsys=capsys)
    assert code == 2 and "missing although v1 are published" in err
    weights = Path(registry_files.version_dir(layout.root, MODEL, 1), "model.pt")
    weights.write_bytes(weights.read_bytes()[:-10])
    code, err, seconds = predict(layout.root, "--input", str(folder), "--version", "1", capsys=capsys)
    assert code == 2 and "model.pt: damaged" in err and "does not match its sha256" in err and seconds < 30


def test_predict_as_a_command_exits_2_within_seconds(tmp_path, root):
    folder = images_file(tmp_path / "in", gzip.compress(good_idx())[:-30])
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "flows.predict", "--storage-root", root, "--input", str(folder)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2 and "new-images-idx3-ubyte.gz: damaged gzip stream" in out.stderr
    assert "Traceback" not in out.stderr and time.monotonic() - started < 120  # mostly the imports, on a shared machine


def test_the_conversions_idx_reader_names_a_damaged_gzip_file(tmp_path):
    images, labels = tmp_path / "train-images-idx3-ubyte.gz", tmp_path / "train-labels-idx1-ubyte.gz"
    images.write_bytes(corrupt_middle(gzip.compress(good_idx(200))))
    labels.write_bytes(gzip.compress(idx_bytes(np.zeros(200, np.uint8))))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: damaged gzip stream"):  # the CRC, at the end
        list(iter_idx_rows(images, labels, 64))
    images.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: damaged gzip stream"):
        list(iter_idx_rows(images, labels, 64))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: damaged gzip stream"):
        read_idx(images)
    images.write_bytes(gzip.compress(b"\x00\x00\x08\x03\x00"))
    with pytest.raises(ValueError, match="header ends early"):
        list(iter_idx_rows(images, labels, 64))


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("values, field", [
    ({"run_name": "nightly\n"}, "run_name"),
    ({"run_name": "a\tb"}, "run_name"),
    ({"promote": {"model_name": "mnist-resnet18\n"}}, "promote.model_name"),
    ({"model": {"name": "resnet18\n"}}, "model.name"),
    ({"storage_root": "s3://my-bucket\n/prefix"}, "storage_root"),
    ({"storage_root": "/tmp/a\x00b"}, "storage_root"),
    ({"download": {"source": "mirror", "mirror_url": "http://host/\r\nX-Evil: 1"}}, "download.mirror_url"),
    ({"ray": {"address": "host:6379\n"}}, "ray.address"),
])
def test_names_refuse_line_breaks_and_control_characters(values, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        PipelineConfig(**values)


def test_a_checksum_pattern_refuses_a_trailing_line_break():
    with pytest.raises(ValidationError, match="train_images"):
        MirrorChecksums(train_images="a" * 64 + "\n", train_labels="a" * 64, test_images="a" * 64, test_labels="a" * 64)


@pytest.mark.parametrize("values, field", [
    ({"transform": {"mean": float("nan")}}, "transform.mean"),
    ({"transform": {"std": float("inf")}}, "transform.std"),
    ({"train": {"learning_rate": float("nan")}}, "train.learning_rate"),
    ({"download": {"connect_timeout_s": float("inf")}}, "download.connect_timeout_s"),
    ({"promote": {"min_improvement": float("nan")}}, "promote.min_improvement"),
])
def test_numbers_that_must_be_finite_are_finite(values, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        PipelineConfig(**values)


def test_non_finite_numbers_in_a_yaml_file_and_the_search_space_are_refused(tmp_path):
    with pytest.raises(ValidationError, match="finite"):
        TuneConfig(search_space={"learning_rate": {"low": 1e-4, "high": float("inf")}})
    config = tmp_path / "run.yaml"
    config.write_text("transform:\n  mean: .nan\n")
    with pytest.raises(ValidationError, match=r"transform\.mean"):
        parse_cli(["--config-file", str(config)])
    config.write_text("tune:\n  search_space:\n    augmentation: {low: 0, high: .inf}\n")
    with pytest.raises(ValidationError, match="augmentation"):
        parse_cli(["--config-file", str(config)], TuneSettings)


def billion_laughs(path: Path) -> Path:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    lines.append("train: *i")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_yaml_bomb_is_refused_in_bounded_time(tmp_path):
    bomb = billion_laughs(tmp_path / "bomb.yaml")
    assert bomb.stat().st_size < 2048  # 9**9 values once expanded
    started = time.monotonic()
    with pytest.raises(ValidationError, match=f"bomb.yaml expands to more than {MAX_CONFIG_VALUES:,} values"):
        parse_cli(["--config-file", str(bomb)])
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("content, why", [
    (b"\xff\xfe not utf-8", "not UTF-8"),
    (b"a: [1, 2\nb: }", "not valid YAML"),
    (b"x" * ((1 << 20) + 1), "larger than 1 MB"),
    (("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 60))).encode(), "nests deeper"),
    (b"- just\n- a list\n", "must hold a mapping"),
])
def test_bad_config_files_are_named(tmp_path, content, why):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    started = time.monotonic()
    with pytest.raises(ValidationError, match=why) as exc:
        parse_cli(["--config-file", str(path)])
    assert "run.yaml" in str(exc.value) and time.monotonic() - started < 5


def test_the_flow_cli_refuses_a_yaml_bomb_with_exit_2(tmp_path):
    bomb = billion_laughs(tmp_path / "bomb.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--config-file", str(bomb), "--storage-root", str(tmp_path / "storage")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2 and "bomb.yaml expands to more than" in out.stderr
    assert not (tmp_path / "storage").exists()  # nothing created
