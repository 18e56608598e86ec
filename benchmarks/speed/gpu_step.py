"""Where a training step's time goes on a device: the plain loop, our step, our step fed by Ray Data, a CUDA graph.

    python -m benchmarks.speed.gpu_step [--device cuda] [--batch 64] [--precision auto] [--steps 200]

One process, the model ``benchmarks.build_model`` names (ResNet-18 unless ``PIPELINE_MODEL__NAME`` says
otherwise), one JSON line per variant with milliseconds per step and images/s:

* ``plain``: `benchmarks.speed.device_rows.plain_images_per_s_on`, the baseline of the GPU rows;
* ``ours``: the pipeline's own step (`training.worker.loop.train_step` on an attempt built by
  `training.worker.loop.start_attempt`: the recipe's learning rate set every step, the weight average's
  update, the epoch's loss and accuracy kept on the device) on one in-memory batch;
* ``ours_no_ema``: the same with ``ema_decay`` 0, to price the weight average alone;
* ``ours_fed``: ``ours`` with its batches from Ray Data's ``iter_torch_batches`` (to the device, pinned on a
  GPU) over an in-memory dataset of as many random rows as the steps need, as the pipeline's loop takes them
  (`training.worker.feeding.batches`: a few steps' rows at a time, cut on the device);
* ``ours_fed_per_step``: the same with one Ray Data batch a step, as the loop took them before;
* ``ours_captured``: the pipeline's step as ``train.cuda_graph`` runs it (`training.worker.captured_step.CapturedStep`:
  replayed from a CUDA graph on a GPU, after its eager warm-up steps; its eager form on a CPU), on one batch;
* ``plain_graph`` (GPU only): the plain step captured once as a CUDA graph and replayed, with the
  capturable fused AdamW: the same arithmetic without Python or kernel-launch cost per step, what the
  GPU itself takes.

When the step takes the same milliseconds at batch 64 and 512, the host (Python and kernel launches)
sets the pace, not the GPU: ``plain_graph`` shows how far below that the device's own time is.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

WARMUP: dict[str, float] = {}  # seconds of the last `_timed` call's three untimed calls (cuDNN's autotuner runs there)


def _timed(step, steps: int, sync) -> float:
    """Milliseconds per call of ``step`` over ``steps`` calls, after three untimed ones (their seconds in `WARMUP`)."""
    sync()
    start = time.perf_counter()
    for _ in range(3):
        step()
    sync()
    WARMUP["s"] = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) * 1000 / steps


def _loop_config(batch: int, precision: str, ema_decay: float, train_rows: int, threads: int, cuda_graph: str = "off") -> dict:
    from benchmarks import model_name
    from training.checkpoint.files import SEEDS_MODEL
    from training.manifests import LoopConfig

    spec = {"name": model_name(), "in_channels": SEEDS_MODEL.in_channels, "num_classes": SEEDS_MODEL.num_classes}
    return LoopConfig(model=spec, epochs=1, global_batch_size=batch, learning_rate=3e-3, weight_decay=5e-4,
                      label_smoothing=0.1, ema_decay=ema_decay, seed=0, train_rows=train_rows, torch_threads=threads,
                      precision=precision, cuda_graph=cuda_graph).model_dump()


def ours_ms(device: str, batch: int, precision: str, steps: int, ema: bool, fed: bool, threads: int = 2,
            per_step_feed: bool = False, captured: bool = False) -> float:
    """Milliseconds per step of the pipeline's step (`training.worker.loop.train_step`, or with ``captured``
    `training.worker.captured_step.CapturedStep`), on one batch or fed by Ray Data."""
    import numpy as np
    import torch

    from training.manifests import LoopConfig
    from training.worker.feeding import batches as feed
    from training.worker.loop import attach_step, start_attempt, train_step, zero_total

    target = torch.device(device)
    rows = batch * (steps + 3)
    cfg = LoopConfig.model_validate(_loop_config(batch, precision, 0.99 if ema else 0.0, rows, threads,
                                                 cuda_graph="on" if captured else "off"))
    attempt = start_attempt(cfg, 1, target, prepare=lambda model: model.to(target))
    attach_step(attempt, 1)
    if captured:
        attempt.captured.begin_epoch(0)
    shape = (batch, cfg.model["in_channels"], 28, 28)
    loss_sum, correct = zero_total(target), zero_total(target)

    def sync() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    if not fed:
        x = torch.randn(shape, device=target)
        y = torch.randint(0, cfg.model["num_classes"], (batch,), device=target)

        def step() -> None:
            nonlocal loss_sum, correct
            if captured:
                attempt.captured(x, y)
                return
            loss, right = train_step(attempt, x, y, 1e-3)
            loss_sum, correct = loss_sum + loss, correct + right

        return _timed(step, steps, sync)

    import ray.data

    def rows_of(batch: dict) -> dict:  # random images and labels for a batch of row ids, in blocks as the pipeline's
        rng = np.random.default_rng(int(batch["id"][0]))
        return {"image": rng.standard_normal((len(batch["id"]), *shape[1:]), dtype=np.float32),
                "label": rng.integers(0, cfg.model["num_classes"], len(batch["id"])), "row_id": batch["id"]}

    ds = ray.data.range(rows, override_num_blocks=max(1, rows // 2048)).map_batches(rows_of, batch_format="numpy").materialize()
    if per_step_feed:  # one Ray Data batch a step, as the loop took them before 2026-11-28
        batches = iter(ds.iter_torch_batches(batch_size=batch, device=target, pin_memory=target.type == "cuda"))
    else:
        batches = iter(feed(attempt, ds))

    def fed_step() -> None:
        nonlocal loss_sum, correct
        batch_ = next(batches)
        loss, right = train_step(attempt, batch_["image"], batch_["label"], 1e-3)
        loss_sum, correct = loss_sum + loss, correct + right

    return _timed(fed_step, steps, sync)


def plain_graph_ms(batch: int, precision: str, steps: int) -> float:
    """Milliseconds per replay of the plain step captured as one CUDA graph (GPU only)."""
    import torch

    from benchmarks import build_model
    from training.worker.device import AMP_DTYPES, images_for, prepare_for, resolve_precision

    target = torch.device("cuda")
    torch.manual_seed(0)
    resolved = resolve_precision(precision, target)
    model = prepare_for(build_model().to(target), target)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    x = images_for(torch.randn(batch, 1, 28, 28, device=target), target)
    y = torch.randint(0, 10, (batch,), device=target)
    dtype = AMP_DTYPES.get(resolved)

    def body() -> torch.Tensor:
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None, cache_enabled=False):
            loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        body()
    return _timed(graph.replay, steps, torch.cuda.synchronize)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", nargs="+", default=None,
                        help="only these (plain is always measured): ours ours_no_ema ours_captured ours_fed ours_fed_per_step plain_graph")
    parser.add_argument("--out", default=None, help="also write the rows as one JSON list to this file")
    args = parser.parse_args(argv)

    import ray

    from benchmarks.speed.device_rows import device_name, plain_images_per_s_on

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    written: list[dict] = []
    try:
        for batch in args.batch:
            plain = plain_images_per_s_on(args.device, args.steps, batch, args.precision)
            runs = {"ours": lambda: ours_ms(args.device, batch, args.precision, args.steps, ema=True, fed=False),
                    "ours_no_ema": lambda: ours_ms(args.device, batch, args.precision, args.steps, ema=False, fed=False),
                    "ours_captured": lambda: ours_ms(args.device, batch, args.precision, args.steps, ema=True, fed=False,
                                                     captured=True),
                    "ours_fed": lambda: ours_ms(args.device, batch, args.precision, args.steps, ema=True, fed=True),
                    "ours_fed_per_step": lambda: ours_ms(args.device, batch, args.precision, args.steps, ema=True, fed=True,
                                                         per_step_feed=True)}
            if args.device.startswith("cuda"):
                runs["plain_graph"] = lambda: plain_graph_ms(batch, args.precision, args.steps)
            if args.variants:
                runs = {name: run for name, run in runs.items() if name in args.variants}
            rows = [("plain", batch * 1000 / plain["images_per_s"], None)]
            for name, run in runs.items():
                WARMUP.clear()
                rows.append((name, run(), WARMUP.get("s")))
            for name, ms, warmup in rows:
                row = {"device": device_name(args.device), "batch": batch, "precision": plain["precision"],
                       "variant": name, "ms_per_step": round(ms, 3), "images_per_s": round(batch * 1000 / ms, 1),
                       "first_3_steps_s": None if warmup is None else round(warmup, 3)}
                written.append(row)
                print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(written, indent=1) + "\n")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
