"""How long a nightly run on unchanged data takes to end as "nothing new to train on".

    python -m benchmarks.start.nothing_new --images 10000

Two workloads, each given a champion trained (as far as the check can tell) on its data with the
``nightly`` preset's recipe: the bundled MNIST sample, and a folder of ``--images`` RGB 64x64 PNGs
(`benchmarks.data.listing.write_folder`, converted once so its dataset is on storage). The champion's
dataset is the real conversion; its weights are a freshly built model's, which the check never
reads. Then, on the unchanged data, the nightly run is timed twice:

- ``flow``: the flow called in this process against a Prefect server already up: from the call to
  its return (what a deployment's run costs once its process has started), the median of
  ``--repeat`` runs after a first one (imports, the listing cache's first decode checks);
- ``command``: ``python -m flows.mnist|train --preset nightly`` as a terminal runs it, with its
  temporary Prefect server (what a person waits), a listing cache already warm from the flow run.

``flow, no listing cache``: the same with the folder's listing cache deleted before each run.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from benchmarks.data.listing import cpu_name, write_folder


def make_champion(config, layout, model_spec) -> None:
    """Convert ``config``'s data as its run would and promote a model with ``config`` as its recipe."""
    import torch

    from dataset.formats.parquet import image_record
    from storage_io import atomic_write_bytes, join
    from tasks.download import download
    from tasks.to_parquet import to_parquet
    from training.champion import registry, registry_files
    from training.checkpoint.files import MODEL_FILE
    from training.model.catalog import build_model

    raw = download.fn(config.download, layout)
    dataset = to_parquet.fn(raw, config.parquet, layout, config.transform.image_size, config.workload)
    buffer = io.BytesIO()
    torch.save(build_model(model_spec[0], in_channels=model_spec[1], num_classes=model_spec[2]).state_dict(), buffer)
    checkpoint = join(layout.runs_dir, "champion", "checkpoint_000000")
    atomic_write_bytes(join(checkpoint, MODEL_FILE), buffer.getvalue())
    candidate = registry.Candidate(
        run_name="champion", checkpoint=checkpoint, accuracy=0.9, passed_gate=True, dataset_dir=dataset.directory,
        data_hash=registry_files.data_hash(dataset.directory), raw_dir=raw.directory, config=config.model_dump(mode="json"),
        data_spec={"image": image_record(tuple(dataset.image_shape)), "classes": list(dataset.classes)},
    )
    assert registry.promote(layout, config.registry_name, candidate).promoted


def nightly(values: dict):
    from pipeline_config import PipelineConfig
    from pipeline_config.settings import preset_with

    return PipelineConfig.model_validate(preset_with("nightly", values))


def time_flow(flow, config) -> float:
    started = time.perf_counter()
    state = flow(config, return_state=True)
    seconds = time.perf_counter() - started
    assert state.is_completed() and "nothing new to train on" in (state.message or ""), state.message
    return seconds


def time_command(module: str, args: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", module, "--preset", "nightly", *args], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    assert done.returncode == 0 and "nothing new to train on" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    return seconds


def measure(images: int, repeat: int = 3) -> list[tuple[str, str, float]]:
    from flows.mnist import mnist_pipeline
    from flows.train import train_pipeline
    from runner.prefect_server.api import prefect_api
    from storage_io import StorageLayout

    work = Path(tempfile.mkdtemp(prefix="nothing-new-bench-", dir="/tmp"))
    rows = []
    try:
        root = str(work / "storage")
        mnist = nightly({"storage_root": root, "download": {"source": "sample"}})
        folder = write_folder(work / "images", images)
        shapes = nightly({"storage_root": root, "workload": "noise", "download": {"source": "folder", "path": str(folder)},
                          "model": {"name": "training.model.catalog:small_cnn"}})
        layout = StorageLayout.create(root, "setup")
        make_champion(mnist, layout, ("resnet18", 1, 10))
        make_champion(shapes, layout, ("training.model.catalog:small_cnn", 3, 10))
        with prefect_api():
            time_flow(mnist_pipeline, mnist), time_flow(train_pipeline, shapes)  # the first of each: imports, caches
            rows.append(("MNIST sample", "flow", median(time_flow(mnist_pipeline, mnist) for _ in range(repeat))))
            rows.append((f"{images:,} images", "flow", median(time_flow(train_pipeline, shapes) for _ in range(repeat))))
            cold = []
            for _ in range(repeat):
                shutil.rmtree(work / "storage" / "listings", ignore_errors=True)
                cold.append(time_flow(train_pipeline, shapes))
            rows.append((f"{images:,} images", "flow, no listing cache", median(cold)))
        common = ["--storage-root", root]
        rows.append(("MNIST sample", "command", time_command("flows.mnist", [*common, "--download.source", "sample"], work)))
        folder_args = ["--workload", "noise", "--download.source", "folder", "--download.path", str(folder),
                       "--model.name", "training.model.catalog:small_cnn"]
        rows.append((f"{images:,} images", "command", time_command("flows.train", [*common, *folder_args], work)))
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000, help="PNG files in the folder workload (at least 50)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each flow row (the median is shown)")
    args = parser.parse_args(argv)
    if args.images < 50:
        parser.error("--images must be at least 50")
    rows = measure(args.images, args.repeat)
    print(f"nightly run on unchanged data, {cpu_name()}")
    print(f"{'workload':<16} {'timed':<24} {'seconds':>8}")
    for workload, timed, seconds in rows:
        print(f"{workload:<16} {timed:<24} {seconds:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
