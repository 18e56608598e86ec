"""The recipe benchmark: the default recipe against a plain constant-rate AdamW loop, on data it makes itself.

Each cell is one workload (`benchmarks.data.workloads`), one model and one budget in optimizer steps,
trained twice in this process from the same seed, data, model, batch and epochs:

* **plain**: what a team writes first: AdamW at a constant 3e-3 (PyTorch's other defaults),
  cross-entropy, pixels scaled to -1..1, no augmentation, the last weights scored;
* **ours**: the pipeline's default recipe, through the same functions the training workers call
  (`training.worker.recipe`: the schedule and weight average sized by the run's steps, AdamW; the
  transform's normalization and augmentation as `dataset.tensors.transform` resolves them for the data),
  trained on what the pipeline trains on: the training split less its stratified validation
  rows (`dataset.formats.folder.stratified_split`), the weights the pipeline ships (the average) scored.

Both are scored on the workload's test split. `run` returns one row per cell; `benchmarks.run`
(``make bench``) writes them to its JSON and `format_table` makes docs/performance.md's table.
"""

from __future__ import annotations

import math
import time

import numpy as np

PLAIN_LR = 3e-3
BUDGETS = {"short": 150, "long": 600, "quick": 12}  # optimizer steps; quick only proves the cells run
MODELS = ("training.model.catalog:small_cnn", "resnet18")
BATCH = 16


def _tensors(images: np.ndarray, mean, std):
    import torch

    from dataset.tensors.batches import normalize

    chw = images.transpose(0, 3, 1, 2)
    return torch.from_numpy(normalize(chw, mean, std, chw.shape[1:]))


def _score(model, test_x, test_y) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        correct = sum(int((model(test_x[i : i + 256]).argmax(1) == test_y[i : i + 256]).sum()) for i in range(0, len(test_y), 256))
    return correct / len(test_y)


def plain(workload, model_name: str, epochs: int, seed: int, batch: int = BATCH) -> float:
    """The plain loop's test accuracy."""
    import torch

    from training.model.catalog import build_model

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_model(model_name, in_channels=workload.channels, num_classes=len(workload.classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=PLAIN_LR)
    x, y = _tensors(workload.train_x, 0.5, 0.5), torch.from_numpy(workload.train_y)
    for _ in range(epochs):
        model.train()
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), batch):
            idx = order[start : start + batch]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return _score(model, _tensors(workload.test_x, 0.5, 0.5), torch.from_numpy(workload.test_y))


def ours(workload, model_name: str, epochs: int, seed: int, batch: int = BATCH, config: dict | None = None,
         threads: int = 2) -> float:
    """The default recipe's test accuracy (``config``: overrides of the pipeline's configuration)."""
    import torch

    from dataset.formats.folder import stratified_split
    from dataset.tensors.augment import augment, augmentation
    from dataset.tensors.batches import normalize
    from dataset.tensors.normalization import from_sums
    from pipeline_config import PipelineConfig
    from training.model.catalog import build_model
    from training.worker.recipe import inference_model, make_ema, make_optimizer, plan_for

    cfg = PipelineConfig.model_validate({"download": {"source": "folder", "path": "/nonexistent"}, **(config or {})})
    held = stratified_split(workload.train_y.tolist(), cfg.parquet.validation_every, cfg.parquet.split_seed)
    keep = np.setdiff1d(np.arange(len(workload.train_y)), held)
    images, y = workload.train_x[keep], torch.from_numpy(workload.train_y[keep])
    pixels = images.reshape(-1, workload.channels)
    measured = from_sums(pixels.sum(0, dtype=np.float64), np.square(pixels, dtype=np.float64).sum(0), len(pixels))
    mean = measured[0] if cfg.transform.mean is None else cfg.transform.per_channel(workload.channels)[0]
    std = measured[1] if cfg.transform.std is None else cfg.transform.per_channel(workload.channels)[1]
    chw, shape = images.transpose(0, 3, 1, 2), (workload.channels, *images.shape[1:3])
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_model(model_name, in_channels=workload.channels, num_classes=len(workload.classes))
    steps_per_epoch = math.ceil(len(y) / batch)
    plan = plan_for(cfg.train, steps_per_epoch * epochs)
    optimizer = make_optimizer(model, cfg.train.learning_rate, cfg.train.weight_decay)
    ema = make_ema(model, plan.ema_decay)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    kwargs = augmentation(cfg.transform, "folder")
    step = 0
    for _ in range(epochs):
        augmented = augment(chw, rng.random((len(chw), 4)), **kwargs) if kwargs else chw
        torch.set_num_threads(threads)  # the augmentation pins torch to one thread, as in a Ray Data task
        x = torch.from_numpy(normalize(augmented, mean, std, shape))
        model.train()
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), batch):
            idx = order[start : start + batch]
            for group in optimizer.param_groups:
                group["lr"] = plan.lr(step)
            loss = criterion(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if ema is not None:
                ema.update_parameters(model)
            step += 1
    test_x = torch.from_numpy(normalize(workload.test_x.transpose(0, 3, 1, 2), mean, std, shape))
    return _score(inference_model(model, ema), test_x, torch.from_numpy(workload.test_y))


def cell(workload, model_name: str, budget: str, seed: int = 0, batch: int = BATCH, config: dict | None = None) -> dict:
    """One cell: both sides at ``budget``'s optimizer steps (epochs rounded up to reach them)."""
    steps_per_epoch = math.ceil(len(workload.train_y) / batch)
    epochs = max(1, round(BUDGETS[budget] / steps_per_epoch))
    start = time.perf_counter()
    base = plain(workload, model_name, epochs, seed, batch)
    middle = time.perf_counter()
    mine = ours(workload, model_name, epochs, seed, batch, config)
    return {
        "workload": workload.name, "classes": len(workload.classes), "channels": workload.channels,
        "train_images": len(workload.train_y), "test_images": len(workload.test_y),
        "model": model_name, "budget": budget, "batch": batch, "epochs": epochs, "steps": steps_per_epoch * epochs,
        "seed": seed, "plain": round(base, 4), "ours": round(mine, 4), "gap_points": round(100 * (mine - base), 1),
        "point_is_images": round(len(workload.test_y) / 100, 1),
        "plain_s": round(middle - start, 1), "ours_s": round(time.perf_counter() - middle, 1),
    }


def run(train_per_class: int = 100, test_per_class: int = 100, seed: int = 0, models=MODELS, kinds=None,
        budgets=("short", "long"), config: dict | None = None, threads: int = 2) -> list[dict]:
    """Every cell: each workload x model x budget."""
    from benchmarks.data.workloads import KINDS, make
    from training.model.catalog import configure_cpu

    configure_cpu(threads)
    rows = []
    for kind in kinds or KINDS:
        workload = make(kind, train_per_class, test_per_class, seed)
        for model_name in models:
            for budget in budgets:
                rows.append(cell(workload, model_name, budget, seed, config=config))
                row = rows[-1]
                print(f"{row['workload']:>9} {row['model']:>26} {row['steps']:>4} steps, seed {seed}: "
                      f"plain {100 * row['plain']:.1f}%, ours {100 * row['ours']:.1f}%", flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    """docs/performance.md's table: one line a cell (the mean over seeds), accuracy in % and the gap in points."""
    lines = ["| workload (test images; 1 point) | model | steps | seeds | plain AdamW | default recipe | gap (points) |",
             "|---|---|---|---|---|---|---|"]
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["model"], r["budget"]), []).append(r)
    for same in cells.values():
        r, n = same[0], len(same)
        plain_mean, ours_mean = sum(x["plain"] for x in same) / n, sum(x["ours"] for x in same) / n
        lines.append(f"| {r['workload']}: {r['classes']} classes, {r['channels']} ch ({r['test_images']}; "
                     f"{r['point_is_images']:g} images) | {r['model']} | {r['steps']} | {n} | {100 * plain_mean:.1f}% | "
                     f"{100 * ours_mean:.1f}% | {100 * (ours_mean - plain_mean):+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.speed.recipe``: every cell, the JSON (with the machine) and the table."""
    import argparse
    import json
    from pathlib import Path

    from reporting import environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few images, the small CNN and the short budget only")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: every cell is run once per seed")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "recipe.json"))
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.perf_counter()
    rows = []
    for seed in seeds:
        if args.quick:
            rows += run(train_per_class=12, test_per_class=10, seed=seed, models=MODELS[:1], budgets=("quick",))
        else:
            rows += run(seed=seed, budgets=("short", "long"))
    result = {"benchmark": "recipe: default recipe against a plain constant-rate AdamW loop",
              "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "environment": environment.describe(),
              "mode": "quick" if args.quick else "full", "seeds": seeds, "rows": rows,
              "long_budget_mean_gap_points": _mean_gap([r for r in rows if r["budget"] == "long"]),
              "suite_wall_s": round(time.perf_counter() - started, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(rows))
    print(f"\nwritten to {out}")
    return 0


def _mean_gap(rows: list[dict]) -> float | None:
    return round(sum(r["gap_points"] for r in rows) / len(rows), 2) if rows else None


if __name__ == "__main__":
    raise SystemExit(main())
