"""What checking and listing an unchanged image folder costs, without and with the listing cache.

    python -m benchmarks.data.listing --images 10000

Writes ``--images`` RGB 64x64 PNGs (10 classes, 80% train/ and 20% test/) in a temporary folder
under /tmp, then times what a run does before its stages, `dataset.sources.interface.check_data` (every
image decoded in full) and the download stage's `tasks.download.list_folder` (every image hashed):
without a cache, with a cold one (the first run with a storage root, which writes it) and with a
warm one on the unchanged folder. Each the median of ``--repeat`` runs; the folder is removed after.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

CLASSES = 10
SIZE = 64


def write_folder(root: Path, count: int, seed: int = 0) -> Path:
    """``count`` noisy RGB SIZE x SIZE PNGs under ``root``: train/ (80%) and test/ (20%), CLASSES class folders."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(count):
        split = "test" if i % 5 == 4 else "train"
        folder = root / split / f"class{(i // 5) % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 256, 3, dtype=np.uint8)
        noise = rng.integers(0, 32, (SIZE, SIZE, 3), dtype=np.uint8)
        Image.fromarray(base + noise).save(folder / f"{i:06d}.png")
    return root


def time_both(cfg, storage_root: str | None) -> tuple[float, float]:
    """Seconds of check_data and of list_folder, with the listing cache on ``storage_root`` (None: none)."""
    from dataset.sources.interface import check_data
    from storage_io import StorageLayout
    from tasks.download import list_folder

    started = time.perf_counter()
    check_data(cfg, None, storage_root)
    checked = time.perf_counter()
    list_folder(cfg, logging.getLogger(__name__), StorageLayout.create(storage_root, "bench") if storage_root else None)
    return checked - started, time.perf_counter() - checked


def median_of(repeat: int, cfg, storage_root: str | None) -> list[float]:
    """The medians of ``repeat`` `time_both` runs: [check_data s, list_folder s]."""
    return [statistics.median(times) for times in zip(*(time_both(cfg, storage_root) for _ in range(repeat)))]


def measure(images: int, repeat: int) -> tuple[list[tuple[str, float, float]], int]:
    """(case, check_data s, list_folder s) rows for a fresh folder of ``images`` images, and the cache's bytes."""
    from pipeline_config import DownloadConfig

    work = Path(tempfile.mkdtemp(prefix="listing-bench-", dir="/tmp"))
    try:
        cfg = DownloadConfig(source="folder", path=str(write_folder(work / "images", images)))
        root = str(work / "storage")
        rows = [("no cache", *median_of(repeat, cfg, None)), ("cold cache (first run)", *time_both(cfg, root))]
        rows.append(("warm cache, unchanged", *median_of(repeat, cfg, root)))
        return rows, sum(path.stat().st_size for path in (work / "storage" / "listings").iterdir())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000, help="PNG files to write (at least 20)")
    parser.add_argument("--repeat", type=int, default=3, help="runs a case is timed (the median is shown)")
    args = parser.parse_args(argv)
    if args.images < 20 or args.repeat < 1:
        parser.error("--images must be at least 20 and --repeat at least 1")
    rows, cache_bytes = measure(args.images, args.repeat)
    print(f"{args.images} RGB {SIZE}x{SIZE} PNGs, {CLASSES} classes; {cpu_name()}; cache file {cache_bytes / 1e6:.2f} MB")
    print(f"{'case':<26} {'check_data s':>15} {'list_folder s':>14} {'total s':>8}")
    for case, check_s, list_s in rows:
        print(f"{case:<26} {check_s:>15.2f} {list_s:>14.2f} {check_s + list_s:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
