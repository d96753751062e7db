"""Cluster backends: where a run's training processes live (local, hosts over SSH, gce VMs)."""

from syncswitch_airflow.backends.base import (
    ClusterBackend,
    ClusterBusy,
    ClusterCapacity,
    ClusterError,
    SegmentStatus,
    get_backend,
)

__all__ = [
    "ClusterBackend",
    "ClusterBusy",
    "ClusterCapacity",
    "ClusterError",
    "SegmentStatus",
    "get_backend",
]
