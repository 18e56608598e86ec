"""What the processes that only start training hand Ray Train: the loop's entry and torch's process group, without torch.

Two processes sit beside every training run without running a tensor: the train stage's task, which builds the
trainer and waits on ``fit()``, and Ray Train's controller, which starts the worker group and watches it. Handing
Ray Train the loop function (`training.worker.loop`) and Ray's ``TorchConfig`` loaded torch in both, because each
lives in a module that imports torch: about 300 MB of each process's memory for the whole run, and a second or two
of imports on the way to the first step (docs/design.md, "The processes that start training load no torch").

`run_loop` is the loop's entry, `ProcessGroupConfig` the process group's setup: the same as Ray's ``TorchConfig``
(gloo on CPUs, nccl on GPUs, ``env://`` rendezvous at rank 0's address, the timeout, torch's distributed environment
variables, each worker's CUDA device), with every call into torch made by the workers through Ray's own functions,
imported where they run. The process group itself is Ray's (``ray.train.torch.config``): nothing here reimplements it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)


def run_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: `training.worker.loop.train_loop_per_worker`, imported on the worker."""
    from training.worker.loop import train_loop_per_worker  # torch: only in the training workers (module doc)

    train_loop_per_worker(config)


class CudaDeviceContext:
    """Around the loop on each worker: its GPU made torch's current CUDA device (what ``TorchConfig`` does), nothing on CPU."""

    def __enter__(self):
        import torch  # torch: on the training worker, where the loop runs

        if torch.cuda.is_available():
            device = ray.train.torch.get_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc) -> bool:
        return False


@dataclass
class ProcessGroupConfig(BackendConfig):
    """Ray Train's backend config for torch's process group (``TorchConfig``'s fields that the pipeline uses).

    ``timeout_s``: seconds a collective waits before it fails (the pipeline sets it from ``train.hang_timeout_s``).
    """

    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return ProcessGroupBackend

    @property
    def train_func_context(self):
        return CudaDeviceContext

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": None, "init_method": "env", "timeout_s": self.timeout_s}


class ProcessGroupBackend(Backend):
    """Starts and ends torch's process group on the worker group; runs in Ray Train's controller, which loads no torch."""

    share_cuda_visible_devices: bool = True  # as Ray's torch backend: every local worker sees every local GPU

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_rendezvous, address=address, port=port)
        worker_group.execute(_set_distributed_environment)
        ray.get([
            worker_group.execute_single_async(
                rank, _join_process_group, backend=backend, world_rank=rank, world_size=len(worker_group),
                init_method="env://", timeout_s=backend_config.timeout_s,
            )
            for rank in range(len(worker_group))
        ])

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        futures = worker_group.execute_async(_leave_process_group, destroy_process_group=len(worker_group) > 1)
        # Ray's setting and default for its own torch backend (30 s).
        timeout_s = int(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning("torch's process group did not shut down within %d s", timeout_s)


def _set_rendezvous(address: str, port: int) -> None:
    """On each worker: rank 0's address and a free port of its, for ``env://``."""
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)


def _set_distributed_environment() -> None:
    """On each worker: RANK, WORLD_SIZE, LOCAL_RANK and the rest, as torchrun sets them (Ray's function)."""
    from ray.train.torch.config import _set_torch_distributed_env_vars  # torch: on the training worker

    _set_torch_distributed_env_vars()


def _join_process_group(**kwargs) -> None:
    """On each worker: ``torch.distributed.init_process_group`` with Ray's settings (its function)."""
    from ray.train.torch.config import _setup_torch_process_group  # torch: on the training worker

    _setup_torch_process_group(**kwargs)


def _leave_process_group(destroy_process_group: bool) -> None:
    """On each worker at the end: the process group destroyed (more than one rank) and the CUDA cache emptied (Ray's function)."""
    from ray.train.torch.config import _shutdown_torch  # torch: on the training worker

    _shutdown_torch(destroy_process_group=destroy_process_group)
