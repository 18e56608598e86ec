"""Stage 6: apply the retention policy (or, with ``dry_run``, only list what it would delete).

Safety rules, checked for every path before anything is deleted: it lies inside the storage
root (symlinks resolved; no '..' in an S3 key), is not itself a symlink, and is not (nor contains) the checkpoint the
evaluation used, and is not (nor contains) a folder another live run on the same storage root
reads (its lease in ``<root>/leases/``). A path that breaks a rule stops the stage with its name;
nothing is deleted. The dry run applies the same checks, so it lists exactly what a real run deletes.

The model registry is never touched: nothing under ``<root>/models/`` and none of the data a
promoted version's model card names (`training.champion.lookup.protected_data`). A selected path that
is, holds or lies inside such a folder is kept, listed with why in the report (dry run or not).
Cards name that data relative to the storage root, so a copied or moved root keeps its champion's
data; an older card's absolute path protects the same place under this root too, and a card that
cannot be read keeps all of ``raw/`` and ``datasets/``. Nothing outside the current root is ever
deleted, whatever a card or lease names. ``delete_raw`` never selects a user's image folder
(``download.source=folder``): it was read where it is and is not the pipeline's to delete.

Whatever the policy, incomplete checkpoint folders in the run folder go too (`incomplete_checkpoints`):
debris of an upload that failed or was cut short, which Ray Train never registered. A checkpoint
Ray Train knows (its snapshot, the training result, the evaluated one) is never touched here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from dataset.formats.parquet import ParquetDataset
from dataset.sources.interface import RawData
from pipeline_config import CleanupConfig
from reporting.logs import stage_logger
from storage_io import (
    StorageLayout,
    atomic_write_json,
    basename,
    exists,
    is_remote,
    join,
    list_dirs,
    paths_in_use,
    remove,
    total_bytes,
)
from tasks.manifests import Evaluation
from training.champion import lookup
from training.checkpoint.files import checkpoint_problem
from training.manifests import TrainedModel, UnreadableSnapshot, checkpoint_rank, ray_train_checkpoints


class CleanupReport(BaseModel):
    """What the policy deleted (or, in a dry run, would delete)."""

    dry_run: bool
    paths: list[str]
    bytes: int
    report_path: str
    # Of ``paths``: checkpoint folders removed (or, in a dry run, to remove) because they were
    # incomplete, each with the reason ("model.pt does not match its sha256 ...").
    incomplete_checkpoints: dict[str, str] = {}
    # Selected by the policy but kept for the model registry, each with why ("named by the model card of ...").
    kept: dict[str, str] = {}

    def terminal_detail(self) -> str:
        """What the cleanup stage's closing terminal line adds after its name and seconds."""
        verb = "would delete" if self.dry_run else "deleted"
        kept = f", kept {len(self.kept)} for the model registry" if self.kept else ""
        return f": {verb} {len(self.paths)} item(s){kept}"


def plan(cfg: CleanupConfig, raw: RawData, dataset: ParquetDataset, trained: TrainedModel, evaluation: Evaluation) -> list[str]:
    """Paths the policy selects, before any safety check."""
    selected: list[str] = []
    if cfg.keep_checkpoints:
        ranked = sorted(trained.checkpoints, key=lambda c: checkpoint_rank(c, trained.score), reverse=True)
        selected += [c.path for c in ranked[cfg.keep_checkpoints :] if c.path != evaluation.checkpoint]
    if cfg.delete_raw:  # the source's own files only: a user's folder is read where it is, never deleted
        selected += raw.deletable()
    if cfg.delete_parquet:
        selected.append(dataset.directory)
    return selected


def incomplete_checkpoints(run_dir: str, known: list[str] = ()) -> dict[str, str]:
    """Checkpoint folders directly in ``run_dir`` that are incomplete, each with why; never a known one.

    Known: recorded in Ray Train's snapshot or named in ``known`` (the training result's
    checkpoints, the evaluated one). The rest are incomplete when `checkpoint_problem` says so:
    no ``_checksums.json``, a file it names missing, or one not matching its sha256. With an
    unreadable snapshot nothing is judged (UnreadableSnapshot): any folder might be Ray Train's.
    """
    protected = ray_train_checkpoints(run_dir) | {basename(path) for path in known}
    found: dict[str, str] = {}
    for name in list_dirs(run_dir):
        path = join(run_dir, name)
        if not name.startswith("checkpoint_") or name in protected:
            continue
        if not is_remote(path) and Path(path).is_symlink():
            continue  # not ours to judge; check_deletable would refuse it anyway
        try:
            problem = checkpoint_problem(path)
        except OSError as exc:  # could not read it (a network error on S3, say): no verdict, keep it
            logging.getLogger(__name__).warning("Could not check %s, leaving it: %s", path, exc)
            continue
        if problem is not None:
            found[path] = problem
    return found


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


def _overlaps(path: str, folder: str) -> bool:
    """``path`` is ``folder``, lies inside it, or holds it (symlinks resolved locally)."""
    a, b = _canonical(path), _canonical(folder)
    return _within(a, b) or _within(b, a)


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
    known = [c.path for c in trained.checkpoints] + [trained.best_checkpoint, evaluation.checkpoint]
    try:
        debris = incomplete_checkpoints(layout.run_dir, known)
    except UnreadableSnapshot as exc:
        logger.warning("Not looking for incomplete checkpoints: %s", exc)
        debris = {}
    selected += [path for path in debris if path not in selected]
    registry_folders = lookup.protected_data(layout.root)
    kept = {path: why for path in selected for folder, why in registry_folders.items() if _overlaps(path, folder)}
    selected = [path for path in selected if path not in kept]
    in_use = paths_in_use(layout)
    for path in selected:  # every check passes before the first deletion (also for paths already gone)
        check_deletable(path, layout, [evaluation.checkpoint], in_use)
    paths = [p for p in selected if exists(p)]
    total = sum(total_bytes(p) for p in paths)
    if not cfg.dry_run:
        for path in paths:
            remove(path)
    verb = "Would delete" if cfg.dry_run else "Deleted"
    for path, problem in debris.items():
        logger.warning("%s incomplete checkpoint %s: %s (Ray Train never registered it: a failed or cut-short upload)",
                       verb, path, problem)
    for path, why in kept.items():
        logger.info("Keeping %s: %s", path, why)
    logger.info("%s %d path(s), %d bytes: %s", verb, len(paths), total, paths)
    report = CleanupReport(
        dry_run=cfg.dry_run, paths=paths, bytes=total, report_path=join(layout.run_dir, "cleanup.json"),
        incomplete_checkpoints=debris, kept=kept,
    )
    atomic_write_json(report.report_path, report.model_dump())
    return report
