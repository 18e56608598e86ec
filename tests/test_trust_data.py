"""Issue 60: every refusal masks, every image folder says what it passed over, exit 2 leaves nothing.

All fast and in-process where the real thing runs there: the CLI's own ``main`` on real flags (and
once as a command in a process of its own), real PNGs written with PIL, a real storage root on
tmp_path. A CLI run that gets past its checks would start Prefect and Ray; a tripwire in their place
fails the test instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows import mnist
from pipeline_config import PipelineConfig
from storage_io import redact_error, redact_text, redact_url
from storage_io.redact import _SECRET_NAMES, _SECRET_PARTS
from tests.support.cli import ROOT

# What must appear nowhere, not even in part: no four characters of it in a row.
TOKEN = "Qz9Xk2Vw7Jm4Pq8Yt5Rn3Hb6"


def leaked(text: str, secret: str = TOKEN, least: int = 4) -> list[str]:
    """Every piece of ``secret`` of ``least`` characters or more that ``text`` holds."""
    return [secret[i:i + least] for i in range(len(secret) - least + 1) if secret[i:i + least] in text]


def _clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "MNIST_", "PIPELINE_"))}


# -- 3. One redaction, before any shortening -------------------------------------------------------------------------

def test_the_cli_refuses_a_mirror_url_with_a_token_without_printing_any_of_it(tmp_path):
    """The command as a user types it: pydantic shortens the value it echoes to about 50 characters by
    cutting out its middle; the '?access_token=' went and the token's tail was printed."""
    url = f"https://mirror.example/mnist/?access_token={TOKEN}"
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(tmp_path / "storage"), "--download.mirror-url", url],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_clean_env(),
    )
    assert out.returncode == 2, out.stderr
    assert "download.mirror_url" in out.stderr and "access_token=***" in out.stderr
    assert leaked(out.stdout + out.stderr) == [] and not (tmp_path / "storage").exists()


SECRET_NAMES = sorted({*_SECRET_NAMES, *_SECRET_PARTS, "access_token", "X-Amz-Signature", "client_secret"})


@pytest.mark.parametrize("name", SECRET_NAMES)
@pytest.mark.parametrize("where", ["?", "#", "?page=2&", "#state=1&"])
def test_no_part_of_a_credential_parameter_is_printed_whatever_its_name(capsys, tmp_path, name, where):
    url = f"https://mirror.example/a/long/path/to/the/mnist/files/{where}{name}={TOKEN}"
    assert mnist.main(["--storage-root", str(tmp_path / "storage"), "--download.mirror-url", url]) == 2
    out = capsys.readouterr()
    assert "download.mirror_url" in out.err and leaked(out.out + out.err) == [], out.err


@pytest.mark.parametrize("flag", ["--tracking.uri", "--download.mirror-url"])
@pytest.mark.parametrize("tail", [f"#{TOKEN}", f"?{TOKEN}", f"/#{TOKEN}"])
def test_a_bare_fragment_or_query_is_masked(capsys, tmp_path, flag, tail):
    """``https://host:5000/#token``: a value without a name is a token as likely as not."""
    assert mnist.main(["--storage-root", str(tmp_path / "storage"), flag, f"https://mlflow.example:5000{tail}"]) == 2
    out = capsys.readouterr()
    assert flag.lstrip("-").replace("-", "_") in out.err and leaked(out.out + out.err) == [], out.err


@pytest.mark.parametrize(("url", "redacted"), [
    ("https://host:5000/#s3cretpw", "https://host:5000/#***"),
    ("https://host/p?s3cretpw", "https://host/p?***"),
    ("https://host/p?page=2&s3cretpw", "https://host/p?page=2&***"),
])
def test_redact_url_masks_a_bare_value_and_keeps_a_route(url, redacted):
    assert redact_url(url) == redacted
    assert redact_url("https://mlflow.example/#/experiments/1/runs/abc") == "https://mlflow.example/#/experiments/1/runs/abc"


def test_a_validation_error_is_redacted_before_pydantic_shortens_it():
    """Any input: a field's string, and a whole section echoed by a model-level error."""
    url = f"https://mirror.example/mnist/?access_token={TOKEN}"
    with pytest.raises(ValidationError) as refused:
        PipelineConfig.model_validate({"download": {"source": "mirror", "mirror_url": url}, "train": {"epochs": 0}})
    assert leaked(redact_text(str(refused.value)))  # what the CLI printed before: a tail of the token
    text = redact_error(refused.value)
    assert leaked(text) == [] and "access_token=***" in text
    assert "train.epochs" in text and "greater than or equal to 1" in text  # every other error as pydantic words it
    assert redact_error(ValueError(f"see {url}")) == "see https://mirror.example/mnist/?access_token=***"


def test_a_whole_section_echoed_by_a_model_level_error_is_redacted_too():
    url = f"https://mirror.example/a/long/path/?sig={TOKEN}"
    error = ValidationError.from_exception_data("PipelineConfig", [
        {"type": "value_error", "loc": ("download",), "input": {"source": "mirror", "mirror_url": url},
         "ctx": {"error": ValueError(f"download: {url} is refused")}},
    ])
    assert leaked(str(error)) and leaked(redact_error(error)) == []


# -- 2. Hidden entries are never classes or images -------------------------------------------------------------------

def write_png(path: Path, size: int = 20, seed: int = 0, gray: bool = False) -> Path:
    """A real PNG of ``size`` x ``size`` random pixels, written with PIL."""
    import numpy as np
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size) if gray else (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def add_hidden_entries(root: Path) -> None:
    """What notebooks, git and macOS leave in a folder: each holds a real PNG, so only its name hides it."""
    write_png(root / "train" / ".ipynb_checkpoints" / "red_square-000-checkpoint.png")  # would be a class
    write_png(root / "train" / "red_square" / ".hidden.png", seed=1)  # would be an image
    write_png(root / "train" / "green_disc" / ".git" / "objects" / "a.png", seed=2)  # a hidden folder inside a class
    write_png(root / "test" / ".ipynb_checkpoints" / "x.png", seed=3)  # would be a class train/ lacks: refused
    (root / "test" / "blue_cross" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")


def test_hidden_folders_and_files_are_never_classes_or_images(tmp_path):
    from dataset.formats import folder
    from tests.support.images import CLASSES, write_image_folder

    root = write_image_folder(tmp_path / "shapes", {"train": 3, "test": 1})
    before = folder.check_folder(str(root))
    add_hidden_entries(root)
    after = folder.check_folder(str(root))
    assert after.classes == before.classes == list(CLASSES)
    assert after.files == before.files and not any("/." in rel for rel in folder.image_paths(after))
    assert after.hidden == (
        "train/.ipynb_checkpoints/", "train/green_disc/.git/", "train/red_square/.hidden.png",
        "test/.ipynb_checkpoints/", "test/blue_cross/.DS_Store",
    )
    assert after.skipped_note() == "5 hidden entries skipped"


def test_hidden_entries_change_neither_the_fingerprint_nor_the_listing_cache_and_the_conversion_line_counts_them(tmp_path):
    """The download stage lists the folder (the images' sha256: the dataset's fingerprint); the conversion
    stage's line says what was passed over. A stored dataset of this fingerprint is reused, so no Ray."""
    import json

    import numpy as np

    from dataset.formats.parquet import SPLITS, SplitWriter, build_manifest, schema_for, to_table
    from pipeline_config import DownloadConfig, ParquetConfig
    from storage_io import MANIFEST, StorageLayout, atomic_write_json
    from tasks.download import download
    from tasks.to_parquet import dataset_fingerprint, to_parquet
    from tests.support.images import write_image_folder

    root = write_image_folder(tmp_path / "shapes", {"train": 3, "test": 1})
    layout = StorageLayout.create(str(tmp_path / "storage"), "test-run")
    cfg = ParquetConfig()
    raw = download.fn(DownloadConfig(source="folder", path=str(root)), layout)
    listings = sorted((tmp_path / "storage" / "listings").glob("*.json"))
    cached = json.loads(listings[0].read_text())["files"]
    add_hidden_entries(root)
    again = download.fn(DownloadConfig(source="folder", path=str(root)), layout)
    assert again.files == raw.files and dataset_fingerprint(again, cfg) == dataset_fingerprint(raw, cfg)
    assert set(json.loads(listings[0].read_text())["files"]) == set(cached)

    final = Path(layout.dataset_dir(dataset_fingerprint(raw, cfg), "mnist"))
    for row_id, split in enumerate(SPLITS):
        writer = SplitWriter(final / split, cfg, schema_for(20 * 20 * 3))
        writer.write(to_table(np.array([row_id]), np.full((1, 20 * 20 * 3), row_id, np.uint8), np.array([0])))  # no copies across splits
        writer.close()
    shape, classes = (3, 20, 20), ["blue_cross", "green_disc", "red_square"]
    atomic_write_json(final / MANIFEST, build_manifest(final, dataset_fingerprint(raw, cfg), raw.files, dict.fromkeys(SPLITS, 1), shape, classes))
    dataset = to_parquet.fn(again, cfg, layout)
    assert dataset.skipped and dataset.terminal_detail().endswith("(verified on storage, reused); 5 hidden entries skipped")


# -- 4. Exit 2 creates nothing on the storage root -------------------------------------------------------------------

def tiny_folder(root: Path, size: int, gray: bool = True) -> Path:
    """Two classes of real ``size`` x ``size`` PNGs: three to train on and one to test, each."""
    for split, count in (("train", 3), ("test", 1)):
        for label in ("dots", "lines"):
            for i in range(count):
                write_png(root / split / label / f"{label}-{i}.png", size, seed=hash((split, label, i)) % 1000, gray=gray)
    return root


@pytest.fixture
def refused(monkeypatch, capsys, tmp_path):
    """``refused(*args)``: flows.train's CLI on ``args`` in this process -> (exit code, stderr), on a storage root
    that does not exist yet and must not afterwards. Reaching Prefect and Ray fails the test."""
    import ray

    from flows import train as cli
    from runner import harness

    def tripwire(*_args, **_kwargs):
        raise AssertionError("the run got past its checks: Prefect and Ray would start now")

    monkeypatch.setattr(harness, "cli_runtime", tripwire)
    storage = tmp_path / "storage"

    def run(*args: str) -> tuple[int, str]:
        code = cli.main(["--storage-root", str(storage), "--download.source", "folder", *args])
        assert not ray.is_initialized()
        assert not storage.exists(), sorted(str(p.relative_to(storage)) for p in storage.rglob("*"))
        return code, capsys.readouterr().err

    return run


@pytest.mark.parametrize(("args", "said"), [
    (["--model.name", "no_such_team_module:net"], "model.name 'no_such_team_module:net'"),
    # 4x4 images kept as they are (transform.image_size auto would enlarge them): too small
    (["--model.name", "training.model.catalog:small_cnn", "--transform.image-size", "None"], "model.name 'training.model.catalog:small_cnn'"),
    (["--transform.mean", "[0.1, 0.2, 0.3]"], "transform.mean has 3 values; the images have 1 channels"),
], ids=["a-model-that-does-not-import", "a-model-the-images-are-too-small-for", "a-mean-per-channel-of-other-images"])
def test_a_refusal_after_the_folder_check_leaves_the_storage_root_as_it_was(tmp_path, refused, args, said):
    """The folder's images are listed and decoded first (what the listing cache keeps); the refusal after it
    wrote listings/<folder>.json on the root before."""
    data = tiny_folder(tmp_path / "tiny", 4)
    code, err = refused("--download.path", str(data), *args)
    assert code == 2 and said in err, err


def test_a_deployments_run_refused_before_any_work_writes_nothing_either(tmp_path):
    """`PipelineRun`, what a deployment's run does first: the same checks, the same empty root."""
    from runner.pipeline_run import PipelineRun

    storage = tmp_path / "storage"
    config = PipelineConfig.model_validate({
        "storage_root": str(storage), "model": {"name": "training.model.catalog:small_cnn"}, "transform": {"image_size": None},
        "download": {"source": "folder", "path": str(tiny_folder(tmp_path / "tiny", 4))},
    })
    with pytest.raises(ValueError, match="model.name 'training.model.catalog:small_cnn'"):
        with PipelineRun(config, "flows.train", [], lambda _: pytest.fail("got past the checks")):
            pytest.fail("got past the checks")
    assert not storage.exists()


def test_what_the_checks_learned_is_written_once_the_run_goes_on(tmp_path):
    """Held in this process until `keep_checks` (the run is past its checks): then every image is on record as
    decoded in full, so the next run's checks decode none of them."""
    import json

    from dataset.formats import folder, folder_scan, listing
    from dataset.sources.interface import check_data, keep_checks
    from pipeline_config import DownloadConfig

    data, storage = tiny_folder(tmp_path / "tiny", 8), tmp_path / "storage"
    cfg = DownloadConfig(source="folder", path=str(data))
    check_data(cfg, None, str(storage))
    layout = folder.check_folder(str(data))
    assert not storage.exists()
    assert folder_scan.image_shape(layout, None, str(storage)) == (1, 8, 8)  # from what is held: no file opened
    keep_checks(cfg, str(storage))
    entries = json.loads(Path(listing.cache_path(str(storage), str(data))).read_text())["files"]
    assert sorted(entries) == sorted(folder.image_paths(layout)) and all(entry[3] is not None for entry in entries.values())


# -- 1. Images too small for the model are refused before any work --------------------------------------------------

def test_images_too_small_for_the_model_are_refused_naming_transform_image_size_and_the_smallest_size(tmp_path, refused):
    """training.model.catalog:small_cnn halves its input three times: 4x4 images leave nothing to pool. The smallest
    size comes from running the model, not from a table. (Kept at their size: transform.image_size auto would
    enlarge them to 28x28.)"""
    code, err = refused("--download.path", str(tiny_folder(tmp_path / "tiny", 4)), "--model.name", "training.model.catalog:small_cnn",
                        "--transform.image-size", "None")
    assert code == 2, err
    assert "transform.image_size: images of 4x4 pixels are too small for model.name 'training.model.catalog:small_cnn'" in err
    assert "the smallest size it runs on is 8x8: set transform.image_size to 8 or more" in err


def test_an_image_size_too_small_for_the_model_is_refused_too(tmp_path, refused):
    """20x20 RGB pictures resized to transform.image_size=5: the field named is the one that made them too small."""
    from tests.support.images import write_image_folder

    data = write_image_folder(tmp_path / "shapes", {"train": 2, "test": 1})
    code, err = refused("--download.path", str(data), "--model.name", "training.model.catalog:small_cnn", "--transform.image-size", "5")
    assert code == 2 and "images of 5x5 pixels are too small" in err and "set transform.image_size to 8 or more" in err, err


def test_the_smallest_size_is_the_models_own():
    """Found by forward passes in train mode on two images: small_cnn needs 8x8; ResNet-18's global pooling
    takes 1x1 pixels, so its images are never too small (its batch norm needs two images, which the training
    loop always gives it). A model that fails at every size is refused as it was, naming model.name."""
    import torch

    from training.model.catalog import build_model
    from training.model.trust import smallest_size, try_model

    small = build_model("training.model.catalog:small_cnn", in_channels=3, num_classes=2)
    assert smallest_size(small, 3, 2, 1) == 8 and smallest_size(small, 3, 2, 5) == 8
    try_model("resnet18", (1, 1, 1), 2)  # runs: nothing to refuse
    try_model("training.model.catalog:small_cnn", (1, 8, 8), 2)

    class Broken(torch.nn.Module):
        def forward(self, images):
            raise RuntimeError("broken at any size")

    assert smallest_size(Broken(), 1, 2, 28) is None
    with pytest.raises(ValueError, match=r"model.name 'training.model.catalog:small_cnn': images of 28x4 pixels are too small for "
                                         r"it .*smallest size it runs on is 8x8, and these images are not resized"):
        try_model("training.model.catalog:small_cnn", (1, 4, 28), 2, resizable=False)
