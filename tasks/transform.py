"""Stage 3: run the Ray Data transform over every split once, check what comes out, record it.

The transform itself (`dataset.tensors.transform`) is lazy and built again by training and evaluation;
this stage runs it over train, validation and test before any training starts, checks every
batch (shape, dtype, finite values, label range, row counts) and writes ``transform.json``, so
training consumes exactly what was checked. Every split is read here (a split held in memory whole, a
streamed one a window at a time) through the functions Ray Data's tasks map (`split_batches`): checking
through Ray Data started its actors and task workers, which stayed beside the training that followed.

The checks are also recorded beside the Parquet files, per transform config
(`dataset.tensors.spec.checks_record_path`). A later run whose to-parquet stage verified the same
dataset (every file's sha256) with the same config reuses them: the transform is a pure function
of those two, so running every split again would check the same rows to the same result, for
seconds of every start (docs/design.md).
"""

from __future__ import annotations

from prefect import task

from dataset.formats.parquet import ParquetDataset
from dataset.tensors import normalization
from dataset.tensors.batches import check_rows, check_split
from dataset.tensors.memory import release_memory
from dataset.tensors.read_ahead import split_batches
from dataset.tensors.spec import (
    TransformSpec,
    checks_record,
    checks_record_path,
    fits_in_memory,
    recorded_checks,
    split_mb,
)
from pipeline_config import TransformConfig
from reporting.logs import stage_logger
from storage_io import StorageLayout, atomic_write_json, join, storage_writes

SPLITS = ("train", "val", "test")


@task(name="transform")
def transform(dataset: ParquetDataset, cfg: TransformConfig, layout: StorageLayout) -> TransformSpec:
    """Run the transform over every split once, check its output and record it."""
    logger = stage_logger(__name__)
    cfg = normalization.resolve(cfg, dataset)  # mean, std and augment for this data: what training and the model card use
    logger.info("Normalization (per channel): mean %s, std %s; augmentation: %s", cfg.mean, cfg.std, cfg.augment)
    spec = TransformSpec(dataset=dataset, config=cfg, checks={}, manifest=join(layout.run_dir, "transform.json"))
    budget = spec.budget_mb()  # settled once here: every rank and evaluation read each split the same way
    spec = spec.model_copy(update={"in_memory_mb": budget})
    streamed = tuple(split for split in SPLITS if not fits_in_memory(spec, split))
    logger.info(
        "Reading: a split of up to %s MB of decoded images is held in memory (%s), a larger one streams in windows of "
        "%s MB; %s", f"{budget:,}", "transform.in_memory_mb" if cfg.in_memory_mb is not None else "1/256 of the smallest node's memory",
        cfg.window_mb, ", ".join(f"{split} {split_mb(spec, split):,.0f} MB {'streamed' if split in streamed else 'in memory'}" for split in SPLITS),
    )
    spec = spec.model_copy(update={"streamed": streamed})
    checks = recorded_checks(spec, SPLITS)
    reused = checks is not None
    if checks is None:
        rows = check_rows(dataset.image_shape)
        checks = {
            name: check_split(split_batches(spec, name, rows), dataset.rows[name], name, dataset.image_shape, dataset.num_classes)
            for name in SPLITS
        }
        with storage_writes("transform", dataset.directory):
            atomic_write_json(checks_record_path(spec), checks_record(spec, checks))
        logger.info("Transform checked: %s", {k: v["rows"] for k, v in checks.items()})
    else:
        logger.info("Transform checks of this dataset and config reused from %s: %s", checks_record_path(spec),
                    {k: v["rows"] for k, v in checks.items()})
    spec = spec.model_copy(update={"checks": checks, "skipped": reused})
    atomic_write_json(spec.manifest, spec.model_dump(mode="json"))
    release_memory()  # this Ray worker is reused (by the train stage next): it should not hold the checks' peak
    return spec
