"""Benchmarks: our pipeline side by side with the seeds' approach and a plain PyTorch loop, as ratios.

    python -m benchmarks.run            # full: sample, 60,000 and 1,000,000 rows; prints a table
    python -m benchmarks.run --quick    # small sizes, one repetition (what the test runs)

Every figure is measured in the same run as its baseline, repetitions alternate baseline and
ours, and the table quotes medians and ratios: this machine is shared and absolute times drift.
Results go to ``benchmarks/results/latest.json`` (or ``--out``).

Rows:
* data path: IDX files -> Parquet -> Ray Data normalize, ours (streaming pyarrow writer,
  vectorized ``map_batches``) against the seeds' approach (pandas lists of lists, ``from_pandas``,
  ``write_parquet``, per-row PIL ``ToTensor``/``Normalize`` through ``ds.map``);
* conversion memory: peak RSS of our conversion of 1,000,000 rows, in a fresh process;
* fixed overhead: imports, the temporary Prefect server and a local Ray (started side by side,
  as the CLI does) and an empty Ray Train worker group, in a fresh process (``benchmarks/overhead.py``);
* training throughput: images/s of our training loop (Ray Train, 1 worker) against a plain
  single-process loop on in-memory tensors, same model, batch and threads; ``train.mode=single``
  (our loop and data pipeline without Ray Train) in between splits the gap into data and distribution;
* time to accuracy: seconds until the held-out accuracy first reaches 98%, our training stage
  against a plain loop with the same recipe (``benchmarks/accuracy.py``);
* tune stage, per trial: the tune stage with one trial of the default recipe against the
  training stage with the same recipe and epochs (``benchmarks/tune_trial.py``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import accuracy, tune_trial
from dataset.idx import read_idx
from reporting import environment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
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
    from dataset.parquet import ParquetDataset, convert
    from dataset.transform import TransformSpec, prepare_batch, read_split
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
        "from pipeline_config import ParquetConfig; from dataset.parquet import convert\n"
        "base = hwm()\n"
        "t = time.perf_counter(); convert(Path(sys.argv[1]), Path(sys.argv[2]), ParquetConfig())\n"
        "print(base, hwm(), time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(raw), str(work / f"pq-{rows}")], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    base_kb, peak_kb, seconds = out.stdout.split()
    return {"rows": rows, "peak_rss_mb": round(int(peak_kb) / 1024, 1), "rss_before_mb": round(int(base_kb) / 1024, 1),
            "seconds": round(float(seconds), 2), "rows_per_s": round(rows / float(seconds))}


def plain_images_per_s(steps: int, batch: int, threads: int) -> float:
    """A plain single-process loop on in-memory tensors: the same model, optimizer and batch."""
    import torch

    from training.model import build_resnet18

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_resnet18()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    model.train()
    for step in range(steps + 2):
        if step == 2:  # warm-up steps are not timed
            start = time.perf_counter()
        loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps * batch / (time.perf_counter() - start)


def ray_train_images_per_s(work: Path, epochs: int, mode: str = "distributed", workers: int = 1) -> dict:
    """Our training stage (Ray Train with ``workers`` workers, or ``train.mode=single``; same global batch) on the bundled sample.

    Returns the median images/s of its epochs after the first (the first pays the data
    pipeline's cold start), or the only epoch's.
    """
    from benchmarks.stages import stage_inputs
    from pipeline_config import PipelineConfig
    from tasks.train import train

    config = PipelineConfig.model_validate(
        {"download": {"source": "sample"}, "train": {"epochs": epochs, "ema_decay": 0.0, "num_workers": workers, "mode": mode}}
    )
    spec, layout = stage_inputs(config, work, f"bench-{mode}-{workers}")
    start = time.perf_counter()
    trained = train.fn(spec, config.train, layout)
    history = sorted(trained.history, key=lambda row: row["epoch"])
    rates = [row["images_per_s"] for row in history[1:] or history]
    return {"images_per_s": statistics.median(rates), "epochs_images_per_s": rates, "stage_seconds": time.perf_counter() - start}


def fixed_overhead() -> dict:
    """What every run pays before any work, part by part, in a fresh process (benchmarks/overhead.py)."""
    probe = subprocess.run([sys.executable, "-m", "benchmarks.overhead"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        raise RuntimeError(f"benchmarks.overhead failed: {probe.stderr[-2000:]}")
    return json.loads(probe.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    parser.add_argument("--out", default=str(HERE / "results" / "latest.json"), help="where to write the JSON")
    args = parser.parse_args(argv)

    import ray

    from flows.runtime import LOCAL_RAY_SYSTEM_CONFIG, ray_train_env  # Ray as a run starts it

    os.environ.update(ray_train_env())  # the training stage's fit() runs in this process here

    sizes = [(4000, 2)] if args.quick else [(4000, 3), (60_000, 1)]  # (training rows, repetitions)
    rss_rows = 50_000 if args.quick else 1_000_000
    rows_out: list[dict] = []
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    try:
        with tempfile.TemporaryDirectory(prefix="mnist-bench-") as tmp:
            work = Path(tmp)
            for n, reps in sizes:
                raw = write_idx_dir(work / f"raw-{n}", n, 1000)
                seeds, ours = [], []
                ours_data_path(raw, work / "warm")  # warm-up: Ray Data workers and imports
                for rep in range(reps):  # alternate baseline and ours
                    seeds.append(seeds_data_path(raw, work / f"seeds-{n}-{rep}"))
                    ours.append(ours_data_path(raw, work / f"ours-{n}-{rep}"))
                s, o = statistics.median(seeds), statistics.median(ours)
                rows_out.append({"benchmark": "data path", "rows": n, "baseline": "seeds' pandas + per-row PIL",
                                 "baseline_s": round(s, 2), "ours_s": round(o, 2), "ours_rows_per_s": round(n / o),
                                 "baseline_rows_per_s": round(n / s), "speedup": round(s / o, 2), "reps": reps,
                                 "goal": ">= 20x at 60,000 rows"})
            rows_out.append({"benchmark": "conversion peak RSS", **conversion_peak_rss_mb(rss_rows, work),
                             "goal": "<= 1,500 MB at 1,000,000 rows"})
            ray.shutdown()  # training starts its own local Ray below, as the flow's stage would
            rows_out.append({"benchmark": "fixed overhead", **fixed_overhead(), "goal": "<= 15 s in total"})
            steps = 5 if args.quick else 30
            plains = [plain_images_per_s(steps=steps, batch=128, threads=2)]
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
            # Plain loop and ours alternate; the baseline is the plain loop's median over the run.
            epochs = 1 if args.quick else 3
            single = ray_train_images_per_s(work, epochs, mode="single")
            plains.append(plain_images_per_s(steps=steps, batch=128, threads=2))
            ours_train = ray_train_images_per_s(work, epochs)
            plains.append(plain_images_per_s(steps=steps, batch=128, threads=2))
            two_workers = ray_train_images_per_s(work, epochs, workers=2)
            plain = statistics.median(plains)
            # The gap in two parts: plain loop -> single mode is the data pipeline (Ray Data reading,
            # augmenting and batching while training runs on the same cores); single mode -> Ray Train
            # is distribution (worker process, DDP wrapper, reporting and checkpointing).
            rows_out.append({"benchmark": "training throughput, train.mode=single (no Ray Train)",
                             "baseline": "plain PyTorch loop, in-memory tensors", "baseline_images_per_s": round(plain, 1),
                             "ours_images_per_s": round(single["images_per_s"], 1),
                             "ratio": round(single["images_per_s"] / plain, 3), "goal": "(gap breakdown)"})
            rows_out.append({"benchmark": "training throughput (1 worker x 2 threads, batch 128)",
                             "baseline": "plain PyTorch loop, in-memory tensors", "baseline_images_per_s": round(plain, 1),
                             "ours_images_per_s": round(ours_train["images_per_s"], 1),
                             "ratio": round(ours_train["images_per_s"] / plain, 3),
                             "ratio_to_single_mode": round(ours_train["images_per_s"] / single["images_per_s"], 3),
                             "baseline_runs": [round(p, 1) for p in plains], "ours_epochs": ours_train["epochs_images_per_s"],
                             "goal": ">= 0.9x"})
            rows_out.append({"benchmark": "training throughput (2 workers x 1 thread, DDP, global batch 128)",
                             "baseline": "plain PyTorch loop, in-memory tensors", "baseline_images_per_s": round(plain, 1),
                             "ours_images_per_s": round(two_workers["images_per_s"], 1),
                             "ratio": round(two_workers["images_per_s"] / plain, 3), "goal": ">= 0.9x"})
            # Full: the default recipe over 10 epochs to 98% (a shorter one-cycle schedule than the
            # default 30 epochs, so both sides finish in minutes). Quick: one epoch to 50%, which
            # only exercises the code.
            rows_out.append(accuracy.measure(work, epochs=1 if args.quick else 10, target=0.5 if args.quick else 0.98))
            # Tune's price per trial: one trial of the default recipe against the training stage.
            rows_out.append(tune_trial.measure(work, epochs=1 if args.quick else 3, reps=1 if args.quick else 2))
    finally:
        ray.shutdown()
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "environment": environment.describe(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "mode": "quick" if args.quick else "full",
        "rows": rows_out,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(rows_out))
    print(f"\nwritten to {out}")
    return 0


def format_table(rows: list[dict]) -> str:
    lines = ["| benchmark | size | baseline | ours | ratio | goal |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["benchmark"] == "data path":
            lines.append(f"| data path | {r['rows']:,} rows | {r['baseline_s']} s ({r['baseline_rows_per_s']:,} rows/s) | "
                         f"{r['ours_s']} s ({r['ours_rows_per_s']:,} rows/s) | {r['speedup']}x faster | {r['goal']} |")
        elif r["benchmark"] == "conversion peak RSS":
            lines.append(f"| conversion peak RSS | {r['rows']:,} rows | | {r['peak_rss_mb']} MB, {r['rows_per_s']:,} rows/s | | {r['goal']} |")
        elif r["benchmark"] == "fixed overhead":
            parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v} s" for k, v in r.items() if k.endswith("_s") and k != "total_s")
            group = ", ".join(f"{k[:-2].replace('_', ' ')} {v} s" for k, v in (r.get("worker_group_parts") or {}).items())
            lines.append(f"| fixed overhead | | | {r['total_s']} s ({parts}; worker group: {group}) | | {r['goal']} |")
        elif r["benchmark"] == "time to accuracy":
            def reached(seconds, epoch, history):
                return f"{seconds} s (epoch {epoch + 1})" if seconds is not None else f"not reached (best {max(history):.4f})"

            lines.append(f"| time to {r['target']:.0%} validation accuracy | {r['epochs']} epochs, {r['workers']} worker(s) | "
                         f"{reached(r['baseline_s'], r['baseline_epoch'], r['baseline_history'])} | "
                         f"{reached(r['ours_s'], r['ours_epoch'], r['ours_history'])} | "
                         f"{'' if r['ratio'] is None else str(r['ratio']) + 'x'} | {r['goal']} |")
        elif r["benchmark"] == "tune stage, per trial":
            lines.append(f"| tune stage, per trial | 1 trial, {r['epochs']} epoch(s), {r['workers']} worker | "
                         f"{r['baseline_s']} s (training stage) | {r['ours_s']} s (tune stage) | "
                         f"{r['ratio']}x (+{r['overhead_per_trial_s']} s per trial) | {r['goal']} |")
        else:
            lines.append(f"| {r['benchmark']} | | {r['baseline_images_per_s']} img/s | {r['ours_images_per_s']} img/s | "
                         f"{r['ratio']}x | {r['goal']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
