"""ClusterCapacityTrigger: a provisioning task waits on the triggerer for a free cluster slot.

Holding no worker slot while it waits matters: a backfill's waiting runs would otherwise take every
executor slot, and the run that holds the cluster could not start its next segment task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from enum import StrEnum

# Triggers are not in airflow.sdk (3.3): airflow.triggers.base is their public home.
from airflow.triggers.base import TriggerEvent

from syncswitch_airflow.backends import get_backend
from syncswitch_airflow.hooks.bucket import BucketHook
from syncswitch_airflow.triggers.base import FieldsTrigger


class CapacityStatus(StrEnum):
    """The ``status`` of the trigger's event."""

    FREE = "free"


class ClusterCapacityTrigger(FieldsTrigger):
    """Fires ``{"status": "free"}`` once backend ``backend`` has a free cluster slot, and none of
    ``hosts`` is held by another cluster (of a pool: ``need`` of them are free)."""

    def __init__(
        self,
        backend: str,
        hosts: list[str] | None = None,
        need: int | None = None,
        poll_seconds: float = 5.0,
        log_seconds: float = 60.0,
    ) -> None:
        super().__init__()
        self.bucket = BucketHook()
        self.backend = backend
        self.hosts = list(hosts or [])
        self.need = need
        self.poll_seconds = poll_seconds
        self.log_seconds = log_seconds

    async def run(self) -> AsyncIterator[TriggerEvent]:
        capacity = get_backend(self.backend).capacity()
        started, next_log = time.monotonic(), 0.0
        while not await self.bucket.in_thread(capacity.has_free_slot, tuple(self.hosts), self.need):
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + self.log_seconds
                holders = await self.bucket.in_thread(capacity.holders)
                self.log.info(
                    "waiting %.0f s for one of %d %s cluster slot(s)%s, held by %s",
                    time.monotonic() - started,
                    capacity.capacity,
                    self.backend,
                    self._hosts_text(),
                    ", ".join(holders),
                )
            await asyncio.sleep(self.poll_seconds)
        yield TriggerEvent({"status": CapacityStatus.FREE.value})

    def _hosts_text(self) -> str:
        if not self.hosts:
            return ""
        if self.need is None:
            return f" and hosts {', '.join(self.hosts)}"
        return f" and {self.need} free host(s) of the pool {', '.join(self.hosts)}"
