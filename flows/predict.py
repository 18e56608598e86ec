"""Score a folder of images with the champion (or a named version) and write the predictions to Parquet.

    python -m flows.predict --input data/mnist-sample                    # IDX files, the champion
    python -m flows.predict --input storage/datasets/mnist-<hash>/test --version 2
    python -m flows.predict --input my-images/test                       # <class>/*.png: labelled
    python -m flows.predict --input hf-shapes/data --model hf-shapes-tiny-net   # a Hugging Face split's Parquet files
    python -m flows.predict --input <folder> --workload flowers --model flowers-small-cnn   # another workload's model
    python -m flows.predict --help

The images must be what the model was trained on: the model card records their shape, the class
names and the normalization (`training.champion.registry_files.card_data`), and the data source of the model's run
reads the input to that shape (`dataset.sources.interface.Source.read_inputs`; for every source the project ships,
`dataset.inputs.read`: an image folder's PNG/JPEG files resized to ``transform.image_size`` when the
run set it; Parquet files of encoded images read from the columns the run read, its
``download.image_column`` and ``label_column``). Predictions are class numbers; the ``pred_class``
column names them.

The images go through the same Ray Data actor pool the evaluation stage uses
(`training.inference`), normalized and scored exactly as the model card's configuration says
(``transform.mean``/``std``, ``evaluate.tta``), so scoring a run's own test split reproduces its
evaluation's accuracy. With labels in the input, the accuracy is printed too. A local Ray is
started for the command (or ``--ray-address`` joins a cluster); no Prefect API is needed.

Everything is checked before Ray starts, and a bad input exits 2 naming the file or flag
(``--flag: message``, one line each): every input file (`dataset.inputs.read`), the registry (a
``--model`` it does not hold, answered with the models that have a champion; a damaged pointer or
card, a model.pt that does not match its checksum: `training.champion.lookup.resolve`), and
``--output`` (a folder or another kind of file is refused; an existing file only replaced with
``--overwrite``, keeping its mode).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError
from pydantic_settings import CliApp

from dataset.formats.parquet import MNIST_CLASSES
from dataset.inputs.tables import NO_LABEL
from pipeline_config import (
    PipelineConfig,
    PromoteConfig,
    RayConfig,
)
from pipeline_config.predict import PredictSettings
from pipeline_config.settings import old_prefix_lines
from runner.cluster import ray_auth
from runner.cluster.ray_init import local_gcs_port, ray_init_args
from storage_io import (
    StorageLayout,
    atomic_write_bytes,
    exists,
    has_control_characters,
    is_dir,
    is_file,
    is_remote,
    join,
    redact_error,
    redact_text,
)
from training.champion import lookup, registry_files
from training.champion.card_scoring import CardScoring, card_scoring

if TYPE_CHECKING:
    import numpy as np


def check_output(output: str, overwrite: bool) -> int | None:
    """Refuse an --output that cannot or may not be written, before any work; the mode to keep when it is replaced.

    A folder, a symbolic link or any other non-regular file is never replaced; an existing
    regular file only with ``overwrite``. ValueError naming the path and what is wrong.
    """
    if not output.strip() or has_control_characters(output):
        raise ValueError(f"--output {output!r}: empty, or contains a line break or another control character")
    if is_remote(output):
        try:
            PipelineConfig(storage_root=output)  # the bucket-name and prefix rules of an s3:// root
        except ValidationError as exc:
            raise ValueError(f"--output {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        if is_dir(output):
            raise ValueError(f"--output {output}: is a folder (objects exist under it); name a file, e.g. {output.rstrip('/')}/predictions.parquet")
        if is_file(output) and not overwrite:
            raise ValueError(f"--output {output}: exists already; pass --overwrite to replace it")
        return None
    path = Path(output).expanduser()
    if path.is_symlink():
        raise ValueError(f"--output {path}: is a symbolic link; name the file itself")
    if path.is_dir():
        raise ValueError(f"--output {path}: is a folder; name a file, e.g. {path / 'predictions.parquet'}")
    if path.exists():
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"--output {path}: exists and is not a regular file (a device, pipe or socket); name another file")
        if not overwrite:
            raise ValueError(f"--output {path}: exists already; pass --overwrite to replace it")
        if not os.access(path, os.W_OK):
            raise ValueError(f"--output {path}: exists and is not writable")
        return stat.S_IMODE(mode)
    probe = path.absolute().parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--output {path}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--output {path}: {probe} is not writable")
    return None


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def default_output(root: str, model: str, version: int) -> str:
    """``<root>/predictions/<model>-v<N>-<time>.parquet``, never an existing file's name."""
    stamp = f"{datetime.now(UTC):%Y%m%d-%H%M%S}"
    output, n = join(root, "predictions", f"{model}-v{version}-{stamp}.parquet"), 1
    while exists(output):
        n += 1
        output = join(root, "predictions", f"{model}-v{version}-{stamp}-{n}.parquet")
    return output


def score_table(table: pa.Table, folder: str, scoring: CardScoring, ray_cfg: RayConfig) -> dict[str, np.ndarray]:
    """`predict_table` over ``table`` with the model in ``folder``, on a Ray started (or joined) for this call only."""
    # Imported only now, after the input checked out: torch and Ray Data take seconds to import,
    # and a bad --input must be refused within seconds (docs/architecture.md).
    import ray

    from training.inference import predict_table  # torch and Ray Data: after the input checked out

    address, kwargs = ray_init_args(ray_cfg, api_url="")
    kwargs["runtime_env"]["env_vars"].pop("PREFECT_API_URL", None)  # no Prefect here
    kwargs["logging_level"] = logging.ERROR  # this terminal shows the result; Ray's session logs keep the rest
    if ray_cfg.address is None:
        kwargs["include_dashboard"] = False  # a short command: no dashboard to look at
    with local_gcs_port(kwargs):
        ray.init(address, **kwargs)
    try:
        # Driven from a Ray task, as the evaluation stage is: Ray Data's progress lines go to the
        # worker's log, not this terminal (ray.log_to_driver is off).
        remote_predict = ray.remote(num_cpus=0)(predict_table)
        job = remote_predict.remote(table, folder, scoring.evaluate, scoring.transform, scoring.model, scoring.data["shape"])
        return ray.get(job)
    finally:
        ray.shutdown()


def predictions_parquet(out: dict[str, np.ndarray], names: list[str], model: str, version: int) -> bytes:
    """The predictions as a Parquet file's bytes: row_id, label, pred and the class name ``pred_class``,
    with the model, its version and its folder in the schema's metadata."""
    result = pa.table({
        "row_id": out["row_id"], "label": out["label"], "pred": out["pred"],
        "pred_class": [names[int(p)] if 0 <= int(p) < len(names) else str(int(p)) for p in out["pred"]],
    })
    model_dir = f"{registry_files.MODELS_DIR}/{model}/v{version}"  # relative to the storage root
    result = result.replace_schema_metadata({"model": model, "version": str(version), "model_dir": model_dir})
    buffer = pa.BufferOutputStream()
    pq.write_table(result, buffer)
    return buffer.getvalue().to_pybytes()


# A field of the models this command validates its arguments with -> the flag that sets it.
_FLAGS = {"model_name": "--model", "address": "--ray-address"}


def field_lines(exc: ValidationError) -> str:
    """A ValidationError as ``--flag: message`` lines, one per error (no pydantic dump)."""
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        flag = _FLAGS.get(field, "--" + field.replace("_", "-")) if field else "arguments"
        lines.append(f"{flag}: {redact_text(error['msg']).removeprefix('Value error, ')}")
    return "\n".join(lines)


def check_model(root: str, model: str, which: str) -> None:
    """ValueError naming the models that have a champion when ``model`` has no folder in the registry at all
    (a typo in --model, or the default name where no run of it promoted); ``which``: how the error names it."""
    if is_dir(registry_files.model_dir(root, model)):
        return  # resolve() tells a missing champion from a damaged one
    found = registry_files.champions(root)
    there = ", ".join(f"{name} (champion v{version})" for name, version in found.items())
    hint = f"the models with a champion there, to pass as --model: {there}" if found else "no model there has a champion yet; run the pipeline until one passes its gate"
    raise ValueError(f"{which}: no such model in {join(root, registry_files.MODELS_DIR)}; {hint}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for line in old_prefix_lines(PredictSettings):
        print(line, file=sys.stderr)
    try:
        settings = CliApp.run(PredictSettings, cli_args=argv)
        PipelineConfig(workload=settings.workload)  # the same name rules as the flow's
        model = PromoteConfig(model_name=settings.model_name()).model_name
        ray_cfg = RayConfig(address=settings.ray_address)
        root = PipelineConfig(storage_root=settings.storage_root).storage_root
        keep_mode = check_output(settings.output, settings.overwrite) if settings.output is not None else None
        layout = StorageLayout.create(root, "predict")
        layout.check_reachable()
        which = f"--model {model}" if settings.model else f"the default model {model} (of --workload {settings.workload})"
        check_model(layout.root, model, which)
        # The pointer and card read, model.pt checked against its checksum: a damaged registry is named here.
        version, folder, card = lookup.resolve(layout.root, model, settings.version)
        scoring = card_scoring(card, folder, settings.num_actors, settings.batch_rows)
        data = scoring.data
        table = scoring.read_inputs(settings.input)  # as the model's run's data source reads them
        output = settings.output or default_output(layout.root, model, version)
        refused = ray_auth.token_problem(ray_cfg.address)  # a cluster that would turn this process's token away
        if refused:
            raise ValueError(refused.replace("ray.address", "--ray-address", 1))
    except ValidationError as exc:
        print(f"invalid input:\n{field_lines(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"invalid input:\n{redact_error(exc)}", file=sys.stderr)
        return 2
    noun = "digits" if list(data["classes"]) == list(MNIST_CLASSES) else "images"
    print(f"Scoring {len(table):,} {noun} from {settings.input} with {model} v{version} (run {card.get('run_name')})", flush=True)
    out = score_table(table, folder, scoring, ray_cfg)
    parquet = predictions_parquet(out, data["classes"], model, version)
    if settings.output is None and exists(output):  # another command took the default name meanwhile
        output = default_output(layout.root, model, version)
    elif not settings.overwrite and exists(output):  # appeared while scoring
        print(f"--output {output}: was created while scoring; not replaced (pass --overwrite)", file=sys.stderr)
        return 2
    atomic_write_bytes(output, parquet)
    if not is_remote(output):  # a temporary file's 0600 would otherwise stay
        os.chmod(output, keep_mode if keep_mode is not None else _new_file_mode())
    labelled = out["label"] != NO_LABEL
    print(f"Predictions: {output}")
    if labelled.any():
        accuracy = float((out["label"][labelled] == out["pred"][labelled]).mean())
        print(f"Accuracy: {accuracy:.2%} on {int(labelled.sum()):,} labelled {noun} "
              f"(the model card's test accuracy: {card['metrics']['test_accuracy']:.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
