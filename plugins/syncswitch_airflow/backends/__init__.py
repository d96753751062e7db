"""Cluster backends: where a run's training processes live (local, hosts over SSH, gce VMs).

Backends are named in the one registry of the runtime (``syncswitch.registry``, kind ``backend``):
the built-ins by reference, and any installed package's through the ``syncswitch.backends``
entry-point group. A job's ``cluster_backend`` is validated against those names; :func:`get_backend`
imports the one a task needs. ``base`` is the protocol every backend implements and imports none.
"""

from syncswitch.registry import REGISTRY, UnknownNameError

from syncswitch_airflow.backends.base import (
    ClusterBackend,
    ClusterBusy,
    ClusterCapacity,
    ClusterError,
    SegmentAlreadyRunning,
    SegmentStatus,
)


def get_backend(name: str) -> ClusterBackend:
    """A new instance of the backend registered under ``name`` (the ``cluster_backend`` param)."""
    try:
        backend_class = REGISTRY.entry("backend", name).load()
    except UnknownNameError as err:
        raise ClusterError(str(err)) from None
    return backend_class()


__all__ = [
    "ClusterBackend",
    "ClusterBusy",
    "ClusterCapacity",
    "ClusterError",
    "SegmentAlreadyRunning",
    "SegmentStatus",
    "get_backend",
]
