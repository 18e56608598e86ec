"""Stage 6: apply the retention policy (or, with ``dry_run``, only list what it would delete).

Safety rules, checked for every path before anything is deleted: it lies inside the storage
root (symlinks resolved; no '..' in an S3 key), is not itself a symlink, and is not (nor contains) the checkpoint the
evaluation used, and is not (nor contains) a folder another live run on the same storage root
reads (its lease in ``<root>/leases/``). A path that breaks a rule stops the stage with its name;
nothing is deleted. The dry run applies the same checks, so it lists exactly what a real run deletes.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from pipeline_config import CleanupConfig
from tasks.common.logs import stage_logger
from tasks.common.storage import StorageLayout, atomic_write_json, exists, is_remote, join, paths_in_use, remove, total_bytes
from tasks.download import RawData
from tasks.evaluate import Evaluation
from tasks.to_parquet import ParquetDataset
from tasks.train import TrainedModel, checkpoint_rank


class CleanupReport(BaseModel):
    """What the policy deleted (or, in a dry run, would delete)."""

    dry_run: bool
    paths: list[str]
    bytes: int
    report_path: str


def plan(cfg: CleanupConfig, raw: RawData, dataset: ParquetDataset, trained: TrainedModel, evaluation: Evaluation) -> list[str]:
    """Paths the policy selects, before any safety check."""
    selected: list[str] = []
    if cfg.keep_checkpoints:
        ranked = sorted(trained.checkpoints, key=lambda c: checkpoint_rank(c, trained.score), reverse=True)
        selected += [c.path for c in ranked[cfg.keep_checkpoints :] if c.path != evaluation.checkpoint]
    if cfg.delete_raw:
        selected.append(raw.directory)
    if cfg.delete_parquet:
        selected.append(dataset.directory)
    return selected


def _canonical(path: str | os.PathLike[str]) -> str:
    """A local path with symlinks and '..' resolved; an ``s3://`` URI as given (`contains` refuses '..')."""
    return str(path).rstrip("/") if is_remote(path) else str(Path(path).resolve())


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def check_deletable(
    path: str | os.PathLike[str], layout: StorageLayout, protected: list[str], in_use: list[str] = ()
) -> None:
    """Raise ValueError naming ``path`` unless it is safe to delete.

    ``protected``: what the evaluation used; ``in_use``: folders other live runs read.
    """
    if not is_remote(path) and Path(path).is_symlink():
        raise ValueError(f"refusing to delete {path}: it is a symbolic link")
    if not layout.contains(path):
        raise ValueError(f"refusing to delete {path}: it is outside the storage root {layout.root}")
    resolved = _canonical(path)
    for keep in map(_canonical, protected):
        if _within(keep, resolved):
            raise ValueError(f"refusing to delete {path}: it holds {keep}, which the evaluation used")
    for used in map(_canonical, in_use):
        if _within(used, resolved) or _within(resolved, used):
            raise ValueError(f"refusing to delete {path}: another live run on this storage root reads {used}")


@task(name="cleanup")
def cleanup(
    cfg: CleanupConfig,
    raw: RawData,
    dataset: ParquetDataset,
    trained: TrainedModel,
    evaluation: Evaluation,
    layout: StorageLayout,
) -> CleanupReport:
    """Delete what the retention policy selects, inside the storage root only (or list it in a dry run)."""
    logger = stage_logger(__name__)
    selected = plan(cfg, raw, dataset, trained, evaluation)
    in_use = paths_in_use(layout)
    for path in selected:  # every check passes before the first deletion (also for paths already gone)
        check_deletable(path, layout, [evaluation.checkpoint], in_use)
    paths = [p for p in selected if exists(p)]
    total = sum(total_bytes(p) for p in paths)
    if not cfg.dry_run:
        for path in paths:
            remove(path)
    verb = "Would delete" if cfg.dry_run else "Deleted"
    logger.info("%s %d path(s), %d bytes: %s", verb, len(paths), total, paths)
    report = CleanupReport(dry_run=cfg.dry_run, paths=paths, bytes=total, report_path=join(layout.run_dir, "cleanup.json"))
    atomic_write_json(report.report_path, report.model_dump())
    return report
