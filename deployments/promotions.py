"""How a serving replica learns of a new champion: Prefect's ``pipeline.model.promoted`` events, and the pointer.

`ChampionFollower` is a thread of the replica (`deployments.serve_model.ChampionEndpoint`) that reads the model's
champion pointer every ``every_s`` seconds and at once when a promotion event of the model arrives, and hands each new
version to the replica (``on_version``), which loads, checks and swaps it. The event is a "look now", not the truth: the
pointer says which version is the champion, so an event of another storage root's model of the same name, a repeated
event or one lost on the way changes nothing but when the pointer is read. Without a Prefect API (``api_url`` empty) or
while it is unreachable, the pointer alone is followed, ``every_s`` seconds late at most.

The events come from Prefect's event stream (``get_events_subscriber``, the websocket ``/api/events/out``, filtered to
``pipeline.model.promoted`` of ``pipeline.model.<name>``), the stream ``score/on-promotion``'s trigger matches on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from reporting import events
from training.champion.registry_files import read_champion

logger = logging.getLogger("ray.serve")
FOREVER = timedelta(days=36500)
RECONNECT_S = 5.0  # between tries to reach the event stream after it closed or could not be opened


class ChampionFollower:
    """Follows ``model``'s champion under ``root`` from ``version`` on: ``on_version(v)`` for each new one, in order."""

    def __init__(self, root: str, model: str, version: int, on_version: Callable[[int], None], every_s: float = 5.0,
                 api_url: str | None = None):
        self.root, self.model, self.version, self.on_version, self.every_s = root, model, version, on_version, every_s
        self.api_url = api_url if api_url is not None else os.environ.get("PREFECT_API_URL", "")
        self.wake, self.stopped = threading.Event(), threading.Event()
        self.listening = False  # the event stream is open now
        self.events_seen = 0

    def start(self) -> ChampionFollower:
        threading.Thread(target=self._follow, name="champion-follower", daemon=True).start()
        if self.api_url:
            threading.Thread(target=asyncio.run, args=(self._listen(),), name="promotion-events", daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()

    def describe(self) -> dict:
        """How this replica follows its champion (``GET /model``'s ``following``)."""
        return {"pointer_every_s": self.every_s, "events": bool(self.api_url), "events_connected": self.listening,
                "events_seen": self.events_seen}

    def _follow(self) -> None:
        while not self.stopped.is_set():
            self.wake.wait(self.every_s)
            self.wake.clear()
            if self.stopped.is_set():
                return
            try:
                pointer = read_champion(self.root, self.model)
            except Exception as exc:  # a damaged or unreachable pointer: the version answering keeps answering
                logger.warning("%s: the champion pointer cannot be read, v%s keeps answering: %s", self.model, self.version, exc)
                continue
            if pointer and pointer["version"] != self.version:
                self.version = pointer["version"]  # once, refused or not: a refused version is not retried
                self.on_version(self.version)

    async def _listen(self) -> None:
        """Wake `_follow` on each promotion event of the model; reopen the stream after it closed."""
        from prefect.events import filters  # Prefect: only in a replica that has an API
        from prefect.events.clients import get_events_subscriber  # Prefect: only in a replica that has an API

        while not self.stopped.is_set():
            # From now on: the stream's default window replays 180 days of past promotions first; its default end is now.
            now = datetime.now(timezone.utc)
            wanted = filters.EventFilter(event=filters.EventNameFilter(name=[events.PROMOTED]),
                                         occurred=filters.EventOccurredFilter(since=now, until=now + FOREVER),
                                         resource=filters.EventResourceFilter(id=[f"pipeline.model.{self.model}"]))
            try:
                async with get_events_subscriber(filter=wanted, reconnection_attempts=0) as stream:
                    self.listening = True
                    self.wake.set()  # a promotion while the stream was closed: the pointer has it
                    async for event in stream:
                        self.events_seen += 1
                        logger.info("%s: %s v%s", self.model, event.event, event.payload.get("version"))
                        self.wake.set()
                        if self.stopped.is_set():
                            return
            except Exception as exc:  # the API down or restarting: the pointer is still followed meanwhile
                logger.info("%s: Prefect's event stream closed (%s); reopening in %gs", self.model, exc, RECONNECT_S)
            self.listening = False
            await asyncio.sleep(RECONNECT_S)
