"""The cluster backend protocol: provision a cluster, launch segments detached, watch them, tear down.

A backend is stateless: everything it needs to find a run's processes again is in the JSON-friendly
``handle`` dict that ``provision`` returns. The handle travels through XCom and ``state.json``, so the
segment task, its trigger (on the triggerer) and the teardown task, possibly in different processes,
all act on the same cluster.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec, SegmentSpec

from syncswitch_airflow import settings

log = logging.getLogger(__name__)

Handle = dict[str, Any]

# Every cluster process carries its cluster's (and its segment's) folder in these variables: how a
# backend finds, and on teardown kills, exactly its own processes.
CLUSTER_ENV = "SYNCSWITCH_CLUSTER_DIR"
SEGMENT_ENV = "SYNCSWITCH_SEGMENT_DIR"

# A lease whose run has recorded no cluster this long after taking it is free again.
PROVISIONING_SECONDS = 1800.0

RUNNING = "running"
EXITED = "exited"
UNKNOWN = "unknown"


def default_work_root() -> str:
    """The Airflow worker's own folder for clusters (local clusters, the hosts backend's leases and
    keys): ``[syncswitch] work_dir``, else ``<tmp>/syncswitch``."""
    return settings.get("work_dir") or os.path.join(tempfile.gettempdir(), "syncswitch")


class ClusterError(RuntimeError):
    """The backend could not provision, launch or tear down; the message says what and why."""


class SegmentAlreadyRunning(ClusterError):
    """A launch refused, having started nothing: the segment launched before (by the trigger of the
    segment before it, or an earlier try) still runs. Its task follows that one."""


class ClusterBusy(ClusterError):
    """Every cluster slot of the backend is taken, or a host the run needs is held by another
    cluster (of a pool: fewer than ``need`` are free); provisioning waits (deferred) until
    ``has_free_slot(hosts, need)``."""

    def __init__(self, message: str, hosts: tuple[str, ...] = (), need: int | None = None) -> None:
        super().__init__(message)
        self.hosts = tuple(hosts)
        self.need = need


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


# Executors whose tasks all run on the scheduler's machine. syncswitch_airflow.warm_start's
# WarmLocalExecutor is the LocalExecutor (the embedded Airflow runs it).
SINGLE_MACHINE_EXECUTORS = frozenset(
    {"LocalExecutor", "WarmLocalExecutor", "SequentialExecutor", "DebugExecutor"}
)


def distributed_executors(executors: str) -> list[str]:
    """The executors of ``[core] executor`` = ``executors`` that run tasks on other machines (Celery,
    Kubernetes, Edge ...), by class name."""
    names = [part.strip().rsplit(".", 1)[-1] for part in executors.split(",") if part.strip()]
    return [name for name in names if name not in SINGLE_MACHINE_EXECUTORS]


def capacity_refusal(executors: str) -> str:
    """Why clusters cannot be counted across this deployment ("" if they can): with workers on other
    machines and ``[syncswitch] leases_dir`` unset, each worker would keep its own capacity ledger in
    its own work folder, and two of them could give one host to two clusters. A folder set by hand is
    trusted to be shared (a bucket, or a filesystem every worker mounts)."""
    distributed = distributed_executors(executors)
    if not distributed or settings.get("leases_dir"):
        return ""
    return (
        "[syncswitch] leases_dir is unset, so every Airflow worker would count clusters in its own "
        f"work folder, but this Airflow runs tasks on other machines ([core] executor: "
        f"{', '.join(distributed)}); set it (AIRFLOW__SYNCSWITCH__LEASES_DIR) to a gs:// folder that "
        "every worker reaches"
    )


def leases_uri(backend: str) -> str:
    """The capacity ledger of ``backend``: ``<[syncswitch] leases_dir>/<backend>.json``.

    On a distributed Airflow (several workers, no shared disk) ``leases_dir`` is a folder in a bucket
    that every worker reaches, so the whole deployment shares one ledger; by default it is in the
    worker's own work folder, which is right for a single-machine Airflow."""
    root = settings.get("leases_dir") or os.path.join(default_work_root(), "leases")
    return f"{root.rstrip('/')}/{backend}.json"


class ClusterCapacity:
    """At most ``capacity`` clusters of a backend at once, and no host in two of them, whoever asks:
    scheduled runs, UI triggers, a backfill's many active runs, on any worker of the deployment.

    One JSON ledger (``leases_uri``) holds a lease per run, from provisioning to teardown: the run,
    the hosts its cluster holds, and where to find out whether that cluster still exists. Each
    change is one atomic read-modify-write (``storage.update_json``: a file lock on a local ledger, a
    generation precondition on a bucket's), so two workers provisioning at the same moment never
    take one slot or one host. A lease whose cluster is gone is dropped once it is ``STALE_SECONDS``
    old (younger, its provisioning may still be under way): ``cluster_gone(lease)`` says so, by
    default when its ``cluster_dir`` no longer exists.
    """

    STALE_SECONDS = 120.0

    def __init__(
        self,
        ledger: str | os.PathLike[str],
        capacity: int,
        cluster_gone: Callable[[dict[str, Any]], bool] | None = None,
        setting: str | None = None,
        what: str = "",
    ) -> None:
        self.ledger = os.fspath(ledger)
        self.what = what  # the backend, as messages name it
        self.capacity = max(int(capacity), 1)
        self.cluster_gone = cluster_gone or _cluster_dir_gone
        self.setting = setting  # the [syncswitch] key the capacity came from, named when all are taken

    @classmethod
    def from_setting(
        cls, backend: str, setting: str, cluster_gone: Callable[[dict[str, Any]], bool] | None = None
    ) -> ClusterCapacity:
        """``backend``'s ledger, with the capacity that ``[syncswitch] <setting>`` sets."""
        return cls(leases_uri(backend), settings.get_int(setting), cluster_gone, setting, backend)

    def acquire(
        self,
        run: str,
        cluster_dir: str = "",
        hosts: tuple[str, ...] = (),
        need: int | None = None,
        **where: str,
    ) -> bool:
        """``claim`` as a yes or no: True when ``run`` holds a slot (also one it held already), False
        if every slot is taken or too few of ``hosts`` are free. ``where``: more of what finds the
        cluster again (``run_dir``), kept in the lease for ``cluster_gone``."""
        try:
            self.claim(run, cluster_dir, hosts, need, **where)
        except ClusterBusy:
            return False
        return True

    def claim(
        self,
        run: str,
        cluster_dir: str = "",
        hosts: tuple[str, ...] = (),
        need: int | None = None,
        **where: str,
    ) -> tuple[str, ...]:
        """The hosts ``run`` now holds, or ClusterBusy naming who holds the slots or the hosts, and the
        setting. ``need`` None: every one of ``hosts``; a number: that many of them, the first free
        ones in their order (a pool that several runs of one job share). A run that already holds a
        lease gets the same hosts again (a retried provisioning task)."""
        taken, refused = self._take(run, hosts, need, {"cluster_dir": cluster_dir, **where})
        if taken is not None:
            return taken
        if self.setting is not None and refused.startswith("all "):
            env = settings.setting(self.setting).env
            refused += f"; [{settings.SECTION}] {self.setting} (or ${env}) sets how many run at once"
        raise ClusterBusy(refused, hosts, need)

    def _take(
        self, run: str, hosts: tuple[str, ...], need: int | None, lease: dict[str, Any]
    ) -> tuple[tuple[str, ...] | None, str]:
        """(the hosts taken, "") or (None, why not)."""
        gone = self._gone()
        outcome: tuple[tuple[str, ...] | None, str] = (None, "")

        def take(ledger: dict[str, Any]) -> None:
            nonlocal outcome
            leases = _drop(ledger.setdefault("leases", {}), gone)
            if run in leases:
                outcome = (tuple(leases[run].get("hosts", [])), "")
                return
            refused = self._refusal(leases, list(hosts), need)
            if refused:
                outcome = (None, refused)
                return
            chosen = _free_hosts(leases, list(hosts))[: len(hosts) if need is None else need]
            leases[run] = {
                **lease,
                "hosts": chosen,
                "run": run,
                "holder": socket.gethostname(),
                "acquired_at": time.time(),
            }
            outcome = (tuple(chosen), "")

        storage.update_json(self.ledger, take)
        return outcome

    def _refusal(self, leases: dict[str, dict[str, Any]], hosts: list[str], need: int | None) -> str:
        held = {h: r for r, lease in leases.items() for h in lease.get("hosts", []) if h in hosts}
        held_text = ", ".join(f"{h} (run {r})" for h, r in held.items())
        if need is None and held:
            return "host(s) held by another cluster: " + held_text
        if need is not None and len(hosts) - len(held) < need:
            return (
                f"{len(hosts) - len(held)} of the pool's {len(hosts)} host(s) are free, {need} needed; "
                f"held: {held_text}"
            )
        if len(leases) >= self.capacity:
            what = f"{self.what} " if self.what else ""
            return f"all {self.capacity} {what}cluster slot(s) are taken (by {', '.join(leases)})"
        return ""

    def release(self, run: str) -> None:
        if self.held_by(run):
            storage.update_json(self.ledger, lambda ledger: ledger.setdefault("leases", {}).pop(run, None))

    def held_by(self, run: str) -> bool:
        return run in self._leases()

    def has_free_slot(self, hosts: tuple[str, ...] = (), need: int | None = None) -> bool:
        """Whether ``acquire`` with ``hosts`` and ``need`` would succeed now (frees the leases of gone
        clusters)."""
        gone = self._gone()
        if gone:
            storage.update_json(self.ledger, lambda ledger: _drop(ledger.setdefault("leases", {}), gone))
        return not self._refusal(_drop(self._leases(), gone), list(hosts), need)

    def holders(self) -> list[str]:
        return sorted(self._leases())

    def _leases(self) -> dict[str, dict[str, Any]]:
        return dict(storage.read_json(self.ledger, default={}).get("leases", {}))

    def _gone(self) -> dict[str, float]:
        """run -> acquired_at of the leases to drop: old enough, and their cluster is gone. Checked
        outside the ledger's update (it may read other files), dropped inside it only if unchanged."""
        gone = {}
        for run, lease in self._leases().items():
            acquired_at = float(lease.get("acquired_at", 0))
            if time.time() - acquired_at > self.STALE_SECONDS and self.cluster_gone(lease):
                log.warning("%s: the cluster of run %s is gone; its slot is freed", self.ledger, run)
                gone[run] = acquired_at
        return gone


def run_cluster_gone(lease: dict[str, Any]) -> bool:
    """Whether the cluster of a lease's run is gone, as the run's state.json in the bucket says (any
    worker reads it): its run has finished (teardown runs before), or it recorded no cluster within
    ``PROVISIONING_SECONDS`` (its provisioning died; creating VMs can take minutes)."""
    state = storage.read_json(RunLayout(lease.get("run_dir", "")).state, default=None) or {}
    if state.get("cluster"):
        return bool(state.get("timings", {}).get("finished"))
    return time.time() - float(lease.get("acquired_at", 0)) > PROVISIONING_SECONDS


def _free_hosts(leases: dict[str, dict[str, Any]], hosts: list[str]) -> list[str]:
    held = {h for lease in leases.values() for h in lease.get("hosts", [])}
    return [h for h in hosts if h not in held]


def _drop(leases: dict[str, dict[str, Any]], gone: dict[str, float]) -> dict[str, dict[str, Any]]:
    for run, acquired_at in gone.items():
        if float(leases.get(run, {}).get("acquired_at", -1)) == acquired_at:
            del leases[run]
    return leases


def _cluster_dir_gone(lease: dict[str, Any]) -> bool:
    return not os.path.isdir(lease.get("cluster_dir", ""))


class ClusterBackend(Protocol):
    name: str

    def capacity(self) -> ClusterCapacity:
        """How many clusters of this backend may exist at once, and who holds them."""
        ...

    def provision(self, job: JobSpec, layout: RunLayout) -> Handle:
        """Reserve the cluster for one run; idempotent for the same run."""
        ...

    def launch_segment(self, handle: Handle, spec: SegmentSpec) -> dict[str, Any]:
        """Start ``syncswitch train --spec`` for one segment, detached; returns the launch record
        (``pid``, ``log``; ``fork_servers``, host name -> address, where the launch had to start a
        host's fork server again: the caller records them in the run's handle).
        Raises SegmentAlreadyRunning, starting nothing, while the segment launched before still runs
        (two launches at once: exactly one starts it)."""
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
