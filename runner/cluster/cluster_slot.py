"""One run at a time on a shared Ray cluster: the run slot a run holds from its first stage to its end.

Every stage plans from the cluster's total CPUs as if the run had the cluster alone: the training
placement group takes all but ``train.data_cpus`` (`training.resources.plan_cluster`), which the
run's Ray Data tasks use; a folder's conversion holds a CPU while its decoding tasks take the rest.
Two runs at once on one 2-CPU cluster both placed their training groups and neither run's Ray Data
tasks could ever start: both stayed at "[4/7] train" until killed (issue 66). So a run that joins
a cluster (``ray.address``, or the head of the serving process that executes it) takes the
cluster's run slot before its first stage (`runner.cluster.ray_init.SignalKeepingRayTaskRunner`), after its
checks (a bad configuration is refused at once, not after a wait). While another run holds the
slot it waits, and says so at once and then every `SAY_EVERY_S`: whose run, since when, how long
it has waited. It starts when the slot frees. A stop request (Ctrl-C, SIGTERM, Cancel in the UI)
ends the wait as it ends a stage.

The slot is a named Ray actor (`SLOT_NAME` in namespace `SLOT_NAMESPACE`, no CPUs) created by the
run's driver, so Ray ends it with its owner: a run killed in any way (SIGKILL included) frees the
slot; a run that ends frees it at once (`free`). A run's own local Ray has nobody to share it and
takes no slot. Waiters poll every `POLL_S`; with several waiting, the next run is whichever asks
first, not the one that came first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from runner import console
from runner.stopping import STOP, RunStopped

SLOT_NAME = "pipeline-run-slot"
SLOT_NAMESPACE = "pipeline"
SAY_EVERY_S = 30.0
POLL_S = 1.0


class RunSlot:
    """The actor that is the slot: it only says who holds it."""

    def __init__(self, run: str, since: float):
        self.holder = {"run": run, "since": since}  # when the run took it (the actor's process may start later)

    def held_by(self) -> dict[str, Any]:
        return self.holder


def take(run: str, where: str, say: Callable[[str], None] | None = None, every_s: float = SAY_EVERY_S) -> Any:
    """The cluster's run slot for ``run`` (an actor handle to give to `free`), once no other run holds it.

    While another run does, says (``say``, default `runner.console.say`: the terminal and the run's log)
    what it waits for at once and every ``every_s`` seconds; ``where`` names the cluster in that line.
    `RunStopped` when the run is asked to stop meanwhile. Keep the handle while the run lasts: Ray ends the
    actor, and frees the slot, when its last handle goes.
    """
    say = say or console.say
    started = time.monotonic()
    said_at: float | None = None
    while True:
        mine = _try_take(run)
        if mine is not None:
            if said_at is not None:
                say(f"the Ray cluster at {where} is free: run {run} starts after waiting {console.duration(time.monotonic() - started)}")
            return mine
        other = holder()
        now = time.monotonic()
        if other is not None and (said_at is None or now - said_at >= every_s):
            since = datetime.fromtimestamp(other["since"], UTC).strftime("%H:%M:%S UTC")
            say(f"waiting for the Ray cluster at {where}: run {other['run']} holds it since {since} (one run at a time "
                f"on a shared cluster); waited {console.duration(now - started)}")
            said_at = now
        if STOP.requested:
            raise RunStopped(None, f"{STOP.reason or 'stopped'} while waiting for the Ray cluster")
        time.sleep(POLL_S)


def free(slot: Any) -> None:
    """End the slot's actor: the next waiting run takes the slot within `POLL_S`."""
    import ray  # Ray: only where the cluster is used

    try:
        ray.kill(slot, no_restart=True)
    except Exception:  # noqa: BLE001, S110 - already gone (its owner disconnected): the slot is free either way
        pass


def _try_take(run: str) -> Any:
    """The slot's actor when this call created it; None when another run holds the slot.

    The name is registered by Ray's GCS as the actor is created, in this call: of two runs asking at
    once, one gets ``ActorAlreadyExistsError`` (checked on Ray 2.60 with the pre-check that
    ``ray/actor.py`` calls racy bypassed)."""
    import ray  # Ray: only where the cluster is used

    try:
        return ray.remote(RunSlot).options(name=SLOT_NAME, namespace=SLOT_NAMESPACE, num_cpus=0, max_restarts=0).remote(run, time.time())
    except ValueError:  # ActorAlreadyExistsError is one: another run holds the slot
        return None


def holder() -> dict[str, Any] | None:
    """Who holds the slot (``run``, ``since``), or None when nobody does or the holder is just going."""
    import ray  # Ray: only where the cluster is used

    try:
        return ray.get(ray.get_actor(SLOT_NAME, namespace=SLOT_NAMESPACE).held_by.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - no such actor, or it ended between the two calls
        return None
