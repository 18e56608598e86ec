"""One training step split into its parts, the recipe's optimizer and weight average against PyTorch's defaults.

    python -m benchmarks.speed.step_parts [batch ...]   # default 64 128; prints one JSON object

The model ``benchmarks.build_model`` names (ResNet-18 unless ``PIPELINE_MODEL__NAME`` says otherwise),
2 torch threads with denormals flushed (``training.model.catalog.configure_cpu``, as our workers), random
in-memory digits. For each batch size, in one process and alternating, the milliseconds of:

* ``forward_backward_ms``: the forward pass, the loss and the backward pass;
* ``adamw_default_ms`` / ``adamw_fused_ms``: one ``AdamW.step`` with PyTorch's default kernel
  (per tensor, or ``foreach`` where PyTorch picks it) and with ``fused=True`` (``training.worker.recipe.make_optimizer``);
* ``ema_per_tensor_ms`` / ``ema_grouped_ms``: one update of the weights' moving average, averaged a
  tensor at a time (``AveragedModel(avg_fn=...)``, the recipe before 2026-11-26) and a dtype group at
  a time (``training.worker.recipe.make_ema``).

A part's figure is the median of ``rounds`` rounds of ``steps`` timed calls each, after two
untimed calls. ``step_ratio`` is a whole step with the old parts over a whole step with ours.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def _median_ms(call, steps: int, rounds: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            call()
        times.append((time.perf_counter() - start) / steps * 1000)
    return round(statistics.median(times), 2)


def measure(batch: int, steps: int = 20, rounds: int = 3, threads: int = 2) -> dict:
    import torch
    from torch.optim.swa_utils import AveragedModel

    from benchmarks import build_model, model_name
    from training.model.catalog import configure_cpu
    from training.worker.recipe import ema_decay_at, make_ema, make_optimizer

    configure_cpu(threads)
    torch.manual_seed(0)
    model = build_model()
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    images, labels = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

    def forward_backward() -> None:
        model.zero_grad(set_to_none=False)
        criterion(model(images), labels).backward()

    forward_backward()  # gradients for the optimizers to step with
    default = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=5e-4)
    fused = make_optimizer(model, 1e-6, 5e-4)

    def per_tensor(averaged: torch.Tensor, current: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        d = ema_decay_at(0.99, int(updates))
        return averaged * d + current * (1.0 - d)

    old_ema = AveragedModel(model, avg_fn=per_tensor, use_buffers=True)
    new_ema = make_ema(model, 0.99)
    parts = {
        "forward_backward_ms": forward_backward,
        "adamw_default_ms": default.step,
        "adamw_fused_ms": fused.step,
        "ema_per_tensor_ms": lambda: old_ema.update_parameters(model),
        "ema_grouped_ms": lambda: new_ema.update_parameters(model),
    }
    result: dict = {"model": model_name(), "batch": batch, "threads": threads, "steps": steps, "rounds": rounds}
    result |= {name: _median_ms(call, steps, rounds) for name, call in parts.items()}
    old = result["forward_backward_ms"] + result["adamw_default_ms"] + result["ema_per_tensor_ms"]
    new = result["forward_backward_ms"] + result["adamw_fused_ms"] + result["ema_grouped_ms"]
    result["step_ratio"] = round(old / new, 3)
    return result


def main(argv: list[str]) -> None:
    from reporting import environment

    batches = [int(arg) for arg in argv] or [64, 128]
    print(json.dumps({"environment": environment.describe(), "rows": [measure(batch) for batch in batches]}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
