"""The data path against the seeds': IDX files made to size, converted and read by our stages and by the seeds' way, and the conversion's peak memory."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dataset.formats.idx import read_idx

ROOT = Path(__file__).resolve().parents[2]  # the repository

FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def write_idx_dir(folder: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """Synthetic MNIST-shaped IDX .gz files (random pixels; the data path does not care)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def idx(array: np.ndarray) -> bytes:
        header = struct.pack(">HBB", 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
        return header + array.tobytes()

    for (images, labels), n in zip(((FILES[0], FILES[1]), (FILES[2], FILES[3])), (n_train, n_test)):
        with gzip.open(folder / images, "wb", compresslevel=1) as handle:
            handle.write(idx(np.zeros((0, 28, 28), np.uint8))[:4] + struct.pack(">III", n, 28, 28))
            for start in range(0, n, 50_000):
                handle.write(rng.integers(0, 256, size=(min(50_000, n - start), 28, 28), dtype=np.uint8).tobytes())
        (folder / labels).write_bytes(gzip.compress(idx((np.arange(n) % 10).astype(np.uint8)), compresslevel=1))
    return folder


def ours_data_path(raw: Path, out: Path) -> float:
    """Seconds for our conversion + transform over every training row (our read, our vectorized map)."""
    from dataset.formats.parquet import ParquetDataset, convert
    from dataset.tensors.batches import prepare_batch
    from dataset.tensors.spec import TransformSpec
    from dataset.tensors.transform import read_split
    from pipeline_config import ParquetConfig, TransformConfig

    start = time.perf_counter()
    rows = convert(raw, out, ParquetConfig(validation_every=1000))
    spec = TransformSpec(dataset=ParquetDataset(directory=str(out), fingerprint="bench", rows=rows),
                         config=TransformConfig(), checks={}, manifest="")
    ds = read_split(spec, "train").map_batches(
        prepare_batch, batch_format="pyarrow", batch_size=4096, fn_kwargs={"mean": 0.5, "std": 0.5}
    )
    rows = sum(len(b["label"]) for b in ds.iter_batches(batch_size=4096, batch_format="numpy"))
    assert rows > 0
    return time.perf_counter() - start


def seeds_data_path(raw: Path, out: Path) -> float:
    """Seconds for the seeds' approach over the same training rows (our re-implementation of it)."""
    import pandas as pd
    import ray.data
    from PIL import Image
    from torchvision.transforms import Compose, Normalize, ToTensor

    start = time.perf_counter()
    images, labels = read_idx(raw / FILES[0]), read_idx(raw / FILES[1])
    frame = pd.DataFrame({"image": images.tolist(), "label": labels})
    ray.data.from_pandas(frame).write_parquet(str(out))

    def per_row(row: dict) -> dict:
        transform = Compose([ToTensor(), Normalize((0.5,), (0.5,))])
        row["image"] = transform(Image.fromarray(np.array(row["image"], dtype=np.uint8)))
        return row

    ds = ray.data.read_parquet(str(out), file_extensions=["parquet"]).map(per_row)
    rows = sum(len(b["label"]) for b in ds.iter_batches(batch_size=4096, batch_format="numpy"))
    assert rows == len(labels)
    return time.perf_counter() - start


def conversion_peak_rss_mb(rows: int, work: Path) -> dict:
    """Convert ``rows`` synthetic rows in a fresh process; its peak RSS and seconds."""
    raw = write_idx_dir(work / f"raw-{rows}", rows, 1000)
    # VmHWM (the process's peak RSS), not ru_maxrss: Linux carries ru_maxrss over fork + exec, so a
    # child of this (large) process would report our peak, not its own.
    code = (
        "import sys, time; from pathlib import Path\n"
        "def hwm(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
        "from pipeline_config import ParquetConfig; from dataset.formats.parquet import convert\n"
        "base = hwm()\n"
        "t = time.perf_counter(); convert(Path(sys.argv[1]), Path(sys.argv[2]), ParquetConfig())\n"
        "print(base, hwm(), time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(raw), str(work / f"pq-{rows}")], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    base_kb, peak_kb, seconds = out.stdout.split()
    return {"rows": rows, "peak_rss_mb": round(int(peak_kb) / 1024, 1), "rss_before_mb": round(int(base_kb) / 1024, 1),
            "seconds": round(float(seconds), 2), "rows_per_s": round(rows / float(seconds))}
