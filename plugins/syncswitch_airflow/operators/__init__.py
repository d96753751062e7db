"""Operators of the ``sync_switch`` DAG."""

from syncswitch_airflow.operators.cluster import ProvisionClusterOperator, TeardownClusterOperator
from syncswitch_airflow.operators.job import (
    EvaluateRunOperator,
    PlanRunOperator,
    ReportRunOperator,
    ValidateJobOperator,
)
from syncswitch_airflow.operators.segment import SegmentOperator

__all__ = [
    "EvaluateRunOperator",
    "PlanRunOperator",
    "ProvisionClusterOperator",
    "ReportRunOperator",
    "SegmentOperator",
    "TeardownClusterOperator",
    "ValidateJobOperator",
]
