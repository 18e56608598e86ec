"""Stage 3: run the Ray Data transform over every split once, check what comes out, record it.

The transform itself (`dataset.transform`) is lazy and built again by training and evaluation;
this stage runs it over train, validation and test before any training starts, checks every
batch (shape, dtype, finite values, label range, row counts) and writes ``transform.json``, so
training consumes exactly what was checked.
"""

from __future__ import annotations

from prefect import task

from dataset.parquet import ParquetDataset
from dataset.transform import TransformSpec, build_datasets, check_split
from pipeline_config import TransformConfig
from reporting.logs import stage_logger
from storage_io import StorageLayout, atomic_write_json, join


@task(name="transform")
def transform(dataset: ParquetDataset, cfg: TransformConfig, layout: StorageLayout) -> TransformSpec:
    """Run the Ray Data transform over every split once, check its output and record it."""
    logger = stage_logger(__name__)
    spec = TransformSpec(dataset=dataset, config=cfg, checks={}, manifest=join(layout.run_dir, "transform.json"))
    datasets = build_datasets(spec, splits=("train", "val", "test"))
    checks = {name: check_split(ds, dataset.rows[name], name) for name, ds in datasets.items()}
    spec = spec.model_copy(update={"checks": checks})
    atomic_write_json(spec.manifest, spec.model_dump(mode="json"))
    logger.info("Transform checked: %s", {k: v["rows"] for k, v in checks.items()})
    return spec
