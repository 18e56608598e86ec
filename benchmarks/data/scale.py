"""Scale: image folders at three sizes through ``flows.train``, per-stage seconds and the run's peak memory.

    python -m benchmarks.data.scale            # 2,000 / 10,000 / 40,000 images of 64x64 (many minutes on 2 cores)
    python -m benchmarks.data.scale --quick    # 200 / 4,000 images of 128x128, both over a 1 MB in-memory
                                          # budget (what the test runs), about 3.5 minutes on 2 cores

Each size is an RGB PNG folder the benchmark makes itself (64x64, 10 classes, 80/20 train/test,
``<folder>/train/<class>/*.png`` and ``test/``; each class a colour and a stripe direction under
noise, so the model can learn it). Each size runs ``python -m flows.train`` on it in a fresh
process, with its own storage root and ``HOME`` in a fresh temporary folder, 1 epoch, 1 worker,
the small CNN, the gate off. From the run's ``summary.json``: seconds per stage. While it runs:
the sum of PSS (``/proc/<pid>/smaps_rollup``) over the CLI process and every process below it
(the temporary Prefect server, Ray's gcs/raylet and workers), sampled every 0.5 s, its peak, and
the peak per process kind (driver, ``ray::IDLE``, ``ray::RayTrainWorker``, raylet, ...), so what
grows with the data shows. In the same invocation, the plain loop: each PNG of the folder opened
with PIL and turned into a numpy array, images/s (the median of three passes), beside the conversion
stage's images/s; and training's and evaluation's images/s, each split's rows over its stage's seconds.
Last, a straight-line fit of peak PSS and wall time against the number of images, at 10x and
100x the largest size. Results go to ``benchmarks/results/scale.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.data.pss import PssSampler
from reporting import environment

ROOT = Path(__file__).resolve().parents[2]  # the repository
FULL_SIZES = (2_000, 10_000, 40_000)
QUICK_SIZES = (200, 4_000)
# The quick mode's images are larger (48 KB of pixels each, 4,000 of them 146 MB of training pixels) and its
# in-memory budget small, so both folders' training splits stream and the two runs take the same path at 20x the
# size. (With a 16 MB budget the smaller one was held in memory; since a run that holds its data starts no Ray
# Data at all, that compared the streamed path's own processes, not its growth: docs/performance.md.)
QUICK_SIDE, QUICK_IN_MEMORY_MB = 128, 1
CLASSES, SIDE, TEST_SHARE = 10, 64, 0.2
STAGES = ("download", "to-parquet", "transform", "train", "evaluate", "promote", "cleanup")


def class_image(label: int, rng: np.random.Generator, side: int = SIDE) -> np.ndarray:
    """A ``side`` x ``side`` RGB image of class ``label``: its colour, stripes in its direction, noise on top."""
    hue = np.array([(label * 37) % 256, (label * 91 + 60) % 256, (label * 153 + 120) % 256], dtype=np.float32)
    y, x = np.mgrid[0:side, 0:side].astype(np.float32)
    angle = np.pi * label / CLASSES
    stripes = 0.5 + 0.5 * np.sin((x * np.cos(angle) + y * np.sin(angle)) * 0.4 + rng.uniform(0, 2 * np.pi))
    image = hue * (0.5 + 0.5 * stripes[..., None]) + rng.normal(0, 24, (side, side, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def make_folder(folder: Path, n: int, seed: int = 0, side: int = SIDE) -> Path:
    """``n`` PNGs under ``folder``: train/<class>/ and test/<class>/ (80/20), classes c0..c9 in turn."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    n_test = int(round(n * TEST_SHARE))
    for i in range(n):
        label, split = i % CLASSES, "test" if i < n_test else "train"
        where = folder / split / f"c{label}"
        where.mkdir(parents=True, exist_ok=True)
        Image.fromarray(class_image(label, rng, side)).save(where / f"img{i:06d}.png")
    return folder


def plain_loop(folder: Path, passes: int = 3) -> dict:
    """Every PNG under ``folder`` opened with PIL and converted to a numpy array: images/s, the median of
    ``passes`` passes (one pass varied by 20-30% between the sizes of one run)."""
    from PIL import Image

    paths = sorted(folder.rglob("*.png"))
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for path in paths:
            with Image.open(path) as image:
                np.asarray(image.convert("RGB"))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"images": len(paths), "seconds": round(seconds, 2), "images_per_s": round(len(paths) / seconds, 1),
            "passes_s": [round(t, 2) for t in times]}


def run_flow(folder: Path, work: Path, name: str, extra: list[str] = ()) -> dict:
    """``python -m flows.train`` on ``folder`` in a fresh process (its own HOME and storage root): seconds, memory.
    ``extra``: more command-line settings."""
    home, storage = work / "home", work / "storage"
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RAY_ADDRESS"))}
    env["HOME"] = str(home)
    args = [sys.executable, "-m", "flows.train", "--download.source", "folder", "--download.path", str(folder),
            "--workload", "scale", "--model.name", "training.model.catalog:small_cnn", "--train.epochs", "1",
            "--train.num-workers", "1", "--evaluate.min-accuracy", "0", "--storage-root", str(storage), "--run-name", name, *extra]
    start = time.perf_counter()
    with open(work / "stdout.txt", "w+") as out, open(work / "stderr.txt", "w+") as err:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        with PssSampler(process.pid) as memory:
            code = process.wait()
        wall = time.perf_counter() - start
        err.seek(0)
        errors = err.read()
        tail = errors[-3000:]
        out.seek(0)
        lines = (out.read() + errors).splitlines()  # the transform stage's terminal line names the streamed splits
        streamed = next((line.rsplit("; ", 1)[-1].strip() for line in lines if "streamed in windows" in line), None)
    if code != 0:
        raise RuntimeError(f"the run on {folder} failed (exit {code}):\n{tail}")
    summary = json.loads((storage / "runs" / name / "summary.json").read_text())
    stages = {stage: round(float(info["seconds"]), 2) for stage, info in summary["stages"].items()}
    return {"wall_s": round(wall, 1), "streamed": streamed, "stages_s": stages, "outside_stages_s": round(wall - sum(stages.values()), 1),
            "rows": summary.get("data", {}).get("rows"), "test_accuracy": summary.get("test_accuracy"), **memory.result()}


def measure_size(n: int, tmp: Path, side: int = SIDE, extra: list[str] = ()) -> dict:
    """One size: the folder made, the plain loop over it, the flow run on it."""
    folder = make_folder(tmp / f"folder-{n}", n, side=side)
    folder_mb = sum(p.stat().st_size for p in folder.rglob("*.png")) / 1e6
    plain = plain_loop(folder)
    run = run_flow(folder, tmp / f"run-{n}", f"scale-{n}", extra)
    convert_s = run["stages_s"].get("to-parquet")
    conversion = round(n / convert_s, 1) if convert_s else None
    return {"images": n, "side": side, "folder_mb": round(folder_mb, 1), "plain_loop": plain, "conversion_images_per_s": conversion,
            "conversion_vs_plain_loop": round(plain["images_per_s"] / conversion, 2) if conversion else None,
            **stage_rates(run), **run}


def stage_rates(run: dict) -> dict:
    """Training's and evaluation's images/s, each its split's rows over its stage's seconds (fixed costs
    included: the worker group, the checkpoint, the reports), and evaluation's over training's."""
    rows, stages = run.get("rows") or {}, run["stages_s"]
    train = rows.get("train", 0) / stages["train"] if stages.get("train") else None
    evaluate = rows.get("test", 0) / stages["evaluate"] if stages.get("evaluate") else None
    return {"train_images_per_s": round(train, 1) if train else None, "evaluate_images_per_s": round(evaluate, 1) if evaluate else None,
            "evaluate_over_train": round(evaluate / train, 3) if train and evaluate else None}


def estimates(rows: list[dict]) -> dict:
    """Peak PSS and wall time at 10x and 100x the largest size: from the largest size's figure, the slope of a
    straight line fitted through every size (a slope below 0, which only noise gives, counts as 0)."""
    x = np.array([r["images"] for r in rows], dtype=float)
    out = {}
    for factor in (10, 100):
        n = int(x.max() * factor)
        row = {"images": n}
        for key in ("peak_pss_mb", "wall_s"):
            y = np.array([r[key] for r in rows], dtype=float)
            slope = max(0.0, float(np.polyfit(x, y, 1)[0]))
            row[key] = round(float(y[x.argmax()] + slope * (n - x.max())), 1)
            row[f"{key}_per_1000_images"] = round(slope * 1000, 2)
        out[f"{factor}x"] = row
    return out


def conversion_line(rows: list[dict]) -> dict:
    """The conversion stage as a straight line through the sizes: fixed seconds, and images/s past them
    (its steady state) against the plain loop's images/s on the largest folder."""
    x = np.array([r["images"] for r in rows], dtype=float)
    slope, intercept = np.polyfit(x, np.array([r["stages_s"].get("to-parquet", 0.0) for r in rows]), 1)
    plain = rows[int(x.argmax())]["plain_loop"]["images_per_s"]
    steady = round(1 / slope, 1) if slope > 0 else None
    return {"fixed_s": round(float(intercept), 2), "steady_images_per_s": steady, "plain_loop_images_per_s": plain,
            "plain_loop_over_steady": round(plain / steady, 2) if steady else None}


def format_table(result: dict) -> str:
    cpu = result["environment"].get("cpu_model") or "?"
    lines = [f"CPU: {cpu} ({result['environment'].get('cpu_cores')} cores){environment.cpu_suffix(result['environment'].get('cpu') or {})}",
             "| images | folder | plain loop | conversion | " + " | ".join(STAGES[1:5]) + " | wall | peak PSS | biggest at peak |",
             "|---" * 11 + "|"]
    for r in result["sizes"]:
        stages = " | ".join(f"{r['stages_s'].get(s, 0):.1f} s" for s in STAGES[1:5])
        top = ", ".join(f"{k} {v:,}" for k, v in list(r["at_peak_mb"].items())[:3])
        lines.append(f"| {r['images']:,} | {r['folder_mb']} MB | {r['plain_loop']['images_per_s']:,} img/s | "
                     f"{r['conversion_images_per_s']} img/s ({r['conversion_vs_plain_loop']}x slower) | {stages} | "
                     f"{r['wall_s']} s | {r['peak_pss_mb']:,} MB | {top} MB |")
    lines.append("evaluation against training, img/s (rows over stage seconds): " + "; ".join(
        f"{r['images']:,}: {r.get('evaluate_images_per_s')} against {r.get('train_images_per_s')} ({r.get('evaluate_over_train')}x)"
        for r in result["sizes"]))
    if result.get("conversion"):
        c = result["conversion"]
        lines.append(f"conversion: {c['fixed_s']} s fixed, then {c['steady_images_per_s']} img/s; plain loop "
                     f"{c['plain_loop_images_per_s']} img/s ({c['plain_loop_over_steady']}x)")
    if result.get("peak_ratio"):
        lines.append(f"peak PSS at {result['sizes'][-1]['images']:,} images / at {result['sizes'][0]['images']:,}: "
                     f"{result['peak_ratio']}x; streamed: " + "; ".join(f"{r['images']:,}: {r.get('streamed') or 'nothing'}" for r in result["sizes"]))
    for factor, e in result["estimates"].items():
        lines.append(f"estimate at {factor} ({e['images']:,} images): peak PSS {e['peak_pss_mb']:,.0f} MB "
                     f"({e['peak_pss_mb_per_1000_images']} MB per 1,000), wall {e['wall_s']:,.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} instead of {FULL_SIZES}")
    parser.add_argument("--sizes", type=lambda s: tuple(int(v) for v in s.split(",")), help="comma-separated sizes")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale.json"), help="where to write the JSON")
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    side, extra = (QUICK_SIDE, ["--transform.in-memory-mb", str(QUICK_IN_MEMORY_MB)]) if args.quick else (SIDE, [])
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scale-bench-", dir="/tmp") as tmp:
        rows = [measure_size(n, Path(tmp), side, extra) for n in sizes]
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "environment": environment.describe(),
              "mode": "quick" if args.quick else "full", "settings": extra, "sizes": rows,
              "peak_ratio": round(rows[-1]["peak_pss_mb"] / rows[0]["peak_pss_mb"], 3) if len(rows) > 1 else None,
              "estimates": estimates(rows) if len(rows) > 1 else {},
              "conversion": conversion_line(rows) if len(rows) > 1 else {}, "suite_wall_s": round(time.perf_counter() - start, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"\n{result['suite_wall_s']} s; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
