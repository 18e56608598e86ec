"""Score a folder of digits with the champion (or a named version) and write the predictions to Parquet.

    python -m flows.predict --input data/mnist-sample                    # IDX files, the champion
    python -m flows.predict --input storage/datasets/mnist-<hash>/test --version 2
    python -m flows.predict --help

The images go through the same Ray Data actor pool the evaluation stage uses
(`training.inference`), normalized and scored exactly as the model card's configuration says
(``transform.mean``/``std``, ``evaluate.tta``), so scoring a run's own test split reproduces its
evaluation's accuracy. With labels in the input, the accuracy is printed too. A local Ray is
started for the command (or ``--ray-address`` joins a cluster); no Prefect API is needed.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from dataset.inputs import NO_LABEL, read_folder
from flows.runtime import local_gcs_port, ray_init_args
from pipeline_config import EvaluateConfig, PipelineConfig, PromoteConfig, RayConfig, TransformConfig
from storage_io import StorageLayout, atomic_write_bytes, join
from training import registry


class PredictSettings(BaseSettings):
    """Score a folder of IDX or Parquet digits with a promoted model and write predictions to Parquet."""

    model_config = SettingsConfigDict(
        cli_prog_name="python -m flows.predict", env_prefix="MNIST_PREDICT_", cli_kebab_case=True,
        cli_implicit_flags=True, cli_hide_none_type=True, cli_avoid_json=True, extra="forbid",
    )

    input: Path = Field(description="Folder of Parquet files (an 'image' column) or IDX files (*-images-idx3-ubyte[.gz]).")
    output: str | None = Field(
        None, description="Parquet file to write (local path or s3://); unset: <storage_root>/predictions/<model>-v<N>-<time>.parquet."
    )
    storage_root: str = Field("storage", description="The storage root the model was promoted on (folder or s3://bucket/prefix).")
    model: str = Field("mnist-resnet18", description="The model's name (promote.model_name of the runs that trained it).")
    version: int | None = Field(None, ge=1, description="A published version number; unset: the champion.")
    num_actors: int = Field(1, ge=1, le=256, description="Model actors in the Ray Data inference pool.")
    batch_rows: int = Field(250, ge=1, le=65536, description="Images per inference batch.")
    ray_address: str | None = Field(None, description="Unset: a local Ray for this command. 'auto' or 'host:port': that cluster.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = CliApp.run(PredictSettings, cli_args=argv)
        PromoteConfig(model_name=settings.model)  # the same name rule as the flow's
        ray_cfg = RayConfig(address=settings.ray_address)
        root = PipelineConfig(storage_root=settings.storage_root).storage_root
        layout = StorageLayout.create(root, "predict")
        layout.check_reachable()
        version, folder, card = registry.resolve(layout.root, settings.model, settings.version)
        table = read_folder(settings.input)
    except (ValidationError, ValueError) as exc:
        print(f"invalid input:\n{exc}", file=sys.stderr)
        return 2
    run_config = card.get("config") or {}
    transform = TransformConfig.model_validate(run_config.get("transform") or {})
    evaluate = EvaluateConfig.model_validate(run_config.get("evaluate") or {}).model_copy(
        update={"num_actors": settings.num_actors, "batch_rows": settings.batch_rows}
    )
    stamp = f"{datetime.now(UTC):%Y%m%d-%H%M%S}"
    output = settings.output or join(layout.root, "predictions", f"{settings.model}-v{version}-{stamp}.parquet")
    print(f"Scoring {len(table):,} digits from {settings.input} with {settings.model} v{version} (run {card.get('run_name')})", flush=True)

    import ray

    from training.inference import predict_table

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
        scoring = ray.remote(num_cpus=0)(predict_table)
        out = ray.get(scoring.remote(table, folder, evaluate, transform, registry.card_model(card)))
    finally:
        ray.shutdown()
    result = pa.table({"row_id": out["row_id"], "label": out["label"], "pred": out["pred"]})
    result = result.replace_schema_metadata({"model": settings.model, "version": str(version), "model_dir": folder})
    buffer = pa.BufferOutputStream()
    pq.write_table(result, buffer)
    atomic_write_bytes(output, buffer.getvalue().to_pybytes())
    labelled = out["label"] != NO_LABEL
    print(f"Predictions: {output}")
    if labelled.any():
        accuracy = float((out["label"][labelled] == out["pred"][labelled]).mean())
        print(f"Accuracy: {accuracy:.2%} on {int(labelled.sum()):,} labelled digits "
              f"(the model card's test accuracy: {card['metrics']['test_accuracy']:.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
