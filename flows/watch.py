"""Watch an image folder: when its listing changed since the last look, send ``pipeline.data.landed``.

    python -m flows.watch --path my-images --workload shapes     # one look (an upload step's last command)
    python -m deployments.serve --watch shapes.yaml              # a look every --watch-every seconds, in the serving process

A look lists the folder's images (names, sizes, modification times; nothing is opened) and compares
the listing with the one kept from the last look on the storage root (`dataset.formats.watching`). Any image
added, removed or changed sends one ``pipeline.data.landed`` event about the folder
(``pipeline.folder.<path>``) with the counts in its payload. The deployment ``train/on-data``
(`deployments.reacting`) is triggered by it; several events within its window start one run.

The new listing is kept only once the Prefect API accepted the event (`reporting.events.send`): an
event that was not (the API unreachable, or refusing it) is said, "not sent: ...; will retry on the
next look", and the next look finds the same change and sends it again. The command then exits 1.

The command needs the Prefect server that serves the deployments (``PREFECT_API_URL``): an event
sent to a temporary server would start nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from prefect import flow
from prefect.settings import PREFECT_API_URL

from dataset.formats import watching
from pipeline_config import PipelineConfig
from pipeline_config.model import folder_workload
from reporting import events
from storage_io import StorageLayout, is_dir, is_remote


def watched_path(path: str) -> str:
    """A local folder as an absolute path (the training run may start in another directory); ``s3://`` as given."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def look(path: str, workload: str | None = None, storage_root: str = "storage") -> dict[str, Any]:
    """Look at the image folder ``path``; send ``pipeline.data.landed`` when its images changed since the last look.

    Returns what the event says (``event``: its id; None when nothing changed or nothing could be sent).
    ValueError naming ``path`` when it is no folder.
    """
    folder = watched_path(path)
    if not is_dir(folder):
        raise ValueError(f"path {folder}: no such folder")
    workload = PipelineConfig(workload=workload or folder_workload(folder)).workload  # the flows' name rules
    root = StorageLayout.create(PipelineConfig(storage_root=storage_root).storage_root, "watch").root
    change, listing, to_keep = watching.compare(root, folder)
    result = {"path": folder, "workload": workload, "files": change.files, "added": change.added, "removed": change.removed,
              "changed": change.modified, "digest": change.digest, "examples": list(change.examples)}
    if not change.any:
        if to_keep:  # a first look at an empty folder, or a kept listing that could not be read
            watching.keep(root, folder, change, listing)
        return result | {"event": None, "not_sent": None}
    # Kept only once Prefect accepted the event: a change whose event was lost is news again at the next look.
    event, not_sent = events.send(events.DATA_LANDED, events.folder_resource(folder, workload), result)
    if event is not None:
        watching.keep(root, folder, change, listing)
    return result | {"event": event, "not_sent": not_sent}


def describe(result: dict[str, Any]) -> str:
    """One line on a look: what changed, and whether the event went out (and if not, why)."""
    if not (result["added"] or result["removed"] or result["changed"]):
        return f"{result['path']}: no change ({result['files']} images)"
    counts = f"{result['added']} added, {result['removed']} removed, {result['changed']} changed of {result['files']} images"
    if result["event"]:
        sent = f"sent {events.DATA_LANDED}"
    else:
        sent = f"{events.DATA_LANDED} not sent: {result.get('not_sent') or 'no Prefect API'}; will retry on the next look"
    return f"{result['path']}: {counts}; {sent}"


@flow(name="watch-folder", log_prints=True)
def watch_folder(path: str, workload: str | None = None, storage_root: str = "storage") -> dict[str, Any]:
    """One look at the image folder ``path`` (`look`), as a flow run: what an upload step's command starts."""
    result = look(path, workload, storage_root)
    print(describe(result))
    return result


def main(argv: list[str] | None = None) -> int:
    """One look at a folder, as a command an upload step ends with."""
    parser = argparse.ArgumentParser(prog="python -m flows.watch", description=__doc__.split("\n")[0])
    parser.add_argument("--path", required=True, help="the image folder (local or s3://bucket/prefix)")
    parser.add_argument("--workload", help="the workload it is (unset: named after the folder)")
    parser.add_argument("--storage-root", default="storage", help="where the last listing is kept (default: storage)")
    args = parser.parse_args(argv)

    if not PREFECT_API_URL.value():
        print("PREFECT_API_URL is not set: set it to the Prefect server that serves the deployments "
              "(python -m deployments.serve), or the event starts nothing", file=sys.stderr)
        return 2
    try:
        result = watch_folder(args.path, args.workload, args.storage_root)
    except ValueError as exc:
        print(f"invalid input:\n{exc}", file=sys.stderr)
        return 2
    return 1 if result.get("not_sent") else 0  # a change whose event was not accepted: run the command again


if __name__ == "__main__":
    sys.exit(main())
