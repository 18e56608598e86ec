"""The default run at full MNIST size, offline: wall time by stage, seconds per epoch, peak memory.

    python -m benchmarks.data.full_size                 # 60,000 train / 10,000 test, the default recipe
    python -m benchmarks.data.full_size --train 6000 --test 1000 -- --train.epochs 1   # smaller, extra CLI flags

Full MNIST cannot be downloaded here, so a full-size mirror is made from the bundled digits:
every image is a bundled digit of the same split moved by up to two pixels (so no two rows need
be byte-identical), written as the four IDX ``.gz`` files and served as ``download.source:
mirror`` from a ``file://`` URL with its own checksums. The run is ``python -m flows.mnist`` in a
fresh process with its defaults, so ``train.max_images`` picks the epochs as it does for real
full MNIST (3). Peak memory is each process's high-water mark (``VmHWM`` in ``/proc``), polled
while the run goes: the driver (the CLI process) and the Ray Train worker. Test accuracy on
these derived digits says the run works, not how well the recipe does on real MNIST.

``benchmarks.run`` makes one mirror per invocation (`make_mirror`), reads it in its other
full-size rows (`mirror_download` is the ``download`` config section that names it) and calls
`measure`: this run with ``--train.epochs 1`` and the gate off (``--evaluate.min-accuracy 0``;
the row is about time and memory), split by stage, as a table row.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the repository
SAMPLE = ROOT / "data" / "mnist-sample"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CHECKSUM_FLAGS = {
    "train-images-idx3-ubyte.gz": "train-images",
    "train-labels-idx1-ubyte.gz": "train-labels",
    "t10k-images-idx3-ubyte.gz": "test-images",
    "t10k-labels-idx1-ubyte.gz": "test-labels",
}


def read_idx(path: Path) -> np.ndarray:
    """A gzipped IDX file as a uint8 array of its shape."""
    data = gzip.decompress(path.read_bytes())
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def shifted_copies(images: np.ndarray, labels: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` digits drawn from ``images`` (cycling through all of them), each moved by up to 2 pixels."""
    picks = np.concatenate([rng.permutation(len(images)) for _ in range(-(-n // len(images)))])[:n]
    out = np.zeros((n, 28, 28), np.uint8)
    shifts = rng.integers(-2, 3, size=(n, 2))
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    for i, (pick, (dy, dx)) in enumerate(zip(picks, shifts)):
        out[i] = padded[pick, 2 + dy : 30 + dy, 2 + dx : 30 + dx]
    return out, labels[picks]


def make_mirror(folder: Path, n_train: int = 60_000, n_test: int = 10_000, seed: int = 0) -> dict[str, str]:
    """Write a full-size mirror derived from the bundled sample; return {file name: sha256}."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    checksums = {}
    for split, n in (("train", n_train), ("test", n_test)):
        image_file, label_file = FILES[split]
        images, labels = shifted_copies(read_idx(SAMPLE / image_file), read_idx(SAMPLE / label_file), n, rng)
        for name, array in ((image_file, images), (label_file, labels)):
            content = gzip.compress(idx_bytes(array), compresslevel=6, mtime=0)
            (folder / name).write_bytes(content)
            checksums[name] = hashlib.sha256(content).hexdigest()
    return checksums


def mirror_flags(folder: Path, checksums: dict[str, str]) -> list[str]:
    """The CLI flags that make ``folder`` the run's data source."""
    flags = ["--download.source", "mirror", "--download.mirror-url", folder.resolve().as_uri() + "/"]
    for name, digest in checksums.items():
        flags += [f"--download.mirror-sha256.{CHECKSUM_FLAGS[name]}", digest]
    return flags


def mirror_download(folder: Path, checksums: dict[str, str]) -> dict:
    """The ``download`` config section that makes ``folder`` the run's data source (as `mirror_flags` does on the CLI)."""
    return {"source": "mirror", "mirror_url": folder.resolve().as_uri() + "/",
            "mirror_sha256": {CHECKSUM_FLAGS[name].replace("-", "_"): digest for name, digest in checksums.items()}}


class PeakMemory:
    """Polls ``/proc`` for the high-water RSS of the driver (a pid) and of Ray Train workers (by process title)."""

    def __init__(self, driver_pid: int, poll_s: float = 0.5):
        self.driver_pid, self.poll_s = driver_pid, poll_s
        self.peak_mb = {"driver": 0.0, "train_worker": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _hwm_mb(pid: int) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def _poll(self) -> None:
        self.peak_mb["driver"] = max(self.peak_mb["driver"], self._hwm_mb(self.driver_pid))
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::RayTrainWorker"):
                self.peak_mb["train_worker"] = max(self.peak_mb["train_worker"], self._hwm_mb(int(entry.name)))

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def run_default(mirror: Path, checksums: dict[str, str], storage: Path, extra: list[str]) -> dict:
    """One ``python -m flows.mnist`` run on the mirror; its summary, wall time, epochs and peak memory."""
    return run_flow(storage, "full-size", [*mirror_flags(mirror, checksums), *extra])


def run_flow(storage: Path, run_name: str, flags: list[str]) -> dict:
    """One ``python -m flows.mnist`` run in a fresh process with ``flags``; its summary, wall time, epochs and peak memory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    args = [sys.executable, "-m", "flows.mnist", "--storage-root", str(storage), "--run-name", run_name, "--json", *flags]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        with PeakMemory(process.pid) as memory:
            code = process.wait()
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code != 0:
        raise RuntimeError(f"the run failed (exit {code}):\n{stderr[-3000:]}")
    summary = json.loads(stdout[stdout.index("{") : stdout.rindex("}") + 1])
    history = [json.loads(line) for line in (storage / "runs" / run_name / "history.jsonl").read_text().splitlines()]
    config = json.loads((storage / "runs" / run_name / "summary.json").read_text())["config"]  # not in the printed summary
    return {
        "wall_s": round(wall, 1),
        "stages_s": {name: stage["seconds"] for name, stage in summary["stages"].items()},
        "epochs": summary["epochs"],
        "workers": config["train"]["num_workers"],
        "epoch_s": [round(row["epoch_seconds"], 1) for row in history],
        "images_per_s": [round(row["images_per_s"], 1) for row in history],
        "history": history,
        "rows": summary["data"]["rows"],
        "test_accuracy_on_derived_digits": summary["test_accuracy"],
        "test_accuracy": summary["test_accuracy"],
        "peak_rss_mb": {role: round(mb) for role, mb in memory.peak_mb.items()},
        "environment": summary.get("environment"),
        "stderr_tail": stderr[-4000:],
    }


def measure(mirror: Path, checksums: dict[str, str], storage: Path, epochs: int, extra: tuple[str, ...] = ()) -> dict:
    """One row: `run_default` with ``--train.epochs epochs`` (and ``extra`` flags), split by stage."""
    result = run_default(mirror, checksums, storage, ["--train.epochs", str(epochs), *extra])
    for key in ("environment", "history", "test_accuracy", "stderr_tail"):  # the suite's JSON describes the machine once
        result.pop(key, None)
    # The rest of the wall time: imports, the temporary Prefect server and the local Ray, shutdown.
    outside = round(result["wall_s"] - sum(result["stages_s"].values()), 1)
    return {"benchmark": "full-size default flow, by stage", **result, "outside_stages_s": outside,
            "cli_flags": ["--train.epochs", str(epochs), *extra], "goal": "(split reported)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=60_000, help="training images in the mirror")
    parser.add_argument("--test", type=int, default=10_000, help="test images in the mirror")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "full_size.json"), help="where to write the JSON")
    parser.add_argument("cli", nargs="*", help="extra flags for python -m flows.mnist (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mnist-full-") as tmp:
        work = Path(tmp)
        checksums = make_mirror(work / "mirror", args.train, args.test)
        result = run_default(work / "mirror", checksums, work / "storage", args.cli)
        result.pop("stderr_tail")
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "mirror": {"train": args.train, "test": args.test}} | result
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
