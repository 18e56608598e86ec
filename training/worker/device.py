"""Where a process trains or scores (CPU or a GPU) and in what precision.

Pure decisions (`pick_device`, `resolve_precision`) apart from what they switch on
(`autocast`, `grad_scaler`, `prepare_for`), so they can be tested on a CPU machine.
On a GPU: bf16 autocast where the GPU supports it (``train.precision: auto``), channels-last
weights and images, cuDNN's autotuner; on a CPU: fp32 and nothing changed unless asked.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("bf16", "fp16", "fp32")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(use_gpu: str, cuda_devices: int) -> torch.device:
    """The device of a process that sees ``cuda_devices`` GPUs: the first GPU unless ``use_gpu`` is
    ``never`` or there is none; ValueError naming train.use_gpu for ``always`` without one."""
    if use_gpu == "always" and cuda_devices < 1:
        raise ValueError("train.use_gpu=always: this process sees no GPU; set train.use_gpu=auto or never")
    if use_gpu == "never" or cuda_devices < 1:
        return torch.device("cpu")
    return torch.device("cuda", 0)


def visible_gpus() -> int:
    """GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_precision(requested: str, device: torch.device, bf16_supported: bool | None = None) -> str:
    """``train.precision`` for ``device``: ``auto`` is bf16 on a GPU that supports it, else fp32; the rest as asked.

    ``bf16_supported``: whether the GPU has bf16 (unset: asked of CUDA when ``device`` is a GPU)."""
    if requested != "auto":
        if requested not in PRECISIONS:
            raise ValueError(f"train.precision={requested!r}: use auto, bf16, fp16 or fp32")
        return requested
    if device.type != "cuda":
        return "fp32"
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    return "bf16" if bf16_supported else "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward pass's autocast for ``precision`` (a no-op context for fp32)."""
    dtype = AMP_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16 (its small range underflows gradients without one); None otherwise.

    With the recipe's fused AdamW the scaler hands the optimizer its scale and inf check as tensors:
    no step waits for the device."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """Backward and one optimizer step; with fp16's scaler (`grad_scaler`), scaled gradients, and the fused
    AdamW skips a step with inf in it. The caller zeroes the gradients first."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


def prepare_for(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """On a GPU: cuDNN's autotuner on and the weights channels-last (faster convolutions with autocast); on a CPU: as it is."""
    if device.type != "cuda":
        return model
    torch.backends.cudnn.benchmark = True  # the batch shape is fixed: each convolution's best kernel is found once
    return model.to(memory_format=torch.channels_last)


def images_for(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch of (N, C, H, W) images in the layout `prepare_for` gave the model."""
    return images.contiguous(memory_format=torch.channels_last) if device.type == "cuda" else images



class StepClock:
    """How long the GPU worked on an epoch's steps, from CUDA events recorded around each step on its stream.

    `seconds` reads them once, at the epoch's end (the events are done by then: the epoch's totals were read).
    A step's span runs from its first kernel to its last, so an eager step whose launches the GPU outruns counts
    its gaps too; a graph replay has none. The events are made once and reused every epoch.
    """

    def __init__(self):
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.used = 0

    def begin_epoch(self) -> None:
        self.used = 0

    def start(self) -> None:
        if self.used == len(self.events):
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self.events[self.used][0].record()

    def stop(self) -> None:
        self.events[self.used][1].record()
        self.used += 1

    def seconds(self) -> float:
        """The epoch's steps' summed spans on the GPU, in seconds."""
        if not self.used:
            return 0.0
        self.events[self.used - 1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events[: self.used]) / 1000.0
