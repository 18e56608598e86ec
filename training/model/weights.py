"""``model.weights``: a fresh training run that starts from weights you have instead of random ones.

The source is a state dict file, local or ``s3://`` (torchvision's ``.pth`` files as they come; a
run's ``model.pt``, or a checkpoint or registry version folder holding one), or the champion of a
model in this storage root's registry by its name (``shapes-resnet18``: a value of lowercase
letters, digits and ``-`` alone; write ``./name`` for a local file of such a name). `locate` turns
it into the one file to read; `read_state` reads it with ``torch.load(weights_only=True)`` (tensors
and plain containers only: no code in the file runs), takes its sha256 and checks it against the
``_checksums.json`` beside it when there is one (a run's own files); a ``module.`` prefix (a DDP
model's) is stripped.

`match` loads every tensor whose name and shape fit the model and leaves the others at their fresh
initialisation: the first layer when the data has other channels, the head when it has other
classes (no kernel is averaged or repeated over channels). `Match.describe` is the log line that
names the layers starting fresh. A file that fits nothing at all is refused (`check`), before any
work, naming ``model.weights``.

The file is checked and its sha256 taken before any work (`training.model.trust.check_model`), again
by the training stage (`check`, which logs the match), and every worker loads it for a fresh start
only (`start_from`), refusing bytes other than the stage's (a file replaced during the run).
`StartWeights.record` (source and file redacted, sha256) goes into each checkpoint's extra state,
the training result, the model card and the run's summary.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from storage_io import is_dir, is_file, is_remote, join, parent, read_bytes, read_json, redact_text
from training.champion.lookup import resolve
from training.champion.registry_files import MODELS_DIR, champions, read_champion
from training.checkpoint.files import CHECKSUMS_FILE, MODEL_FILE
from training.model.catalog import ModelSpec, build_model, said

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

REGISTRY_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # promote.model_name's rule: no dot, no slash
_PREFIX = "module."
_LISTED = 8  # layer names a log line lists before "and N more"


class WeightsError(ValueError):
    """``model.weights`` names nothing usable: the message names the field, the file and what is wrong."""


class StartWeights(BaseModel):
    """The weights a fresh start loads: ``source`` as given, the ``file`` read, and its ``sha256``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    file: str
    sha256: str

    def record(self) -> dict[str, str]:
        """What checkpoints, the model card, the summary and MLflow keep: source and file without credentials."""
        return {"source": redact_text(self.source), "file": redact_text(self.file), "sha256": self.sha256}


@dataclass
class Match:
    """How a state dict fits a model: the tensors loaded, and those starting fresh (with why)."""

    loaded: list[str] = field(default_factory=list)
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)  # name: (file's, model's)
    missing: list[str] = field(default_factory=list)  # the model's, not in the file
    unexpected: list[str] = field(default_factory=list)  # the file's, not in the model

    @property
    def fresh(self) -> list[str]:
        """The model's tensors left at their fresh initialisation."""
        return [*self.mismatched, *self.missing]

    def fresh_layers(self) -> list[str]:
        """The layers (module names) with a tensor starting fresh, in the model's order of first mention."""
        return list(dict.fromkeys(name.rpartition(".")[0] or name for name in self.fresh))

    def describe(self, source: str, sha256: str) -> str:
        """``model.weights X (sha256 ab12...): 120 of 122 tensors loaded; fresh: conv1 (64x3x7x7 in the file, ...), fc``."""
        total = len(self.loaded) + len(self.fresh)
        line = f"model.weights {redact_text(source)} (sha256 {sha256[:12]}): {len(self.loaded)} of {total} tensors loaded"
        layers = []
        for layer in self.fresh_layers():
            shapes = next((s for n, s in self.mismatched.items() if (n.rpartition(".")[0] or n) == layer), None)
            why = f"{_shape(shapes[0])} in the file, {_shape(shapes[1])} here" if shapes else "not in the file"
            layers.append(f"{layer} ({why})")
        line += f"; starting fresh: {_listed(layers)}" if layers else "; every layer loaded"
        if self.unexpected:
            line += f"; not used from the file: {_listed(self.unexpected)}"
        return line


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(n) for n in shape) or "scalar"


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def is_registry_name(source: str) -> bool:
    """Whether ``source`` names a registry model (``shapes-resnet18``) rather than a file."""
    return bool(REGISTRY_NAME.fullmatch(source))


def locate(source: str, root: str) -> str:
    """The file ``source`` names: a registry model's champion model.pt under ``root``, a folder's model.pt,
    or the file itself (local paths made absolute). WeightsError naming model.weights when there is none."""
    shown = redact_text(source)
    if is_registry_name(source):
        return _champion_file(source, root if is_remote(root) else os.path.abspath(os.path.expanduser(root)))
    path = source if is_remote(source) else os.path.abspath(os.path.expanduser(source))
    try:
        if is_dir(path):
            path = join(path, MODEL_FILE)
        if is_file(path):
            return path
    except OSError as exc:  # an unreachable bucket, no permission
        raise WeightsError(f"model.weights {shown!r}: cannot be reached ({said(exc)})") from None
    raise WeightsError(f"model.weights {shown!r}: no such file ({redact_text(path)})")


def _champion_file(name: str, root: str) -> str:
    """The champion's model.pt of the registry model ``name`` on ``root``, checked against its checksum."""
    try:
        if read_champion(root, name) is None:
            known = ", ".join(sorted(champions(root))) or "none"
            raise WeightsError(
                f"model.weights {name!r}: no model of that name with a champion in the registry at "
                f"{redact_text(join(root, MODELS_DIR))} (models with a champion: {known}); for a local file of that "
                f"name write ./{name}"
            )
        _, folder, _ = resolve(root, name)  # model.pt verified against its checksum
    except WeightsError:
        raise
    except ValueError as exc:  # RegistryDamaged: a damaged pointer, card or model.pt, named
        raise WeightsError(f"model.weights {name!r}: {exc}") from None
    except OSError as exc:
        raise WeightsError(f"model.weights {name!r}: the registry cannot be read ({said(exc)})") from None
    return join(folder, MODEL_FILE)


def read_state(file: str, source: str, expected_sha256: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """(the state dict in ``file``, ``module.`` prefixes stripped; the file's sha256). WeightsError naming
    model.weights when it cannot be read, is damaged, or holds no tensors; or, with ``expected_sha256``,
    when its bytes are not those any more."""
    import torch  # torch: only where a model is built or run

    shown = f"model.weights {redact_text(source)!r}"
    try:
        data = read_bytes(file)
    except OSError as exc:
        raise WeightsError(f"{shown}: {redact_text(file)} cannot be read ({said(exc)})") from None
    sha256 = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise WeightsError(f"{shown}: {redact_text(file)} changed since the run checked it "
                           f"(sha256 {sha256[:12]}, was {expected_sha256[:12]}); start the run again")
    listed = read_json(join(parent(file), CHECKSUMS_FILE))
    name = file.rstrip("/").rsplit("/", 1)[-1]
    if isinstance(listed, dict) and isinstance(listed.get(name), str) and listed[name] != sha256:
        raise WeightsError(f"{shown}: {redact_text(file)} does not match its sha256 in {CHECKSUMS_FILE} "
                           "(truncated or modified); refusing to load it")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file: not a zip, a pickle of code, truncated
        raise WeightsError(f"{shown}: {redact_text(file)} is not a state dict file torch.load reads with weights_only=True "
                           f"(damaged, or not written by torch.save: {said(exc)}); give one saved with "
                           "torch.save(model.state_dict(), path)") from None
    return _state_dict(state, f"{shown}: {redact_text(file)}"), sha256


def _state_dict(state: object, shown: str) -> dict[str, torch.Tensor]:
    """The tensors of a loaded file by name, without a ``module.`` prefix; WeightsError when there are none."""
    import torch  # torch: only where a model is built or run

    if not isinstance(state, Mapping):
        raise WeightsError(f"{shown} holds {type(state).__name__}, not a state dict (a mapping of names to tensors)")
    tensors = {}
    for key, value in state.items():
        if isinstance(key, str) and isinstance(value, torch.Tensor):
            while key.startswith(_PREFIX):
                key = key[len(_PREFIX):]
            tensors[key] = value
    if not tensors:
        raise WeightsError(f"{shown} holds no tensors: not a state dict (a mapping of names to tensors)")
    return tensors


def match(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Match:
    """Load into ``model`` every tensor of ``state`` whose name and shape fit; the others stay as built."""
    own = model.state_dict()
    found = Match(unexpected=[key for key in state if key not in own])
    for key, tensor in own.items():
        if key not in state:
            found.missing.append(key)
        elif tuple(state[key].shape) != tuple(tensor.shape):
            found.mismatched[key] = (tuple(state[key].shape), tuple(tensor.shape))
        else:
            found.loaded.append(key)
    if found.loaded:
        model.load_state_dict({key: state[key] for key in found.loaded}, strict=False)
    return found


def check(source: str, root: str, model_name: str, shape: tuple[int, int, int], num_classes: int) -> tuple[StartWeights, Match]:
    """Before any work and in the training stage: ``source`` located, read and loaded into ``model_name`` built for
    ``shape``'s channels and ``num_classes``; WeightsError naming model.weights when no tensor of it fits."""
    import torch  # torch: only where a model is built or run

    file = locate(source, root)
    state, sha256 = read_state(file, source)
    with torch.random.fork_rng(devices=[]):  # building draws random weights: the caller's random state stays
        model = build_model(model_name, in_channels=shape[0], num_classes=num_classes)
    found = match(model, state)
    if not found.loaded:
        theirs, ours = list(state)[:3], list(model.state_dict())[:3]
        raise WeightsError(
            f"model.weights {redact_text(source)!r}: none of the {len(state)} tensors in {redact_text(file)} fits "
            f"model.name {model_name!r} (the file has {', '.join(theirs)}, ...; the model has {', '.join(ours)}, ...): "
            "weights of another architecture?"
        )
    return StartWeights(source=source, file=file, sha256=sha256), found


def start_from(model: torch.nn.Module, weights: Mapping | None) -> Match | None:
    """A fresh start on a worker: load the `StartWeights` ``weights`` (a dict) into ``model``, refusing a file whose
    bytes are not the ones the training stage checked. None (nothing loaded) without weights."""
    if not weights:
        return None
    start = StartWeights.model_validate(dict(weights))
    state, _ = read_state(start.file, start.source, expected_sha256=start.sha256)
    return match(model, state)


def for_training(source: str | None, root: str, spec: ModelSpec) -> tuple[StartWeights | None, str]:
    """The training stage's `check` of ``source`` (None: none) for the `ModelSpec` it trains, and the log line."""
    if not source:
        return None, "model.weights unset: random initial weights"
    start, found = check(source, root, spec.name, (spec.in_channels, 1, 1), spec.num_classes)
    return start, found.describe(source, start.sha256) + " (a fresh start; a resumed run goes on from its checkpoint)"
