"""docs/extending.md's "A source of your own", done as the page says: its module and its one registration line added to
a copy of the project (nothing else changed, checked by diff), then a run's stages on that copy read real digits from
CSV files through it: the checks before any work, the download and conversion stages, the transform's defaults,
cleanup and the watcher, a refusal naming the file, and flows.predict's reader. The digits are the project's bundled
MNIST sample, written as Kaggle's digit recognizer CSV (a label, then 784 pixel columns)."""

from __future__ import annotations

import difflib
import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "extending.md"
MODULE = "dataset/sources/csv_source.py"
REGISTRY = "pipeline_config/sources.py"

# What runs in the copy of the project (its own interpreter, the copy as its working folder): every stage's question.
STAGES = r"""
import json, logging, sys
from dataset.formats.parquet import verify_manifest
from dataset.sources.interface import check_data, defaults_for, source_for, watched, best_config_data
from pipeline_config import PipelineConfig
from storage_io import StorageLayout
from tasks.download import download
from tasks.to_parquet import to_parquet

digits, storage, broken = sys.argv[1:]
config = PipelineConfig.model_validate({"download": {"source": "csv", "path": digits}, "storage_root": storage})
layout = StorageLayout.create(storage, "csv-run")
checked = check_data(config.download, None, storage)
raw = download.fn(config.download, layout)
dataset = to_parquet.fn(raw, config.parquet, layout, image_size=None, workload=config.workload)
try:
    check_data(config.download.model_copy(update={"path": broken}))
    refused = None
except ValueError as exc:
    refused = str(exc)
scored = source_for(config.download).read_inputs(digits, (1, 28, 28), checked.classes, None)  # flows.predict's reader
again = source_for(config.download).read_inputs(dataset.directory + "/test", (1, 28, 28), checked.classes, None)
print(json.dumps({
    "workload": config.workload, "trial": checked.for_trial(), "files": sorted(raw.files), "rows": dataset.rows,
    "shape": dataset.image_shape, "classes": dataset.classes, "kind": dataset.source, "directory": dataset.directory,
    "verified": verify_manifest(dataset.directory, dataset.fingerprint) is not None, "defaults": defaults_for("csv"),
    "deletable": raw.deletable(), "watched": watched(config.download), "best": best_config_data(config.download),
    "resizable": source_for(config.download).resizable, "refused": refused,
    "scored": [scored.num_rows, scored.column("label").to_pylist()[:10], scored.column("image")[7].as_py().hex()],
    "again": [again.num_rows, sorted(again.column("label").to_pylist()) == sorted(scored.column("label").to_pylist())],
}))
"""


def guide_parts() -> tuple[str, str]:
    """(the module, the registration line) as docs/extending.md shows them."""
    text = GUIDE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (module,) = [block for block in blocks if block.startswith(f"# {MODULE}\n")]
    (line,) = [block for block in blocks if block.startswith(f"# {REGISTRY}")]
    return module.split("\n", 1)[1], line.split("\n", 1)[1].rstrip("\n")


def sample_digits() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The bundled sample's (pixels, labels) per split, read from its IDX files."""
    def read(name: str, offset: int) -> np.ndarray:
        return np.frombuffer(gzip.decompress((ROOT / "data" / "mnist-sample" / name).read_bytes())[offset:], dtype=np.uint8)

    found = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        labels = read(f"{prefix}-labels-idx1-ubyte.gz", 8)
        found[split] = (read(f"{prefix}-images-idx3-ubyte.gz", 16).reshape(len(labels), 784), labels)
    return found


def write_csv(path: Path, pixels: np.ndarray, labels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ",".join(["label", *(f"pixel{i}" for i in range(pixels.shape[1]))])
    rows = np.concatenate([labels[:, None].astype(np.int64), pixels.astype(np.int64)], axis=1)
    np.savetxt(path, rows, fmt="%d", delimiter=",", header=header, comments="")


def copy_of_the_project(into: Path) -> Path:
    """Every file of the checkout git does not ignore, copied: what a team that copies the project starts from."""
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file():
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, into / rel)
    return into


def test_a_source_from_the_guide_is_one_module_and_one_line(tmp_path):
    module, line = guide_parts()
    project = copy_of_the_project(tmp_path / "project")
    (project / MODULE).write_text(module)
    registry = (project / REGISTRY).read_text()
    assert "\nSOURCES = {\n" in registry
    (project / REGISTRY).write_text(registry.replace("\nSOURCES = {\n", f"\nSOURCES = {{\n{line}\n", 1))

    changed = [rel for rel in (MODULE, REGISTRY) if not (ROOT / rel).exists() or (ROOT / rel).read_text() != (project / rel).read_text()]
    assert changed == [MODULE, REGISTRY]
    diff = [d for d in difflib.unified_diff((ROOT / REGISTRY).read_text().splitlines(), (project / REGISTRY).read_text().splitlines(), lineterm="", n=0)
            if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    assert diff == [f"+{line}"] and len(line.splitlines()) == 1  # one line added, nothing else changed

    digits = sample_digits()
    data = tmp_path / "kaggle-digits"
    write_csv(data / "train.csv", digits["train"][0][:400], digits["train"][1][:400])
    write_csv(data / "test.csv", *(part[:100] for part in digits["test"]))
    broken = tmp_path / "broken"
    write_csv(broken / "train.csv", digits["train"][0][:20], digits["train"][1][:20])
    write_csv(broken / "test.csv", digits["test"][0][:5], np.array([11, *digits["train"][1][:4]]))  # 11: a label train.csv lacks

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    out = subprocess.run([sys.executable, "-c", STAGES, str(data), str(tmp_path / "storage"), str(broken)], cwd=project,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    labels = sorted(set(digits["train"][1][:400].tolist()))
    assert got["workload"] == "kaggle-digits"  # named after the folder, as an image folder's run is
    assert got["trial"] == [[1, 28, 28], len(labels)] and got["files"] == ["test.csv", "train.csv"]
    assert got["rows"] == {"train": 380, "val": 20, "test": 100}  # every 20th training row held out, as MNIST's
    assert got["shape"] == [1, 28, 28] and got["classes"] == [str(label) for label in labels] and got["kind"] == "csv"
    assert got["verified"] and got["directory"].startswith(str(tmp_path / "storage" / "datasets" / "kaggle-digits-"))
    assert got["defaults"] == [True, "shifts", "border"] and got["deletable"] == [] and got["watched"] == str(data)
    assert got["best"] == {"source": "csv", "path": str(data)} and got["resizable"] is False
    assert got["refused"] == f"{broken / 'test.csv'}: labels [11] that train.csv does not have"
    # flows.predict --input reads the folder's test.csv through the module, and the converted test/ split as any source's
    assert got["scored"][:2] == [100, [labels.index(v) for v in digits["test"][1][:10].tolist()]]
    assert bytes.fromhex(got["scored"][2]) == digits["test"][0][7].tobytes() and got["again"] == [100, True]

    import pyarrow.parquet as pq

    test = pq.read_table(Path(got["directory"]) / "test").sort_by("row_id")  # the digits as written, row by row
    assert test.column("label").to_pylist() == [labels.index(v) for v in digits["test"][1][:100].tolist()]
    assert np.array_equal(np.frombuffer(test.column("image")[7].as_py(), dtype=np.uint8), digits["test"][0][7])
    assert sorted(p.name for p in data.iterdir()) == ["test.csv", "train.csv"]  # the user's files: read, never changed
