"""The training step captured as one CUDA graph: forward, backward, AdamW and the weight average in one launch.

On a GPU the step of a small model is set by the host: Python and a few hundred kernel launches took
8 ms a step at batch 64 on an H200, where the GPU's own work replayed from a CUDA graph took 1.5 ms
(docs/performance.md, "On a GPU"). `CapturedStep` runs the recipe's step (`training.worker.loop.train_step`:
the one-cycle learning rate, fused AdamW, the moving average of the weights, the epoch's loss and
correct count kept on the device) so that nothing in it needs the host:

* the learning rate and the average's decay are read from tables on the device, indexed by step
  counters on the device (`Plan.lr` and `training.worker.recipe.ema_decay_at` computed once per attempt);
* AdamW is the fused kernel with ``capturable=True`` and its learning rate a device tensor;
* the gradients live in fixed tensors, zeroed in place before each backward;
* the batch is copied into fixed input tensors, one pair per batch size.

Each batch size is run eagerly `WARMUP_STEPS` times (on a side stream: cuDNN picks its kernels
there, as capture needs), then captured once and replayed. The epoch's last, shorter batch is a
size of its own: eager for its first occurrences, then a graph of its own.

``capture=False`` runs the same code eagerly, on any device: that is how a CPU machine tests it
(tests/test_captured_step.py: the same weights as `training.worker.loop.train_step` over several steps)
and how it runs where a graph is not used (`use_captured_step`).
"""

from __future__ import annotations

import collections
import contextlib

import torch

from training.checkpoint.model_files import unwrap
from training.worker.device import AMP_DTYPES, images_for
from training.worker.recipe import ema_decay_at

WARMUP_STEPS = 2  # eager steps of a batch size before it is captured (cuDNN's autotuner runs in them)


def use_captured_step(choice: str, device: torch.device, world_size: int, precision: str) -> bool:
    """Whether a worker runs `CapturedStep` for ``train.cuda_graph`` = ``choice`` (``auto``, ``on`` or ``off``).

    ``auto``: on one GPU in bf16 or fp32 (several workers' DDP or FSDP and fp16's gradient scaler stay eager;
    Ray Train wraps a model for either strategy only across several workers);
    ``on``: the same, and its eager form on a CPU (what tests run); ``off``: never.
    """
    if choice == "off" or world_size > 1 or precision == "fp16":
        return False
    return device.type == "cuda" or choice == "on"


class CapturedStep:
    """The recipe's training step of one attempt, replayed from CUDA graphs (``capture``) or run eagerly.

    Call `begin_epoch` at the start of each epoch (it sets the step counter the learning rate is read
    from and zeroes the epoch's totals), then the object once per batch; `totals` are the epoch's summed
    loss and correct count as device tensors. Built after the attempt's checkpoint is restored: it binds
    the optimizer's learning rate to a device tensor and reads the weight average's update count.
    """

    def __init__(self, attempt, capture: bool):
        self.attempt, self.capture = attempt, capture
        device, plan, ema = attempt.device, attempt.plan, attempt.ema
        self.device = device
        tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)
        # As the eager step's fused AdamW takes a Python float: in float32 on a GPU (its kernel's arithmetic), in
        # float64 on a CPU, whose kernel works in double there (a float32 rate moved early weights by 1e-8, and Adam's
        # first steps magnify that: 3e-5 apart after two steps).
        lr_dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.lr_table = tensor([plan.lr(step) for step in range(plan.total_steps + 1)], lr_dtype)
        self.step_no = tensor(0, torch.int64)  # the run's optimizer step: the index into lr_table
        self.lr = tensor(0.0, lr_dtype)  # what AdamW reads as its learning rate
        for group in attempt.optimizer.param_groups:
            group["lr"] = self.lr
        self.loss_sum, self.correct = tensor(0.0, torch.float64), tensor(0, torch.int64)
        self.ema = ema
        if ema is not None:
            if ema.updates is None:
                ema.updates = int(ema.n_averaged)  # once: restored from a checkpoint, or 0
            last = _decay_cap_updates(plan.ema_decay)
            decays = [ema_decay_at(plan.ema_decay, n) for n in range(last + 1)]
            self.decay_table, self.weight_table = tensor(decays, torch.float32), tensor([1.0 - d for d in decays], torch.float32)
            self.ema_no = tensor(ema.updates, torch.int64)  # updates done: the index into the decay tables
            self.decay, self.weight = tensor(0.0, torch.float32), tensor(0.0, torch.float32)
        if capture:  # the fused AdamW keeps its step counts on the device; capturable: it reads nothing back
            for group in attempt.optimizer.param_groups:
                group["capturable"] = True
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # fixed (images, labels) per batch size
        self.runs: collections.Counter[int] = collections.Counter()  # eager steps run per batch size
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.side = torch.cuda.Stream(device) if capture else None

    def begin_epoch(self, global_step: int) -> None:
        """The epoch's first optimizer step is the run's ``global_step``; its totals start at zero."""
        self.step_no.fill_(global_step)
        self.loss_sum.zero_()
        self.correct.zero_()

    def totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, correct predictions) of the epoch's steps so far, on the device."""
        return self.loss_sum, self.correct

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """One optimizer step on a batch: a graph replay once its size is captured, else the same code eagerly."""
        size = len(labels)
        graph = self.graphs.get(size)
        if graph is None and self.capture and self.runs[size] >= WARMUP_STEPS:
            graph = self._capture(images, labels)
        if graph is not None:
            static_images, static_labels = self.inputs[size]
            static_images.copy_(images_for(images, self.device))
            static_labels.copy_(labels)
            graph.replay()
        else:
            self.runs[size] += 1
            with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
                if self.side is not None:
                    self.side.wait_stream(torch.cuda.current_stream(self.device))
                self._body(images_for(images, self.device), labels)
            if self.side is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.side)
        if self.ema is not None:  # the host's count, for the checkpoint (the device keeps its own in ema_no)
            self.ema.updates += 1
            self.ema.n_averaged.fill_(self.ema.updates)

    def _capture(self, batch_images: torch.Tensor, batch_labels: torch.Tensor) -> torch.cuda.CUDAGraph:
        """Capture the step for batches shaped as this one (its inputs: fixed tensors, filled before each replay)."""
        size = len(batch_labels)
        images = images_for(torch.zeros(batch_images.shape, dtype=batch_images.dtype, device=self.device), self.device)
        labels = torch.zeros(size, dtype=batch_labels.dtype, device=self.device)
        self.inputs[size] = (images, labels)
        torch.cuda.current_stream(self.device).synchronize()
        graph = torch.cuda.CUDAGraph()
        if self.ema is not None and self.ema.updates == 0:
            raise RuntimeError("a step is captured only after the weight average's first (eager) update")
        # thread_local: another thread of the worker (Ray's, a data loader's) may call CUDA while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._body(images, labels)
        self.graphs[size] = graph
        return graph

    def _body(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """The step itself, every operation on the device: captured as it runs, or run eagerly."""
        attempt = self.attempt
        self.lr.copy_(_at(self.lr_table, self.step_no))
        dtype = AMP_DTYPES.get(attempt.precision)
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None, cache_enabled=False):
            logits = attempt.model(images)
            loss = attempt.criterion(logits, labels)
        attempt.optimizer.zero_grad(set_to_none=False)  # the same gradient tensors every step (a graph holds their addresses)
        loss.backward()
        attempt.optimizer.step()
        if self.ema is not None:
            self._average()
        self.step_no.add_(1)
        self.loss_sum.add_(loss.detach().double() * len(labels))
        self.correct.add_((logits.argmax(1) == labels).sum())

    @torch.no_grad()
    def _average(self) -> None:
        """`training.worker.averaging.WeightAverage.update_parameters` with its decay read from the device's table."""
        ema, model = self.ema, unwrap(self.attempt.model)
        if ema.updates == 0:  # the first update copies the weights: host arithmetic, never captured
            ema.update_parameters(model)
            ema.updates -= 1  # __call__ counts this update
            self.ema_no.add_(1)
            return
        float_avg, float_cur, count_avg, count_cur = ema._pairs(model)
        self.decay.copy_(_at(self.decay_table, self.ema_no))
        self.weight.copy_(_at(self.weight_table, self.ema_no))
        if float_avg:
            torch._foreach_lerp_(float_avg, float_cur, [self.weight.expand_as(t) for t in float_avg])
        if count_avg:
            mixed = torch._foreach_mul(count_avg, self.decay)
            torch._foreach_add_(mixed, torch._foreach_mul(count_cur, self.weight))
            torch._foreach_copy_(count_avg, mixed)
        self.ema_no.add_(1)


def _at(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 0-d index on the device, clamped to the table's last entry, without reading the index
    on the host (plain indexing with a 0-d tensor would: a graph cannot hold that)."""
    return table.index_select(0, torch.clamp(index, max=len(table) - 1).view(1)).view(())


def _decay_cap_updates(decay: float) -> int:
    """Updates after which `ema_decay_at` stays at ``decay``: its table ends there (later counts read the last entry)."""
    if decay <= 0 or decay >= 1:
        return 1
    return min(1_000_000, int((10 * decay - 1) / (1 - decay)) + 2)
