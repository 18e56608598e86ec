"""What an image folder (download.source=folder) may hold, and what the pipeline says about it.

Every refusal here comes from the folder check the CLI runs before Prefect or Ray start: the CLI's
own `main` in this process, with a tripwire in place of the runtime (`refused`), so a check that
lets a bad folder through fails the test at once instead of starting a run. Real files throughout:
PNGs written with PIL (16-bit ones too), a PNG cut in half, a header that claims 10000x10000
pixels, a dangling symbolic link, an S3 endpoint on a loopback port nothing listens on, and the
bundled MNIST sample converted to real Parquet (no Ray) for the damaged-dataset rebuild.
"""

from __future__ import annotations

import socket
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from dataset.formats import folder, images
from dataset.formats.parquet import SPLITS, SplitWriter, build_manifest, schema_for, to_table
from dataset.inputs.read import read_folder
from pipeline_config import DownloadConfig, ParquetConfig
from storage_io import MANIFEST, atomic_write_json
from tasks.download import download
from tasks.to_parquet import dataset_fingerprint, to_parquet
from tests.support.images import SIZE, write_image_folder


@pytest.fixture
def refused(monkeypatch, capsys, tmp_path):
    """``refused(*args)``: flows.train's CLI on ``args`` in this process -> (exit code, stderr). Reaching the
    runtime (the Prefect API and Ray) fails the test: every case here must be refused before it."""
    import ray

    from flows import train as cli
    from runner import harness

    def tripwire(*_args, **_kwargs):
        raise AssertionError("the folder got past the checks: Prefect and Ray would start now")

    monkeypatch.setattr(harness, "cli_runtime", tripwire)
    storage = tmp_path / "storage"

    def run(*args: str) -> tuple[int, str]:
        code = cli.main(["--storage-root", str(storage), "--download.source", "folder", *args])
        assert not ray.is_initialized() and not storage.exists()  # nothing started, nothing written
        return code, capsys.readouterr().err

    return run


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` 8-bit gray pixels and holds none of them."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def sixteen_bit_folder(root: Path, values: dict[str, int]) -> Path:
    """test/<class>/ of 16-bit grayscale PNGs (PIL mode I;16), one per class, every pixel ``values[class]``."""
    from PIL import Image

    for name, value in values.items():
        (root / name).mkdir(parents=True)
        Image.fromarray(np.full((SIZE, SIZE), value, dtype=np.uint16)).save(root / name / "a.png")
    return root


def test_16_bit_grayscale_is_scaled_to_8_bits_not_saturated(tmp_path):
    root = sixteen_bit_folder(tmp_path / "test", {"dark": 4_000, "mid": 32_768, "white": 65_535})
    from PIL import Image

    assert Image.open(root / "mid" / "a.png").mode == "I;16"  # what PIL reads a 16-bit gray PNG as
    table = read_folder(root, (1, SIZE, SIZE), ["dark", "mid", "white"])  # predict's reading: as the conversion's
    pixels = np.frombuffer(table.column("image").combine_chunks().buffers()[1], dtype=np.uint8).reshape(3, -1)
    assert pixels[:, 0].tolist() == [4_000 >> 8, 128, 255]  # before: 255 for all three (clipped at white)
    rgb = images.decode((root / "mid" / "a.png").read_bytes(), "mid", 3, (8, 8), None)
    assert rgb.shape == (8, 8, 3) and set(np.unique(rgb).tolist()) == {128}


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(tmp_path, refused):
    root = write_image_folder(tmp_path / "images", {"train": 2, "test": 1})
    huge = root / "train" / "red_square" / "huge.png"
    huge.write_bytes(png_header(10_000, 10_000))  # 100 megapixels declared, no pixel data: never decoded
    code, err = refused("--download.path", str(root))
    assert code == 2, err
    assert f"{huge}: 10000x10000 = 100,000,000 pixels, more than download.max_image_pixels (50,000,000)" in err
    big = root / "train" / "red_square" / "big.png"
    write_image_folder(tmp_path / "big", {"train": 1}, size=40)
    huge.unlink()
    (tmp_path / "big" / "train" / "red_square" / "red_square-000.png").rename(big)
    code, err = refused("--download.path", str(root), "--download.max-image-pixels", "1000", "--transform.image-size", "20")
    assert code == 2 and f"{big}: 40x40 = 1,600 pixels, more than download.max_image_pixels (1,000)" in err, err


def test_a_png_cut_short_is_named_by_the_check_not_by_the_conversion(tmp_path, refused):
    root = write_image_folder(tmp_path / "images", {"train": 3, "test": 1})
    cut = root / "test" / "green_disc" / "green_disc-000.png"
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])  # its header intact: opening it works, decoding it does not
    code, err = refused("--download.path", str(root))
    assert code == 2, err
    assert f"{cut}: cannot be decoded in full (OSError: image file is truncated" in err and "replace it or remove it" in err


def test_one_class_and_an_empty_validation_split_are_refused_naming_the_fix(tmp_path, refused):
    one = write_image_folder(tmp_path / "one", {"train": 4, "test": 2}, classes=("cat",))
    code, err = refused("--download.path", str(one))
    assert code == 2 and f"download.path {one}: train/ has one class folder (cat); a classifier needs at least two" in err, err

    single = write_image_folder(tmp_path / "single", {"train": 1, "test": 1})
    code, err = refused("--download.path", str(single))
    assert code == 2, err
    assert f"download.path {single}: the validation split would be empty" in err and "or a val/<class>/ folder" in err
    write_image_folder(single, {"val": 1})  # with a val/ folder the same train/ is accepted
    assert folder.check_folder(str(single)).has_val


def test_an_unreachable_s3_folder_gets_the_storage_roots_message(monkeypatch, refused):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for key, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": closed}.items():
        monkeypatch.setenv(key, value)
    code, err = refused("--download.path", "s3://images-bucket/shapes")
    assert code == 2, err
    assert f"download.path s3://images-bucket/shapes: cannot reach the S3 endpoint {closed}" in err
    assert "check AWS_ENDPOINT_URL and that the server is up" in err and "NETWORK_CONNECTION" not in err


def test_skipped_files_and_dangling_links_are_counted_and_named(tmp_path, layout):
    root = write_image_folder(tmp_path / "images", {"train": 3, "test": 1})
    (root / "train" / "blue_cross" / "notes.txt").write_text("not a picture")
    (root / "train" / "green_disc" / "moved.png").symlink_to(tmp_path / "elsewhere.png")  # its target is gone
    for extra in ("a.gif", "b.gif"):
        (root / "test" / "red_square" / extra).write_bytes(b"GIF89a")
    found = folder.check_folder(str(root))
    assert found.skipped == (
        "train/blue_cross/notes.txt (not .png/.jpg/.jpeg)", "train/green_disc/moved.png (a link to a missing file)",
        "test/red_square/a.gif (not .png/.jpg/.jpeg)", "test/red_square/b.gif (not .png/.jpg/.jpeg)",
    )
    note = f"4 file(s) in {root} skipped: train/blue_cross/notes.txt (not .png/.jpg/.jpeg), train/green_disc/moved.png"
    assert found.skipped_note().startswith(note) and found.skipped_note().endswith("and 1 more")

    # The conversion stage's terminal line says it (here a stored dataset of this folder is reused, so no Ray).
    raw = download.fn(DownloadConfig(source="folder", path=str(root)), layout)
    cfg = ParquetConfig()
    store_dataset(Path(layout.dataset_dir(dataset_fingerprint(raw, cfg), "mnist")), dataset_fingerprint(raw, cfg), raw.files)
    dataset = to_parquet.fn(raw, cfg, layout)
    assert dataset.skipped and dataset.terminal_detail().endswith(f"(verified on storage, reused); {found.skipped_note()}")


def store_dataset(directory: Path, fingerprint: str, inputs: dict[str, str]) -> None:
    """A published dataset (real Parquet and manifest) of one 20x20 RGB row per split."""
    for row_id, split in enumerate(SPLITS):
        writer = SplitWriter(directory / split, ParquetConfig(), schema_for(SIZE * SIZE * 3))
        writer.write(to_table(np.array([row_id]), np.full((1, SIZE * SIZE * 3), row_id, np.uint8), np.array([0])))  # no copies across splits
        writer.close()
    manifest = build_manifest(directory, fingerprint, inputs, dict.fromkeys(SPLITS, 1), (3, SIZE, SIZE), ["a", "b"])
    atomic_write_json(directory / MANIFEST, manifest)


def test_a_damaged_stored_dataset_is_rebuilt_and_the_terminal_line_says_so(layout):
    raw = download.fn(DownloadConfig(source="sample"), layout)
    cfg = ParquetConfig()
    first = to_parquet.fn(raw, cfg, layout)
    assert first.notes == [] and "rebuilt" not in first.terminal_detail()
    damaged = Path(first.directory) / "train" / "part-00000.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-100])  # truncated
    again = to_parquet.fn(raw, cfg, layout)
    assert again.rows == first.rows and not again.skipped
    line = again.terminal_detail()
    assert line.startswith(": 3,800 train / 200 validation / 1,000 test rows; rebuilt: the stored dataset failed its check")
    assert f"{damaged}: sha256 does not match the manifest (truncated or modified)" in line
    assert to_parquet.fn(raw, cfg, layout).skipped  # the rebuilt one verifies
