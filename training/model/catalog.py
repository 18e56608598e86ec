"""Models by name: the one factory training, evaluation, promotion, predict and the Tune flow build through.

``model.name`` takes one of three forms:

* ``resnet18``: the default and the seeds' model, torchvision's ResNet-18 with its first
  convolution made for the data's channels (7x7, stride 2, no bias). Its checkpoints load,
  strict, into a ResNet-18 built the seeds' way.
* any torchvision classification model by its name (``mobilenet_v3_small``, ``resnet34``, ...),
  built without weights (nothing is downloaded) with ``num_classes`` classes and its first
  convolution remade for the data's channels.
* ``package.module:function``, a user's own: called as ``function(in_channels=..., num_classes=...)``
  and returning an ``nn.Module``. The module must be importable where the model is built: on
  every Ray worker (installed in the environment, or on the workers' ``PYTHONPATH``). A run started
  through a deployment imports it only from a module the serving process allows
  (``PIPELINE_MODEL_MODULES``, `training.model.trust`).

`ModelSpec` is what was built: the name, the input channels and the number of classes. It goes
into every checkpoint's ``extra_state.pt``, the training result and the model card, so whoever
loads the weights builds the same module.

`small_cnn` is a compact CNN shipped with the project, in the third form
(``training.model.catalog:small_cnn``): a quick model for checks of the pipeline itself (the tests'
orchestration runs use it) and an example of a function a team writes for its own model.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

DEFAULT_MODEL = "resnet18"
_CALLABLE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_TORCHVISION = re.compile(r"^[a-z][a-z0-9_]*$")


class ModelNameError(ValueError):
    """``model.name`` names no usable model: the message names the field and what is wrong."""


class ModelSpec(BaseModel):
    """What a model is built from: ``name`` (see the module doc), input channels and classes."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    name: str = DEFAULT_MODEL
    in_channels: int
    num_classes: int

    @classmethod
    def for_data(cls, name: str, dataset) -> ModelSpec:
        """``name`` built for ``dataset`` (a `dataset.formats.parquet.ParquetDataset`): its image channels and classes."""
        return cls(name=name, in_channels=dataset.image_shape[0], num_classes=dataset.num_classes)

    def build(self):
        """A freshly initialised ``nn.Module`` (the caller seeds torch first for reproducible weights)."""
        return build_model(self.name, in_channels=self.in_channels, num_classes=self.num_classes)


def configure_cpu(threads: int) -> None:
    """What every process that trains or scores does first: ``threads`` torch threads, denormals flushed to zero,
    large blocks kept in glibc's heap (`dataset.tensors.memory.keep_large_blocks_in_heap`).

    Tiny floats (denormals) take a slow path in x86 floating point; some CPUs run a whole training
    step several times slower once weights or optimizer moments underflow (reported on an AVX2 AMD
    EPYC: a plain ResNet-18 loop at 30 img/s, 162 img/s with the flush; not reproduced on a Zen 5
    EPYC, where both ran at about 1,050 img/s). The flag is per thread: set before torch starts its
    thread pool, which inherits it.
    """
    import torch  # torch: only where a model is built or run

    from dataset.tensors.memory import keep_large_blocks_in_heap  # pyarrow: with torch, in a training process

    torch.set_flush_denormal(True)
    torch.set_num_threads(threads)
    keep_large_blocks_in_heap()  # no fresh mmap for every large activation


def check_name(name: str) -> None:
    """ValueError naming ``model.name`` unless ``name`` resolves to a model (imports what it names, builds nothing)."""
    _resolve(name)


def _resolve(name: str) -> tuple[str, Any]:
    """("resnet18" | "torchvision" | "callable", the builder) for ``name``; ValueError naming model.name."""
    if name == DEFAULT_MODEL:
        return "resnet18", None
    if ":" in name:
        if not _CALLABLE.match(name):
            raise ModelNameError(f"model.name {name!r}: write a function of your own as package.module:function")
        module_name, function_name = name.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ModelNameError(
                f"model.name {name!r}: cannot import {module_name!r} ({exc}); install the package that holds it, "
                "or put its folder on PYTHONPATH (on every Ray worker too)"
            ) from None
        except Exception as exc:  # its top level raised: a SyntaxError, a RuntimeError, ...
            raise ModelNameError(f"model.name {name!r}: importing {module_name!r} raised {said(exc)}") from None
        builder = getattr(module, function_name, None)
        if not callable(builder):
            raise ModelNameError(f"model.name {name!r}: {module_name} has no function {function_name!r}")
        return "callable", builder
    if not _TORCHVISION.match(name):
        raise ModelNameError(
            f"model.name {name!r}: use resnet18, a torchvision classification model's name (e.g. mobilenet_v3_small) "
            "or package.module:function"
        )
    from torchvision import models  # torchvision: only where a model is built

    known = models.list_models(module=models)  # classification models only (not detection, segmentation, video)
    if name not in known:
        close = [k for k in known if k.startswith(name[:4])][:6]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ModelNameError(f"model.name {name!r} is not a torchvision classification model{hint}")
    return "torchvision", models.get_model_builder(name)


def build_model(name: str, *, in_channels: int, num_classes: int):
    """The ``nn.Module`` that ``name`` names, for images of ``in_channels`` channels and ``num_classes`` classes."""
    import torch  # torch: only where a model is built or run

    kind, builder = _resolve(name)
    if kind == "resnet18":
        return resnet18_for(in_channels, num_classes)
    if kind == "torchvision":
        model = builder(weights=None, num_classes=num_classes)
        return _with_input_channels(model, in_channels, name)
    check_signature(name, builder)
    try:
        model = builder(in_channels=in_channels, num_classes=num_classes)
    except Exception as exc:
        function = name.rsplit(":", 1)[-1]
        raise ModelNameError(
            f"model.name {name!r}: {function}(in_channels={in_channels}, num_classes={num_classes}) raised {said(exc)}"
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise ModelNameError(f"model.name {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_signature(name: str, builder) -> None:
    """ValueError naming model.name unless ``builder`` can be called as ``builder(in_channels=..., num_classes=...)``.

    Read from the signature, so a function that takes other arguments (``os:system``, ``builtins:eval``)
    is never called; a callable without a readable signature (a C builtin) is refused too."""
    function = name.rsplit(":", 1)[-1]
    try:
        signature = inspect.signature(builder)
    except (TypeError, ValueError):
        raise ModelNameError(
            f"model.name {name!r}: {function} has no readable signature; write a Python function "
            f"{function}(in_channels, num_classes) that returns a torch.nn.Module"
        ) from None
    try:
        signature.bind(in_channels=1, num_classes=2)
    except TypeError as exc:
        raise ModelNameError(
            f"model.name {name!r}: {function}{signature} cannot be called as {function}(in_channels=..., num_classes=...) "
            f"({exc}); the function must take in_channels and num_classes and return a torch.nn.Module"
        ) from None


def said(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` for a refusal: the message's first line, at most 300 characters."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def resnet18_for(in_channels: int, num_classes: int):
    """torchvision ResNet-18 with an ``in_channels`` 7x7/stride-2 stem, as in the seeds (one channel there).

    Built in the seeds' order (the network, then the new stem), so a seed gives the seeds' weights.
    """
    import torch  # torch: only where a model is built or run
    from torchvision.models import resnet18  # torchvision: only where a model is built

    model = resnet18(num_classes=num_classes)
    model.conv1 = torch.nn.Conv2d(in_channels, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    return model


def _with_input_channels(model, in_channels: int, name: str):
    """``model`` with its first convolution remade for ``in_channels`` (same kernel, stride, padding)."""
    import torch  # torch: only where a model is built or run

    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, torch.nn.Conv2d):
                if child.in_channels != in_channels:
                    setattr(parent, child_name, torch.nn.Conv2d(
                        in_channels, child.out_channels, kernel_size=child.kernel_size, stride=child.stride,
                        padding=child.padding, dilation=child.dilation, groups=1, bias=child.bias is not None,
                    ))
                return model
    raise ModelNameError(f"model.name {name!r}: found no Conv2d layer to adapt to {in_channels} input channel(s)")


def small_cnn(in_channels: int, num_classes: int):
    """A compact CNN (about 25k weights): three 3x3 conv, batch-norm, ReLU and 2x2 max-pool blocks, global
    average pooling and a linear head; about 2 M multiply-adds for a 28x28 image, some 15x fewer than ResNet-18's.

    Trains at thousands of images per second on one CPU core; any image size of 8x8 and up.
    """
    from torch import nn  # torch: only where a model is built or run

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True), nn.MaxPool2d(2))

    return nn.Sequential(
        block(in_channels, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
    )
