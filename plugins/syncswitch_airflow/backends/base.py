"""The cluster backend protocol: provision a cluster, launch segments detached, watch them, tear down.

A backend is stateless: everything it needs to find a run's processes again is in the JSON-friendly
``handle`` dict that ``provision`` returns. The handle travels through XCom and ``state.json``, so the
segment task, its trigger (on the triggerer) and the teardown task, possibly in different processes,
all act on the same cluster.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec, SegmentSpec

from syncswitch_airflow import settings

log = logging.getLogger(__name__)

Handle = dict[str, Any]

# Every cluster process carries its cluster's (and its segment's) folder in these variables: how a
# backend finds, and on teardown kills, exactly its own processes.
CLUSTER_ENV = "SYNCSWITCH_CLUSTER_DIR"
SEGMENT_ENV = "SYNCSWITCH_SEGMENT_DIR"

RUNNING = "running"
EXITED = "exited"
UNKNOWN = "unknown"


def default_work_root() -> str:
    """The Airflow worker's own folder for clusters (local clusters, the hosts backend's leases and
    keys): ``[syncswitch] work_dir``, else ``<tmp>/syncswitch``."""
    return settings.get("work_dir") or os.path.join(tempfile.gettempdir(), "syncswitch")


class ClusterError(RuntimeError):
    """The backend could not provision, launch or tear down; the message says what and why."""


class ClusterBusy(ClusterError):
    """Every cluster slot of the backend is taken; provisioning waits (deferred) for one."""


@dataclass(frozen=True)
class SegmentStatus:
    """Where a segment's launcher process stands.

    ``state`` is ``running``, ``exited`` (``exit_code`` is None when the launcher vanished without
    reporting one, e.g. it was SIGKILLed) or ``unknown`` (never launched on this cluster).
    """

    state: str
    exit_code: int | None = None
    pid: int | None = None

    @property
    def running(self) -> bool:
        return self.state == RUNNING


class ClusterCapacity:
    """At most ``capacity`` clusters of a backend at once, whoever asks: scheduled runs, UI triggers and
    a backfill's many active runs alike (a backfill's own max_active_runs is not capped by the DAG's).

    One lease file per slot in ``folder``; a run holds one from provisioning to teardown. Creating the
    file exclusively is the lock, so two provisioning tasks never take one slot. A lease whose cluster
    is gone is free again once it is ``STALE_SECONDS`` old: its folder no longer exists (the holder
    tore down, or was never provisioned, but died before releasing), or ``cluster_alive(lease)`` says
    none of it runs (a run abandoned with its Airflow, a machine restarted with the folder kept).
    """

    STALE_SECONDS = 120.0

    def __init__(
        self,
        folder: str | os.PathLike[str],
        capacity: int,
        cluster_alive: Callable[[dict[str, Any]], bool] | None = None,
        setting: str | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.capacity = max(int(capacity), 1)
        self.cluster_alive = cluster_alive
        self.setting = setting  # the [syncswitch] key the capacity came from, named when all are taken

    @classmethod
    def from_setting(
        cls,
        folder: str | os.PathLike[str],
        setting: str,
        cluster_alive: Callable[[dict[str, Any]], bool] | None = None,
    ) -> ClusterCapacity:
        """The capacity that ``[syncswitch] <setting>`` sets."""
        return cls(folder, settings.get_int(setting), cluster_alive, setting)

    def acquire(self, run: str, cluster_dir: str) -> bool:
        """Take a free slot for ``run`` (True; also when it holds one already), or False if all are taken."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.held_by(run) is not None:
            return True
        for slot in range(self.capacity):
            path = self.folder / f"slot-{slot}.json"
            self._drop_if_stale(path)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"run": run, "cluster_dir": cluster_dir, "acquired_at": time.time()}, f)
            return True
        return False

    def claim(self, run: str, cluster_dir: str, what: str) -> None:
        """``acquire``, or ClusterBusy naming the holders and the setting that sets the capacity."""
        if not self.acquire(run, cluster_dir):
            taken = f"all {self.capacity} {what} cluster slot(s) are taken (by {', '.join(self.holders())})"
            if self.setting is None:
                raise ClusterBusy(taken)
            env = settings.setting(self.setting).env
            raise ClusterBusy(
                f"{taken}; [{settings.SECTION}] {self.setting} (or ${env}) sets how many run at once"
            )

    def release(self, run: str) -> None:
        path = self.held_by(run)
        if path is not None:
            path.unlink(missing_ok=True)

    def held_by(self, run: str) -> Path | None:
        for path, lease in self._leases():
            if lease.get("run") == run:
                return path
        return None

    def has_free_slot(self) -> bool:
        for slot in range(self.capacity):
            path = self.folder / f"slot-{slot}.json"
            self._drop_if_stale(path)
            if not path.exists():
                return True
        return False

    def holders(self) -> list[str]:
        return [lease.get("run", "?") for _path, lease in self._leases()]

    def _leases(self) -> list[tuple[Path, dict[str, Any]]]:
        leases = []
        for path in sorted(self.folder.glob("slot-*.json")):
            try:
                leases.append((path, json.loads(path.read_text())))
            except (OSError, ValueError):
                continue
        return leases

    def _drop_if_stale(self, path: Path) -> None:
        try:
            lease = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if time.time() - float(lease.get("acquired_at", 0)) <= self.STALE_SECONDS:
            return  # provisioning may still be under way
        gone = not os.path.isdir(lease.get("cluster_dir", "")) or (
            self.cluster_alive is not None and not self.cluster_alive(lease)
        )
        if gone:
            log.warning("%s: the cluster of run %s is gone; slot freed", path.name, lease.get("run"))
            path.unlink(missing_ok=True)


class ClusterBackend(Protocol):
    name: str

    def capacity(self) -> ClusterCapacity:
        """How many clusters of this backend may exist at once, and who holds them."""
        ...

    def provision(self, job: JobSpec, layout: RunLayout) -> Handle:
        """Reserve the cluster for one run; idempotent for the same run."""
        ...

    def launch_segment(self, handle: Handle, spec: SegmentSpec) -> dict[str, Any]:
        """Start ``syncswitch train --spec`` for one segment, detached; returns the launch record."""
        ...

    def segment_status(self, handle: Handle, index: int) -> SegmentStatus: ...

    def segment_log_tail(self, handle: Handle, index: int, lines: int = 20) -> str:
        """The last lines of the segment launcher's output, for failure messages."""
        ...

    def stop_segment(self, handle: Handle, index: int, grace_seconds: float = 30.0) -> list[int]:
        """Stop one segment's processes (SIGTERM, then SIGKILL after the grace); returns pids killed."""
        ...

    def teardown(self, handle: Handle) -> dict[str, Any]:
        """Kill every process of the run, verify they are gone, free the work folder; idempotent."""
        ...
