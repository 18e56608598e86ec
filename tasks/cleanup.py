"""Stage 6: apply the retention policy (or, with ``dry_run``, only list what it would delete).

Safety rules, checked for every path before anything is deleted: it lies inside the storage
root (symlinks resolved), is not itself a symlink, and is not (nor contains) the checkpoint the
evaluation used, and is not (nor contains) a folder another live run on the same storage root
reads (its lease in ``<root>/leases/``). A path that breaks a rule stops the stage with its name;
nothing is deleted. The dry run applies the same checks, so it lists exactly what a real run deletes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from pipeline_config import CleanupConfig
from tasks.common.logs import stage_logger
from tasks.common.storage import StorageLayout, atomic_write_json, paths_in_use
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


def plan(cfg: CleanupConfig, raw: RawData, dataset: ParquetDataset, trained: TrainedModel, evaluation: Evaluation) -> list[Path]:
    """Paths the policy selects, before any safety check."""
    selected: list[Path] = []
    if cfg.keep_checkpoints:
        ranked = sorted(trained.checkpoints, key=lambda c: checkpoint_rank(c, trained.score), reverse=True)
        selected += [Path(c.path) for c in ranked[cfg.keep_checkpoints :] if c.path != evaluation.checkpoint]
    if cfg.delete_raw:
        selected.append(Path(raw.directory))
    if cfg.delete_parquet:
        selected.append(Path(dataset.directory))
    return selected


def check_deletable(path: Path, layout: StorageLayout, protected: list[Path], in_use: list[Path] = ()) -> None:
    """Raise ValueError naming ``path`` unless it is safe to delete.

    ``protected``: what the evaluation used; ``in_use``: folders other live runs read.
    """
    if path.is_symlink():
        raise ValueError(f"refusing to delete {path}: it is a symbolic link")
    if not layout.contains(path):
        raise ValueError(f"refusing to delete {path}: it is outside the storage root {layout.root}")
    resolved = path.resolve()
    for keep in protected:
        keep = keep.resolve()
        if resolved == keep or keep.is_relative_to(resolved):
            raise ValueError(f"refusing to delete {path}: it holds {keep}, which the evaluation used")
    for used in in_use:
        used = used.resolve()
        if resolved == used or used.is_relative_to(resolved) or resolved.is_relative_to(used):
            raise ValueError(f"refusing to delete {path}: another live run on this storage root reads {used}")


def size_of(path: Path) -> int:
    """Bytes under ``path`` (a file or a folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


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
    paths = [p for p in plan(cfg, raw, dataset, trained, evaluation) if p.exists()]
    in_use = paths_in_use(layout)
    for path in paths:  # every check passes before the first deletion
        check_deletable(path, layout, [Path(evaluation.checkpoint)], in_use)
    total = sum(size_of(p) for p in paths)
    if not cfg.dry_run:
        for path in paths:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    verb = "Would delete" if cfg.dry_run else "Deleted"
    logger.info("%s %d path(s), %d bytes: %s", verb, len(paths), total, [str(p) for p in paths])
    report = CleanupReport(
        dry_run=cfg.dry_run, paths=[str(p) for p in paths], bytes=total, report_path=str(layout.run_dir / "cleanup.json")
    )
    atomic_write_json(report.report_path, report.model_dump())
    return report
