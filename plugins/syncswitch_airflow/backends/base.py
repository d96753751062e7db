"""The cluster backend protocol: provision a cluster, launch segments detached, watch them, tear down.

A backend is stateless: everything it needs to find a run's processes again is in the JSON-friendly
``handle`` dict that ``provision`` returns. The handle travels through XCom and ``state.json``, so the
segment task, its trigger (on the triggerer) and the teardown task, possibly in different processes,
all act on the same cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec, SegmentSpec

Handle = dict[str, Any]

RUNNING = "running"
EXITED = "exited"
UNKNOWN = "unknown"


class ClusterError(RuntimeError):
    """The backend could not provision, launch or tear down; the message says what and why."""


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


class ClusterBackend(Protocol):
    name: str

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


def get_backend(name: str) -> ClusterBackend:
    """The backend registered under ``name`` (the ``cluster_backend`` param)."""
    if name == "local":
        from syncswitch_airflow.backends.local import LocalBackend

        return LocalBackend()
    raise ClusterError(f"unknown cluster backend {name!r}; available: local")
