"""Which ``model.name`` a run may import, and the model tried once before any work.

A ``package.module:function`` model is code: importing its module runs the module's top level, in
the flow's process and on every Ray worker. A command-line run is its user's own, so it imports
what it names. A run started through a deployment (the UI's run form, the API) names its model in
a parameter, so it imports only a module under a prefix that the process running the flow allows
in ``PIPELINE_MODEL_MODULES`` (comma-separated module prefixes; ``training.model.catalog``, the
project's own, always). `check_allowed` decides on the name alone: a refused module is never
imported. Torchvision models by name are always allowed (nothing is imported by name).

`try_model` builds the model for the data's channels and classes and runs one forward pass on
two images of the data's shape, before download, conversion and training: a function with the
wrong signature, one that returns no ``nn.Module``, one that raises, or a model whose output is
not one score per class is refused naming ``model.name`` and what it did. Images too small for the
model (a forward pass that raises on them and runs on larger ones: `smallest_size` finds the smallest
square size that works, by running the model) are refused naming ``transform.image_size`` and that
size. `data_for_trial` says what shape and classes are known before any work.

`check_model` runs the trial in a process that ends (`trial_apart`: ``python -m training.model.trust``, the
trial on stdin, a refusal's class and message on stdout): torch, the model's module and the weights are
loaded there, so the flow's process, which lives for the whole run, never holds torch (about 300 MB and the
import's seconds of CPU, issue 67). A trial that passed is not run again by the same process.

What "too small" means is the model's own: ResNet-18 and MobileNet-V3 run on two images of 1x1 pixels in
train mode (their global pooling takes any size; batch norm needs two values per channel, and the
training loop never steps on fewer than two images), ``training.model.catalog:small_cnn`` needs 8x8 (three 2x2
max-pools).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

from dataset.sources.interface import DataToCome, known_before_work, source_for
from pipeline_config import PipelineConfig, TransformConfig
from training.model import weights
from training.model.catalog import ModelNameError, build_model, check_name, said

MODULES_ENV = "PIPELINE_MODEL_MODULES"
DEFAULT_MODULES = ("training.model.catalog",)
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_TRIAL_IMAGES = 2  # train-mode batch norm needs more than one value per channel
# The largest square size `smallest_size` tries: a model that runs on no size up to it is refused as it is.
MAX_TRIED_SIZE = 512


def allowed_modules() -> tuple[str, ...]:
    """``training.model.catalog`` and the prefixes in ``PIPELINE_MODEL_MODULES``; ValueError naming the setting
    for an entry that is not a module name."""
    raw = os.environ.get(MODULES_ENV, "")
    entries = [entry.strip() for entry in raw.split(",") if entry.strip()]
    bad = [entry for entry in entries if not _MODULE.fullmatch(entry)]
    if bad:
        raise ValueError(
            f"{MODULES_ENV}={raw!r}: {bad[0]!r} is not a module name; "
            "list module prefixes separated by commas, e.g. training.model.catalog,myteam.models"
        )
    return tuple(dict.fromkeys((*DEFAULT_MODULES, *entries)))


def is_allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or inside one (``a.b`` allows ``a.b`` and ``a.b.c``, not ``a.bc``)."""
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def check_allowed(name: str, *, deployed: bool) -> None:
    """ValueError naming ``model.name`` and ``PIPELINE_MODEL_MODULES`` when a deployment's run names a
    ``module:function`` outside the allowed modules. Decided on the string: nothing is imported."""
    if not deployed or ":" not in name:
        return
    module = name.split(":", 1)[0]
    prefixes = allowed_modules()
    if is_allowed(module, prefixes):
        return
    raise ValueError(
        f"model.name {name!r}: a run started through a deployment imports models only from the modules in "
        f"{MODULES_ENV} ({', '.join(prefixes)}), and {module!r} is not one of them; nothing was imported. "
        f"To allow it, add {module} (or its package) to {MODULES_ENV} in the environment of the process that "
        "serves the deployments or of the worker (docs/operations.md, Security)"
    )


def data_for_trial(config: PipelineConfig, checked: DataToCome | None = None) -> tuple[tuple[int, int, int], int] | None:
    """((channels, height, width), classes) of the data the run trains on at ``transform.image_size`` (made concrete by
    `dataset.tensors.sizing.resolved`), when known before any work (`dataset.sources.interface.DataToCome.for_trial`;
    ``checked``: what the check before any work found, `dataset.sources.interface.check_data`; None: the source is
    asked, from its images' headers).

    The IDX sources: MNIST's digits. A local image or Parquet folder: its images' headers (from the listing cache
    the check filled). An ``s3://`` folder: None (its images are read by the conversion only).
    """
    source = source_for(config.download)
    size = config.transform.image_size if source.resizable and isinstance(config.transform.image_size, int) else None
    found = checked or source.check(size, config.storage_root, decode=False)
    return found.for_trial(size)


def check_model(config: PipelineConfig, checked: DataToCome | None = None) -> None:
    """Before any work, in a process that ends (`trial_apart`): ``model.name`` resolves (imports what it names) and,
    when the data's shape is known, builds and runs (`try_model`); ValueError naming model.name. ``model.weights``:
    found, read and loaded into that model (`training.model.weights.check`); ValueError naming model.weights.
    ``checked``: what the data source's check before any work found (`dataset.sources.interface.check_data`)."""
    data = data_for_trial(config, checked)
    if data is not None:
        config.transform.per_channel(data[0][0])  # a per-channel mean or std must have one value per channel
        data = (tuple(data[0]), int(data[1]))
    resizable = source_for(config.download).resizable
    trial_apart(config.model.name, data, resizable, config.model.weights, config.storage_root)


def trial(name: str, data: tuple | None, resizable: bool, weights_source: str | None, root: str) -> None:
    """The trial itself: ``name`` resolves (`check_name`), builds and runs on ``data`` (`try_model`, when the data's
    shape is known) and loads ``weights_source`` (`training.model.weights.check`); ValueError naming the field."""
    check_name(name)
    if data is not None:
        try_model(name, *data, resizable=resizable)
    if weights_source:  # an s3:// folder's shape comes with its conversion: any channels fit the names
        weights.check(weights_source, root, name, *(data or ((3, 32, 32), 2)))


# The refusals a trial's process sends back by class name, raised here as the same class.
_REFUSALS = {cls.__name__: cls for cls in (ValueError, ModelNameError, weights.WeightsError)}


@functools.lru_cache(maxsize=16)
def trial_apart(name: str, data: tuple | None, resizable: bool, weights_source: str | None, root: str) -> None:
    """`trial` in a fresh ``python -m training.model.trust`` with this process's import path and environment;
    its refusal raised here (same class, same message). RuntimeError when that process ends without an answer."""
    request = json.dumps({"name": name, "data": data, "resizable": resizable, "weights_source": weights_source,
                          "root": root})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}  # a user's model module too
    done = subprocess.run([sys.executable, "-m", "training.model.trust"], input=request, capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode == 0:
        return
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
        refusal = _REFUSALS[answer["refused"]](answer["message"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise RuntimeError(f"the model's trial ({sys.executable} -m training.model.trust) ended with exit code "
                           f"{done.returncode} and no answer: {done.stderr.strip()[-2000:]}") from None
    raise refusal


@functools.lru_cache(maxsize=16)
def try_model(name: str, shape: tuple[int, int, int], num_classes: int, resizable: bool = True) -> None:
    """Build ``name`` for ``shape``'s channels and ``num_classes`` classes and run one forward pass (train mode,
    no gradients) on two random images of ``shape``. ValueError naming model.name and what the function
    or the model returned or raised; when the pass raised and the model runs on larger images, naming
    ``transform.image_size`` and the smallest size it runs on (`smallest_size`; ``resizable``: the images
    can be resized, an image folder's; MNIST's IDX digits cannot). Torch's random state is left as it was.
    A model that passed is not tried again in this process (`trial_apart` keeps the same rule for the flow's
    process: the CLI checks before Ray starts, the flow again in its body)."""
    import torch  # torch: only where a model is built or run

    channels, height, width = shape
    images = f"{_TRIAL_IMAGES} images of {channels}x{height}x{width}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            model = build_model(name, in_channels=channels, num_classes=num_classes)
        except ModelNameError:
            raise
        except Exception as exc:  # a torchvision builder's own error
            raise ValueError(f"model.name {name!r}: building it raised {said(exc)}") from None
        try:
            out = _forward(model, shape)
        except Exception as exc:
            raised = f"the model's forward pass on {images} raised {said(exc)}"
            smallest = smallest_size(model, channels, num_classes, min(height, width))
            if smallest is None:
                raise ValueError(f"model.name {name!r}: {raised}") from None
            raise ValueError(_too_small(name, (width, height), smallest, raised, resizable)) from None
    wanted = (_TRIAL_IMAGES, num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != wanted:
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model.name {name!r}: the model's forward pass on {images} returned {got}, not a tensor of shape "
            f"{wanted}: one score per class, and the data has {num_classes} classes"
        )


def _forward(model, shape: tuple[int, int, int]):
    """``model`` in train mode, without gradients, on `_TRIAL_IMAGES` random images of ``shape`` (C, H, W)."""
    import torch  # torch: only where a model is built or run

    with torch.no_grad():
        return model.train()(torch.randn(_TRIAL_IMAGES, *shape))


def smallest_size(model, channels: int, num_classes: int, failed: int, largest: int = MAX_TRIED_SIZE) -> int | None:
    """The smallest square size above ``failed`` (a size the model does not run on) on which ``model`` runs
    (`_forward` returns one score per class), or None when it runs on none up to ``largest``.

    Found by running the model: sizes doubled from ``failed`` until one works, then halved back to the first
    that does (a dozen passes at most; the larger a size, the fewer are tried). A model that runs on a size
    runs on every larger one, as a network of convolutions, pools and a global pooling does."""
    import torch  # torch: only where a model is built or run

    def runs(size: int) -> bool:
        try:
            out = _forward(model, (channels, size, size))
        except Exception:
            return False
        return isinstance(out, torch.Tensor) and tuple(out.shape) == (_TRIAL_IMAGES, num_classes)

    low = failed
    if low >= largest:
        return None
    high = min(max(2 * low, low + 1), largest)
    while not runs(high):
        if high >= largest:
            return None
        low, high = high, min(2 * high, largest)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if runs(middle) else (middle, high)
    return high


def _too_small(name: str, size: tuple[int, int], smallest: int, raised: str, resizable: bool) -> str:
    """The refusal of images of ``size`` (width, height) that are too small for the model ``name``."""
    if not resizable:
        return (f"model.name {name!r}: images of {size[0]}x{size[1]} pixels are too small for it ({raised}); the smallest "
                f"size it runs on is {smallest}x{smallest}, and these images are not resized (transform.image_size is for "
                "download.source=folder or parquet): choose a model that runs on them")
    images = f"images of {size[0]}x{size[1]} pixels are too small for model.name {name!r} ({raised})"
    bounds = TransformConfig.model_fields["image_size"].metadata  # the field's own least value (4)
    least = max([smallest, *(bound.ge for bound in bounds if getattr(bound, "ge", None) is not None)])
    return (f"transform.image_size: {images}; the smallest size it runs on is {smallest}x{smallest}: set "
            f"transform.image_size to {least} or more to resize every image to it, or choose a model for smaller images")


def try_on_dataset(config: PipelineConfig, dataset) -> None:
    """After the conversion: `try_model` (in a process that ends, `trial_apart`) on the converted ``dataset``'s shape
    and classes (a `dataset.formats.parquet.ParquetDataset`) when they were not known before any work (an ``s3://`` folder)."""
    if not known_before_work(config.download):
        shape = (tuple(dataset.image_shape), int(dataset.num_classes))
        trial_apart(config.model.name, shape, True, None, config.storage_root)


def main() -> int:
    """The trial's process: the trial (JSON) on stdin; exit 0 when it passed, else 2 with the refusal (its class
    and message, JSON) as the last line of stdout."""
    request = json.loads(sys.stdin.read())
    data = request["data"]
    try:
        trial(request["name"], (tuple(data[0]), data[1]) if data else None, request["resizable"],
              request["weights_source"], request["root"])
    except ValueError as exc:
        refused = type(exc).__name__ if type(exc).__name__ in _REFUSALS else "ValueError"
        print(json.dumps({"refused": refused, "message": str(exc)}), flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
