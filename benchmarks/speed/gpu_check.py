"""Issue 71's figures in one call on a GPU machine: the step, the default run, the default run at full size.

    python -m benchmarks.speed.gpu_check --out benchmarks/results/gpu.json [--commit SHA] [--skip-full]

In one process, one after another (each run of the flow a fresh ``python -m flows.mnist``, as a user starts it):

1. `benchmarks.speed.gpu_step` at batch 64 in precision ``auto``: the plain eager loop, our captured step
   (``train.cuda_graph``) and the plain step captured as one CUDA graph, each on one in-memory batch;
2. the default preset on the bundled sample: its wall time, test accuracy, and per epoch images/s and GPU busy
   (the summed spans of the epoch's steps on the GPU, from CUDA events, over the epoch's training seconds);
3. the default preset on a 60,000-image mirror (`benchmarks.data.full_size.make_mirror`): its wall time.

``pipeline_img_s`` is the median images/s of the default run's epochs after the first (the first captures the
graphs); ``busy`` their mean GPU busy weighted by training seconds. The JSON keeps every figure as a number
beside what it was measured on; docs/performance.md's GPU table is written from it. On a machine without a GPU
it stops before any run: no GPU figure is made up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.data.full_size import make_mirror, mirror_flags, run_flow


def epochs_after_first(history: list[dict]) -> tuple[float | None, float | None]:
    """(median images/s, busy weighted by training seconds) of the epochs after the first."""
    later = history[1:] or history
    img_s = statistics.median(row["images_per_s"] for row in later) if later else None
    timed = [row for row in later if "gpu_busy" in row]
    seconds = sum(row["epoch_train_s"] for row in timed)
    busy = sum(row["gpu_busy"] * row["epoch_train_s"] for row in timed) / seconds if seconds else None
    return img_s, busy


def step_rows(batch: int, steps: int, out: Path, variants: tuple[str, ...] = ("ours_captured", "plain_graph")) -> dict[str, dict]:
    """`benchmarks.speed.gpu_step`'s plain row and ``variants``' rows, by variant."""
    from benchmarks.speed import gpu_step

    gpu_step.main(["--device", "cuda", "--batch", str(batch), "--steps", str(steps),
                   "--variants", *variants, "--out", str(out)])
    return {row["variant"]: row for row in json.loads(out.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-full", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.speed.device_rows import device_name

    if not torch.cuda.is_available():
        print("benchmarks.speed.gpu_check: this machine has no GPU (torch.cuda.is_available() is False): nothing measured",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    result: dict = {"device": device_name("cuda"), "commit": args.commit, "torch": torch.__version__,
                    "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "batch": args.batch}

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k not in ("default_run", "full_size_run")}), flush=True)

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        flow_flags: list[str] = []
        try:
            rows = step_rows(args.batch, args.steps, work / "steps.json")
        except Exception:  # noqa: BLE001 - said in the JSON; the runs then measure the eager step
            import traceback

            result["captured_step_error"] = traceback.format_exc()[-3000:]
            save()
            rows = step_rows(args.batch, args.steps, work / "steps.json", variants=("plain_graph",))
            rows["ours_captured"] = {"images_per_s": None, "ms_per_step": None}
            flow_flags = ["--train.cuda-graph", "off"]
        result |= {"precision": rows["plain"]["precision"], "plain_eager_img_s": rows["plain"]["images_per_s"],
                   "ours_captured_step_img_s": rows["ours_captured"]["images_per_s"],
                   "plain_captured_img_s": rows["plain_graph"]["images_per_s"],
                   "step_ms": {name: row["ms_per_step"] for name, row in rows.items()}}
        save()
        try:
            default = run_flow(work / "storage", "default", flow_flags)
            (out.parent / "default.log").write_text(default.pop("stderr_tail"))
        except RuntimeError as exc:
            result["default_error"] = str(exc)[-6000:]
            save()
            return 1
        img_s, busy = epochs_after_first(default["history"])
        result |= {"pipeline_img_s": img_s, "busy": None if busy is None else round(busy, 4),
                   "default_wall_s": default["wall_s"], "test_accuracy": default["test_accuracy"],
                   "default_run": {key: default[key] for key in ("stages_s", "epochs", "epoch_s", "images_per_s", "rows")}
                   | {"gpu_busy": [row.get("gpu_busy") for row in default["history"]],
                      "step_s": [row.get("step_s") for row in default["history"]],
                      "epoch_train_s": [row.get("epoch_train_s") for row in default["history"]],
                      "report_s": [row.get("previous_report_s") for row in default["history"][1:]],
                      "checkpoint_save_s": [row.get("previous_checkpoint_save_s") for row in default["history"][1:]],
                      "data_wait_s": [row.get("data_wait_s") for row in default["history"]]}}
        if img_s:
            result |= {"pipeline_vs_plain_eager": round(img_s / result["plain_eager_img_s"], 3),
                       "pipeline_vs_plain_captured": round(img_s / result["plain_captured_img_s"], 3)}
        save()
        if args.skip_full:
            return 0
        checksums = make_mirror(work / "mirror", 60_000, 10_000)
        try:
            full = run_flow(work / "storage", "full-size", [*mirror_flags(work / "mirror", checksums), *flow_flags])
            (out.parent / "full.log").write_text(full.pop("stderr_tail"))
        except RuntimeError as exc:
            result["full_size_error"] = str(exc)[-6000:]
            save()
            return 1
        full_img_s, full_busy = epochs_after_first(full["history"])
        result |= {"full_size_wall_s": full["wall_s"], "full_size_test_accuracy_on_derived_digits": full["test_accuracy"],
                   "full_size_run": {key: full[key] for key in ("stages_s", "epochs", "epoch_s", "images_per_s", "rows")}
                   | {"img_s_after_first": full_img_s, "busy": full_busy,
                      "gpu_busy": [row.get("gpu_busy") for row in full["history"]],
                      "epoch_train_s": [row.get("epoch_train_s") for row in full["history"]],
                      "report_s": [row.get("previous_report_s") for row in full["history"][1:]]}}
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
