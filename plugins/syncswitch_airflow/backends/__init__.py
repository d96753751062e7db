"""Cluster backends: where a run's training processes live (``local`` now; others plug in here)."""

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
