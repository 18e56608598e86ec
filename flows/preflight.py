"""What the training flow checks about the cluster and the registry before any work.

`check_cluster_fits` runs once the run's Ray is up (`runner.pipeline_run.PipelineRun`'s ``check_fits``, at the first stage);
`check_registry_fits` also from the command line, before Ray starts. The data's shape and classes come
from its source (`dataset.sources.interface.Source.check`): the flow never asks which source a run has.
"""

from __future__ import annotations

from dataset.sources.interface import source_for
from dataset.tensors import sizing
from pipeline_config import PipelineConfig
from pipeline_config.model import folder_workload
from runner import console
from storage_io import StorageLayout
from training.champion import lookup, registry_files
from training.resources import plan_cluster


def check_cluster_fits(config: PipelineConfig) -> None:
    """Refuse training workers the cluster cannot hold (`DoesNotFit`: the CLI exits 2), or a champion this run's
    model could never be compared with (ValueError naming the field), before any work starts; say how the
    workload was named, and how training departs from train.num_workers when train.use_gpu=auto has to."""
    import ray  # Ray: only where the cluster is used

    if config.download.path:  # a user's folder: the workload may be named after it
        console.say(workload_line(config))
    check_registry_fits(config)
    if config.train.mode == "single":
        return
    resources = ray.cluster_resources()
    plan = plan_cluster(config.train, resources.get("CPU", 0), resources.get("GPU", 0))
    if plan.note:
        console.say(plan.note)


def workload_line(config: PipelineConfig) -> str:
    """Which workload a run on a user's folder has, and why: ``workload shapes (from the folder's name; ...)``."""
    if config.workload == folder_workload(config.download.path or ""):
        return f"workload {config.workload} (from the folder's name; set --workload to change)"
    return f"workload {config.workload} (set by workload)"


def data_to_come(config: PipelineConfig) -> tuple[tuple[int | None, ...], list[str]]:
    """((channels, height, width), classes) of the data the run will convert, known before any work
    (`dataset.sources.interface.Source.check`, without decoding): a user's folder's from its listing and (local folders)
    its images' headers, None where not known yet (an s3:// folder's channels); MNIST's IDX sources' from their format."""
    found = source_for(config.download).check(sizing.resolved(config).transform.image_size, config.storage_root, decode=False)
    return found.shape, found.classes


def check_registry_fits(config: PipelineConfig) -> None:
    """ValueError, before any work, when the champion of the run's registry name was trained on other
    images or classes than this run's data: promotion could never compare the two."""
    if not config.promote.enabled:
        return
    layout = StorageLayout.create(config.storage_root, "preflight")
    layout.check_reachable()
    try:
        if registry_files.read_champion(layout.root, config.registry_name) is None:
            return  # nothing to compare with: the data is not read for this
    except registry_files.RegistryDamaged:
        return  # promotion names the damage (and --repair mends it)
    shape, classes = data_to_come(config)
    if config.promote.model_name:
        fix = f"Set promote.model_name to a name of this data's own (it is {config.promote.model_name})."
    else:
        fix = (f"Set --workload to a name of this data's own (it is {config.workload}; the champion's name is "
               "<workload>-<model>), or set promote.model_name.")
    lookup.check_comparable(layout.root, config.registry_name, shape, classes, fix)
