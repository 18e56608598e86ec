"""How training fits the cluster: GPUs or CPUs, how many workers, each worker's CPUs and torch threads.

`plan_cluster` decides it from ``train.use_gpu``, ``train.num_workers`` and what the Ray cluster has.
``use_gpu: auto`` fits the machine: with fewer GPUs than workers asked for, it trains one worker a
GPU (2 workers asked on 1 GPU: 1 worker) and says so in one line (`ResourcePlan.note`). What an
explicit setting asks that the cluster cannot hold (``use_gpu: always`` with too few GPUs, FSDP on
CPUs, too few CPUs) is `DoesNotFit`: refused before any work, exit 2 from the CLI.

A CPU worker shares the cluster's CPUs beside ``train.data_cpus``; a GPU worker takes at most
`GPU_WORKER_CPUS` (it feeds the GPU, it does not compute) and Ray Data gets the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline_config import TrainConfig

# CPUs (and torch threads) a GPU worker holds: its Python loop and the host side of each batch.
# Measured on one H200 with 16 cores: a GPU worker holding 15 CPUs and 16 threads left Ray Data one CPU.
GPU_WORKER_CPUS = 2


class DoesNotFit(ValueError):
    """The configuration asks for what the cluster cannot hold: refused before any work (the CLI exits 2)."""


@dataclass(frozen=True)
class ResourcePlan:
    """How the training stage uses the cluster."""

    use_gpu: bool
    workers: int  # Ray Train workers: train.num_workers, or the GPUs there are under use_gpu=auto
    cpus_per_worker: float  # logical CPUs each worker reserves
    threads: int  # torch threads each worker runs
    note: str | None = None  # one line saying how the run departs from what was asked (None: it does not)

    def config_for(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with the workers this plan trains (``num_workers``, and ``min_workers`` no higher)."""
        if self.workers == cfg.num_workers:
            return cfg
        low = None if cfg.min_workers is None else min(cfg.min_workers, self.workers)
        return cfg.model_copy(update={"num_workers": self.workers, "min_workers": low})


def plan_cluster(cfg: TrainConfig, cluster_cpus: float, cluster_gpus: float) -> ResourcePlan:
    """The plan for a cluster of ``cluster_cpus`` CPUs and ``cluster_gpus`` GPUs; `DoesNotFit` naming the field.

    Workers share the cluster's CPUs minus ``cfg.data_cpus``, which stay free for Ray Data: with 2
    CPUs, 2 workers and 1 kept free each worker reserves 0.5 CPU. Logical CPUs are bookkeeping;
    torch threads follow the physical split. A GPU worker takes at most `GPU_WORKER_CPUS` of either.
    """
    gpus = int(cluster_gpus)  # a fractional GPU resource holds no worker of its own
    asked = cfg.num_workers
    use_gpu = cfg.use_gpu == "always" or (cfg.use_gpu == "auto" and gpus > 0)
    if cfg.strategy == "fsdp" and not use_gpu:
        raise DoesNotFit("train.strategy=fsdp needs GPUs (PyTorch FSDP does not run on CPU); use train.strategy=ddp")
    workers, note = asked, None
    if use_gpu and gpus < asked:
        if cfg.use_gpu == "always":
            raise DoesNotFit(
                f"train.num_workers={asked} needs {asked} GPUs with train.use_gpu=always; the cluster has {gpus}: "
                "lower train.num_workers, or set train.use_gpu=auto (one worker a GPU) or never (CPUs)"
            )
        workers = gpus
        note = (f"train.use_gpu=auto: {_count(gpus, 'GPU')} for train.num_workers={asked}, so {_count(workers, 'worker')} "
                f"trains, one a GPU (train.use_gpu=never trains {asked} on CPUs)")
    cpus = round((cluster_cpus - cfg.data_cpus) / workers, 3)
    if cpus < 0.01:
        raise DoesNotFit(
            f"the cluster has {cluster_cpus:g} CPUs: too few for train.num_workers={workers} "
            f"plus train.data_cpus={cfg.data_cpus:g}; lower either"
        )
    threads = max(1, math.floor(cluster_cpus / workers))
    if use_gpu:
        cpus, threads = min(cpus, float(GPU_WORKER_CPUS)), min(threads, GPU_WORKER_CPUS)
    return ResourcePlan(use_gpu=use_gpu, workers=workers, cpus_per_worker=cpus, threads=threads, note=note)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def plan_resources(cfg: TrainConfig, cluster_cpus: float, cluster_gpus: float) -> tuple[bool, float, int]:
    """(use_gpu, CPUs per worker, torch threads per worker) of `plan_cluster`'s plan."""
    plan = plan_cluster(cfg, cluster_cpus, cluster_gpus)
    return plan.use_gpu, plan.cpus_per_worker, plan.threads
