"""The GPU rows of ``benchmarks.run``: our training stage on the GPU against a plain loop on the same GPU.

`measure` runs when the machine has a GPU (``torch.cuda.is_available()``); on a machine without one it
returns a row that says so, and ``benchmarks.run`` writes that row instead. `device_name` names the
device the run had (the GPU, else the CPU), which the JSON records.

* **Throughput**: our training stage (``tasks.train``, 1 Ray Train worker holding the GPU,
  ``train.use_gpu: always``, ``train.precision: auto``) on a data source (the full-size mirror of
  ``benchmarks.data.full_size`` in ``benchmarks.run``), the median images/s of its epochs after the first,
  against a plain single-process loop of the same model on the same device, at the same batch and
  the same precision (`plain_images_per_s_on`: the precision ``auto`` resolves to, the weights and
  batches channels-last as ours, in-memory random tensors already on the device), run before and
  after ours. Goal: >= 0.9x (issue 46).
* **GPU busy %** while our epochs ran: ``nvidia-smi``'s utilization, sampled every 0.5 s
  (`BusySampler`; None where ``nvidia-smi`` is missing).
* **Time to accuracy** (`benchmarks.speed.accuracy.measure_time_to_accuracy`): ``benchmarks.speed.accuracy`` with both sides on the
  GPU, the default recipe at precision ``auto`` on the full-size mirror, seconds to 99% held-out
  accuracy (full mode), against the plain loop with the same recipe on the same GPU.

The functions take the device as an argument: the quick mode of ``benchmarks.run`` (what
tests/test_benchmarks.py runs) runs the row on the CPU of a machine without a GPU, to prove its
code, and names the CPU as its device; the full mode runs it on a GPU only. No GPU figure is ever
made up where there is no GPU.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path


def device_name(device: str | None = None) -> str:
    """``device`` (unset: the GPU when this process sees one, else the CPU) in words: ``GPU: <name> (xN)``
    (``torch.cuda.get_device_name``) or ``CPU: <model>, family F model M, <vector extensions>`` ("AMD
    EPYC" alone names CPUs 3-4x apart in training speed)."""
    import torch

    from reporting.environment import cpu_details, cpu_model, cpu_suffix

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return f"GPU: {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"
    return f"CPU: {cpu_model() or 'unknown'}{cpu_suffix(cpu_details())}"


def default_device() -> str:
    """``cuda`` when this process sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def plain_images_per_s_on(device: str, steps: int, batch: int, precision: str = "auto", threads: int = 2) -> dict:
    """A plain single-process loop on ``device``: the benchmark model, fused AdamW, label smoothing, one
    in-memory batch of random tensors; ``precision`` as ``train.precision`` resolves it there (autocast
    for bf16 or fp16, with a gradient scaler for fp16), channels-last weights and batches on a GPU.
    Two warm-up steps are not timed; the device is synchronized before each clock read."""
    import torch

    from benchmarks import build_model
    from training.model.catalog import configure_cpu
    from training.worker.device import (
        autocast,
        backward_and_step,
        grad_scaler,
        images_for,
        prepare_for,
        resolve_precision,
    )

    target = torch.device(device)
    configure_cpu(threads)  # as our training workers do: the same denormal flush and heap settings
    torch.manual_seed(0)
    resolved = resolve_precision(precision, target)
    model = prepare_for(build_model().to(target), target)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = grad_scaler(resolved, target)
    x = images_for(torch.randn(batch, 1, 28, 28, device=target), target)
    y = torch.randint(0, 10, (batch,), device=target)

    def sync() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    model.train()
    for step in range(steps + 2):
        if step == 2:
            sync()
            start = time.perf_counter()
        with autocast(resolved, target):
            loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        backward_and_step(loss, optimizer, scaler)
    sync()
    return {"images_per_s": steps * batch / (time.perf_counter() - start), "precision": resolved}


class BusySampler:
    """``nvidia-smi``'s GPU utilization (%) every ``every`` seconds while in the ``with`` block; `result` is
    {"mean", "max", "samples"}, or None where ``nvidia-smi`` is missing or said nothing."""

    def __init__(self, every: float = 0.5):
        self.every, self.samples, self._stop = every, [], threading.Event()
        self._tool = shutil.which("nvidia-smi")
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                out = subprocess.run([self._tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5, check=True).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            values = [float(v) for v in out.split() if v.replace(".", "", 1).isdigit()]
            if values:
                self.samples.append(statistics.fmean(values))

    def __enter__(self) -> BusySampler:
        if self._tool:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def result(self) -> dict | None:
        if not self.samples:
            return None
        return {"mean": round(statistics.fmean(self.samples), 1), "max": round(max(self.samples), 1), "samples": len(self.samples)}


def plain_images_per_s(steps: int, batch: int, threads: int) -> float:
    """A plain single-process loop on in-memory tensors: the same model, optimizer and batch, fp32 on the CPU
    (`plain_images_per_s_on`, the GPU rows' loop)."""
    return plain_images_per_s_on("cpu", steps, batch, precision="fp32", threads=threads)["images_per_s"]


def measure(work: Path, download: dict, epochs: int, steps: int, batch: int = 512, device: str | None = None) -> dict:
    """The GPU throughput row: plain loop, ours (``epochs`` epochs on ``download`` at global batch ``batch``,
    GPU busy % sampled), plain loop again. ``device``: unset, the GPU when there is one, else a row saying
    that there is none; ``"cpu"`` runs the same row on the CPU (our stage then trains with ``use_gpu: never``)."""
    import torch

    from benchmarks.speed.throughput import ray_train_images_per_s

    name = "training throughput on the device (1 worker, precision auto)"
    if device is None:
        if not torch.cuda.is_available():
            return {"benchmark": name, "device": device_name(), "skipped": "no GPU on this machine (torch.cuda.is_available() is False)"}
        device = "cuda"
    use_gpu = "always" if device.startswith("cuda") else "never"
    plains = [plain_images_per_s_on(device, steps, batch)]
    with BusySampler() as busy:
        ours = ray_train_images_per_s(work, epochs, workers=1, download=download, batch=batch,
                                      train_fields={"use_gpu": use_gpu, "precision": "auto"})
    plains.append(plain_images_per_s_on(device, steps, batch))
    plain = statistics.median(p["images_per_s"] for p in plains)
    return {
        "benchmark": name, "device": device_name(device),
        "batch": batch, "precision": plains[0]["precision"], "train_rows": ours["train_rows"], "epochs": ours["epochs"],
        "baseline": "plain PyTorch loop on the same device, same model, batch and precision, in-memory tensors",
        "baseline_images_per_s": round(plain, 1), "baseline_runs": [round(p["images_per_s"], 1) for p in plains],
        "ours_images_per_s": round(ours["images_per_s"], 1), "ours_epochs": [round(r, 1) for r in ours["epochs_images_per_s"]],
        "ratio": round(ours["images_per_s"] / plain, 3), "gpu_busy_percent": busy.result(), "goal": ">= 0.9x",
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.speed.device_rows [--device cpu|cuda] [--steps N] [--batch N ...] [--precision P ...]``:
    the plain loop alone, at every batch and precision given, each with the GPU's busy % (a JSON line each).

    What a GPU check compares the pipeline's epochs against: the default run trains at batch 64 with
    ``train.precision: auto`` (bf16 on a GPU that has it)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="the plain loop of the GPU rows, on one device")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[512])
    parser.add_argument("--precision", nargs="+", default=["auto"], choices=["auto", "bf16", "fp16", "fp32"])
    args = parser.parse_args(argv)
    for batch in args.batch:
        for precision in args.precision:
            with BusySampler(every=0.2) as busy:
                result = plain_images_per_s_on(args.device, args.steps, batch, precision)
            print(json.dumps({"device": device_name(args.device), "batch": batch, "precision": result["precision"],
                              "steps": args.steps, "images_per_s": round(result["images_per_s"], 1),
                              "gpu_busy_percent": busy.result()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
