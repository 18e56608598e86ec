"""Per-trial overhead of the tune stage: one trial against the same training in the main flow.

Both sides train the default recipe on the bundled sample for the same epochs with one worker,
in this process's local Ray. The baseline is the training stage (``tasks.train``) as the main
flow runs it; ours is the tune stage (``tasks.tune``) searching a space fixed to that very recipe
with one trial and no scheduler, so every second beyond the baseline is what Tune adds per trial:
the experiment's setup and state, the trial's actor and its Ray Train controller, result
collection, the trial table and the best-config file. Repetitions alternate the two.
``benchmarks.run`` calls `measure`.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def recipe_config(epochs: int):
    """The tune flow's config with a one-trial search fixed to the default recipe for ``epochs`` epochs."""
    from benchmarks import model_name
    from pipeline_config import TrainConfig, TunePipelineConfig

    recipe = TrainConfig()

    def fixed(value: float) -> dict:
        return {"low": value, "high": value}

    space = {"learning_rate": fixed(recipe.learning_rate), "weight_decay": fixed(recipe.weight_decay),
             "global_batch_size": [recipe.global_batch_size], "augmentation": fixed(1.0),
             "label_smoothing": fixed(recipe.label_smoothing)}
    return TunePipelineConfig.model_validate({
        "download": {"source": "sample"},
        "model": {"name": model_name()},
        "train": {"epochs": epochs, "num_workers": 1},
        "tune": {"num_samples": 1, "epochs": epochs, "scheduler": "none", "search_space": space},
    })


def measure(work: Path, epochs: int, reps: int) -> dict:
    """One row: the tune stage with one trial against the training stage, same recipe and epochs."""
    from benchmarks.speed.stages import stage_inputs
    from tasks.train import train
    from tasks.tune import tune_search

    config = recipe_config(epochs)
    trains, tunes, trials = [], [], []
    for _ in range(reps):
        spec, layout = stage_inputs(config, work, "bench-train")
        start = time.perf_counter()
        train.fn(spec, config.train, layout, model=config.model)
        trains.append(time.perf_counter() - start)
        spec, layout = stage_inputs(config, work, "bench-tune")
        start = time.perf_counter()
        result = tune_search.fn(spec, config.train, config.tune, layout, model=config.model)
        tunes.append(time.perf_counter() - start)
        trials.append(len(result.trials))
    if trials != [1] * reps:
        raise RuntimeError(f"expected one trial per search, got {trials}")
    baseline, ours = round(statistics.median(trains), 2), round(statistics.median(tunes), 2)
    return {
        "benchmark": "tune stage, per trial", "epochs": epochs, "workers": 1,
        "baseline": "training stage, same recipe and epochs", "baseline_s": baseline, "ours_s": ours,
        "overhead_per_trial_s": round(ours - baseline, 2), "ratio": round(ours / baseline, 3),
        "baseline_runs": [round(t, 2) for t in trains], "ours_runs": [round(t, 2) for t in tunes], "reps": reps,
        "goal": "(overhead reported)",
    }
