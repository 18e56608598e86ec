"""Peak memory of a Parquet folder's conversion (``download.source=parquet``) at two sizes, as a ratio.

    python -m benchmarks.data.parquet_memory --small 2000 --large 20000

Writes two Parquet folders of noisy RGB ``--size`` x ``--size`` PNGs as the Hugging Face ``datasets``
library stores them (an ``Image`` struct, a ClassLabel; 85% in ``train-00000.parquet``, 15% in
``test-00000.parquet``, row groups of 1,000 rows) in a temporary folder under /tmp, then converts each
in a fresh Python process of its own (`child`: `dataset.formats.parquet_files.check_layout`, the header scan
and `dataset.sources.parquet_source.convert_layout`, as the conversion stage runs them) and reports that
process's peak resident memory (``VmHWM``) before and after the conversion. The large set's peak
over the small set's is the ratio: about 1 when a split is converted in bounded memory, growing with
the set when a split's encoded images are held (before issue 66: 250 MB for 20,000 64x64 PNGs).

``--child FOLDER`` runs one measurement in this process and prints it as JSON (run it with another
``PYTHONPATH`` to measure other code on the same files).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CLASSES = ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j")
GROUP = 1000  # rows a row group of the written files


def write_folder(root: Path, count: int, size: int, seed: int = 0) -> Path:
    """``count`` noisy RGB ``size`` x ``size`` PNGs as two Parquet files under ``root`` (85% train, 15% test)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image": {"_type": "Image"}, "label": {"names": list(CLASSES), "_type": "ClassLabel"}}
    schema = pa.schema([("image", image_type), ("label", pa.int64())],
                       metadata={b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    train = count * 85 // 100
    for split, rows in (("train", train), ("test", count - train)):
        with pq.ParquetWriter(root / f"{split}-00000.parquet", schema) as writer:
            for start in range(0, rows, GROUP):
                images, labels = [], []
                for i in range(start, min(rows, start + GROUP)):
                    base = rng.integers(0, 256, 3, dtype=np.uint8)
                    out = io.BytesIO()
                    Image.fromarray(base + rng.integers(0, 32, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
                    images.append({"bytes": out.getvalue(), "path": f"{i}.png"})
                    labels.append(i % len(CLASSES))
                writer.write_table(pa.table({"image": pa.array(images, type=image_type), "label": labels}, schema=schema))
    return root


def peak_mb() -> float:
    """This process's peak resident memory so far, in MB: ``VmHWM`` of /proc/self/status. Not ``ru_maxrss``: Linux
    keeps it across ``exec``, so a child started from a big parent reports the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; no /proc elsewhere


def child(folder: str) -> dict:
    """Convert ``folder`` in this process: its row counts, seconds, peak RSS before and after the conversion (MB)."""
    from dataset.formats.parquet_files import check_layout
    from dataset.formats.parquet_scan import scan
    from dataset.sources.parquet_source import convert_layout
    from pipeline_config import ParquetConfig

    layout = check_layout(folder)
    before = peak_mb()
    started = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix="parquet-memory-out-", dir="/tmp"))
    try:
        shape = scan(layout, None, None)
        rows = convert_layout(layout, out, ParquetConfig(), shape, False, None)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"rows": rows, "seconds": round(time.perf_counter() - started, 2), "before_mb": round(before, 1),
            "peak_mb": round(peak_mb(), 1)}


def measure(folder: Path) -> dict:
    """`child` on ``folder`` in a fresh Python process."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.data.parquet_memory", "--child", str(folder)], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=2_000, help="images of the small set (at least 20)")
    parser.add_argument("--large", type=int, default=20_000, help="images of the large set")
    parser.add_argument("--size", type=int, default=64, help="width and height of the images, pixels")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    if args.small < 20 or args.large < args.small or args.size < 1:
        parser.error("--small must be at least 20, --large at least --small, --size at least 1")
    work = Path(tempfile.mkdtemp(prefix="parquet-memory-", dir="/tmp"))
    try:
        results = []
        for count in (args.small, args.large):
            folder = write_folder(work / f"set-{count}", count, args.size)
            encoded = sum(path.stat().st_size for path in folder.iterdir())
            results.append((count, encoded, measure(folder)))
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Parquet conversion, RGB {args.size}x{args.size} PNGs; {cpu_name()}")
    print(f"{'images':>8} {'files MB':>9} {'RSS before MB':>14} {'peak RSS MB':>12} {'seconds':>8}")
    for count, encoded, got in results:
        print(f"{count:>8} {encoded / 1e6:>9.1f} {got['before_mb']:>14.1f} {got['peak_mb']:>12.1f} {got['seconds']:>8.2f}")
    ratio = results[1][2]["peak_mb"] / results[0][2]["peak_mb"]
    print(f"peak ratio {args.large} / {args.small} images: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
