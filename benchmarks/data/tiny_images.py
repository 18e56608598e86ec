"""Tiny images with every default against the same images at 32 px: what ``transform.image_size: auto`` buys.

    python -m benchmarks.data.tiny_images                      # auto (the default) and 32
    python -m benchmarks.data.tiny_images --sizes auto,32,None # and the images kept at 8x8, as before auto
    python -m benchmarks.data.tiny_images --seeds 0,1          # each size with train.seed 0, then 1

The data: 8x8 grayscale digits made from the bundled MNIST sample the way the classic 8x8 digits set was
made (each digit's central 24x24 averaged over 3x3 blocks, 17 gray levels): 1,257 training and 540 test
images, written as an image folder of PNGs (``train/<digit>/``, ``test/<digit>/``). Each size is one
``python -m flows.train`` run with every default but ``transform.image_size`` (its own temporary Prefect
server and local Ray, its own storage root, so no run reuses another's dataset or champion). Printed and
written (``--out``): each run's test accuracy, its images' size as trained, its wall seconds and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the repository
TRAIN_ROWS, TEST_ROWS = 1257, 540


def digits_8x8(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels): 8x8 uint8 digits from the bundled sample."""
    from dataset.formats.idx import read_idx
    from pipeline_config.common import SAMPLE_DIR

    def small(images: np.ndarray) -> np.ndarray:
        blocks = images[:, 2:26, 2:26].astype(np.float32).reshape(-1, 8, 3, 8, 3).mean(axis=(2, 4))
        return (np.round(blocks / 255 * 16) * (255 / 16)).clip(0, 255).astype(np.uint8)

    rng = np.random.default_rng(seed)
    train_x, train_y = read_idx(SAMPLE_DIR / "train-images-idx3-ubyte.gz"), read_idx(SAMPLE_DIR / "train-labels-idx1-ubyte.gz")
    test_x, test_y = read_idx(SAMPLE_DIR / "t10k-images-idx3-ubyte.gz"), read_idx(SAMPLE_DIR / "t10k-labels-idx1-ubyte.gz")
    train, test = rng.choice(len(train_x), TRAIN_ROWS, replace=False), rng.choice(len(test_x), TEST_ROWS, replace=False)
    return small(train_x[train]), train_y[train], small(test_x[test]), test_y[test]


def write_folder(root: Path) -> Path:
    """The 8x8 digits as an image folder of PNGs under ``root``."""
    from PIL import Image

    train_x, train_y, test_x, test_y = digits_8x8()
    for split, images, labels in (("train", train_x, train_y), ("test", test_x, test_y)):
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            folder = root / split / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image, "L").save(folder / f"{i:05d}.png")
    return root


def run(folder: Path, work: Path, size: str, timeout_s: int, seed: int = 0) -> dict:
    """One ``flows.train`` run with every default but ``transform.image_size`` = ``size`` (and ``train.seed``); what it scored."""
    storage = work / f"storage-{size}-{seed}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MNIST_", "PIPELINE_", "PREFECT_API_URL"))}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "flows.train", "--download.source", "folder", "--download.path", str(folder),
         "--storage-root", str(storage), "--run-name", f"size-{size}", "--transform.image-size", size, "--train.seed", str(seed)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )
    wall = time.perf_counter() - started
    summary = json.loads((storage / "runs" / f"size-{size}" / "summary.json").read_text())
    dataset = (summary.get("data") or {}).get("dataset_dir")
    manifest = json.loads((Path(dataset) / "_manifest.json").read_text()) if dataset else {}
    said = (done.stdout + done.stderr).splitlines()
    transform_line = next((line.split(" - ", 1)[-1] for line in said if "transform done" in line), None)
    return {
        "image_size": size, "seed": seed, "exit_code": done.returncode, "test_accuracy": summary.get("test_accuracy"),
        "trained_at": manifest.get("image"), "transform_line": transform_line, "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="auto,32", help="transform.image_size of each run, comma-separated")
    parser.add_argument("--seeds", default="0", help="train.seed of each run of each size, comma-separated")
    parser.add_argument("--timeout-s", type=int, default=7200, help="the most one run may take")
    parser.add_argument("--out", default=None, help="JSON file to write the rows to")
    args = parser.parse_args(argv)
    from reporting.environment import cpu_model

    with tempfile.TemporaryDirectory(prefix="tiny-images-") as tmp:
        work = Path(tmp)
        folder = write_folder(work / "digits8")
        rows = []
        for seed in (int(value) for value in args.seeds.split(",")):
            for size in args.sizes.split(","):
                rows.append(run(folder, work, size.strip(), args.timeout_s, seed))
                print(json.dumps(rows[-1]), flush=True)
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "train_rows": TRAIN_ROWS, "test_rows": TEST_ROWS, "runs": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if all(row["exit_code"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
