"""The deployments that make training react, served by ``python -m deployments.serve --watch / --score``.

- the watcher (``--watch CONFIG``): a thread of the serving process looks at the config's
  ``download.path`` every ``--watch-every`` seconds and sends ``pipeline.data.landed`` when its images
  changed (`flows.watch.look`). A thread, not a scheduled deployment: a look takes milliseconds, and
  as flow runs the looks would queue behind a training run for the serving process's one slot
  (``--limit 1``), then run all at once.
- ``train/on-data`` (``--watch CONFIG``): the generic flow with the config file's parameters, over the
  ``default`` preset, with ``promote.skip_unchanged`` on. Its trigger: ``pipeline.data.landed`` about
  that folder. A reactive trigger fires on the first event, ignores the rest of its ``--debounce``
  window, and the run it starts waits for the window to end, so a burst of uploads is one run that
  sees all of them (Prefect's debouncing pattern: ``within`` and ``schedule_after``).
- ``score/on-promotion`` (``--score FOLDER``): on each ``pipeline.model.promoted`` event of the watched
  workload's model (MNIST's ``mnist-resnet18`` without ``--watch``), scores FOLDER with that champion
  version and writes the predictions under the storage root (`flows.score`).

Each trigger is an automation on the Prefect server, created when the deployment is served; its
parameters are the flow's own, so the UI shows what each event will start.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from dataset.sources.interface import watched
from pipeline_config import PipelineConfig
from pipeline_config.settings import preset_with_file
from reporting import events

WATCH_EVERY_S = 60.0
DEBOUNCE_S = 60.0


def watched_config(config_file: Path) -> PipelineConfig:
    """The on-data run's configuration: the default preset, the config file over it, skipping runs with nothing new.

    ValueError naming the file when it does not validate or names no folder to watch (an image or Parquet folder).
    """
    config = PipelineConfig.model_validate(preset_with_file("default", config_file))
    folder = watched(config.download)
    if folder is None:
        raise ValueError(
            f"--watch {config_file}: set download.source: folder and download.path, the folder to watch "
            "(or download.source: parquet and download.path, a folder of Parquet files)"
        )
    from flows.watch import watched_path  # the flow is imported only when its deployments are served

    download = config.download.model_copy(update={"path": watched_path(folder)})
    promote = config.promote.model_copy(update={"skip_unchanged": True})
    return config.model_copy(update={"download": download, "promote": promote})


def build(
    config_file: Path | None, score_folder: str | None, common: dict[str, Any],
    watch_every_s: float = WATCH_EVERY_S, debounce_s: float = DEBOUNCE_S,
) -> list:
    """The reacting deployments ``--watch`` and ``--score`` ask for (none without them)."""
    config = watched_config(config_file) if config_file else None
    built = []
    if config is not None:
        built.append(_on_data_deployment(config, debounce_s, common))
    if score_folder:
        built.append(_score_deployment(config or PipelineConfig(), score_folder, common))
    return built


class Watcher(threading.Thread):
    """Looks at the watched folder every ``every_s`` seconds until stopped; prints each look that found a change."""

    def __init__(self, config: PipelineConfig, every_s: float):
        super().__init__(name="folder-watcher", daemon=True)
        self.config, self.every_s, self.stopped = config, every_s, threading.Event()

    def run(self) -> None:
        from flows.watch import describe, look  # the flow is imported only when its deployments are served

        self.wait_for_trigger()
        while not self.stopped.is_set():
            try:
                result = look(self.config.download.path, self.config.workload, self.config.storage_root)
                if result["event"] is not None or result["added"] or result["removed"] or result["changed"]:
                    print(describe(result), flush=True)
            except Exception as exc:  # noqa: BLE001 - a folder that cannot be listed now may be listable at the next look
                print(f"watching {self.config.download.path}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self.stopped.wait(self.every_s)

    def wait_for_trigger(self) -> None:
        """Until ``train/on-data``'s trigger exists on the server: an event sent before it would start nothing."""
        from prefect.client.orchestration import get_client  # only when deployments are built

        while not self.stopped.is_set():
            try:
                with get_client(sync_client=True) as client:
                    deployment = client.read_deployment_by_name("train/on-data")
                    if client.read_resource_related_automations(f"prefect.deployment.{deployment.id}"):
                        return
            except Exception:  # noqa: BLE001 - not registered yet (404), or the server is starting
                pass
            self.stopped.wait(1.0)


def watcher(config_file: Path | None, every_s: float = WATCH_EVERY_S) -> Watcher | None:
    """The watcher of ``--watch CONFIG``'s folder (not started), or None without ``--watch``."""
    return Watcher(watched_config(config_file), every_s) if config_file else None


def _on_data_deployment(config: PipelineConfig, debounce_s: float, common: dict[str, Any]):
    from prefect.events import DeploymentEventTrigger  # only when deployments are built

    from flows.train import train_pipeline  # the flow is imported only when its deployments are served

    parameters = {"config": config.model_dump(mode="json")}
    window = timedelta(seconds=debounce_s)
    trigger = DeploymentEventTrigger(
        name=f"{config.workload}: data landed in {config.download.path}",
        expect={events.DATA_LANDED},
        match={"prefect.resource.id": events.folder_resource(config.download.path, config.workload)["prefect.resource.id"]},
        posture="Reactive", threshold=1, within=window, schedule_after=window, parameters=parameters,
    )
    return train_pipeline.to_deployment(
        name="on-data", parameters=parameters, triggers=[trigger],
        description=(
            f"Trains {config.workload} when {events.DATA_LANDED} says {config.download.path} changed (one run per "
            f"{debounce_s:g}s window, started when the window ends); ends as nothing new when the data is the champion's."
        ),
        tags=["ray", "workload", "on-data"], **common,
    )


def _score_deployment(config: PipelineConfig, folder: str, common: dict[str, Any]):
    from prefect.events import DeploymentEventTrigger  # only when deployments are built

    from flows.score import score_with_champion  # the flow is imported only when its deployments are served
    from flows.watch import watched_path  # the flow is imported only when its deployments are served

    model = config.registry_name
    parameters = {"model": model, "images": watched_path(folder), "storage_root": config.storage_root}
    trigger = DeploymentEventTrigger(
        name=f"{model}: new champion", expect={events.PROMOTED},
        match={"prefect.resource.id": events.model_resource(model, config.workload, config.model.name)["prefect.resource.id"]},
        posture="Reactive", threshold=1, within=timedelta(0),
        parameters=parameters | {"version": "{{ event.payload.version }}"},
    )
    return score_with_champion.to_deployment(
        name="on-promotion", parameters=parameters, triggers=[trigger],
        description=f"Scores {folder} with each new champion of {model}: predictions under <storage_root>/predictions/{model}/.",
        tags=["score", model], **common,
    )
