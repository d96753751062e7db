"""Operators of the Sync-Switch DAGs (syncswitch_airflow.dag_factory)."""

from syncswitch_airflow.operators.cluster import ProvisionClusterOperator, TeardownClusterOperator
from syncswitch_airflow.operators.finalize import FinalizeRunOperator
from syncswitch_airflow.operators.job import (
    EvaluateRunOperator,
    PlanRunOperator,
    ReportRunOperator,
    ValidateJobOperator,
)
from syncswitch_airflow.operators.segment import SegmentOperator
from syncswitch_airflow.operators.timing import TimingPolicyOperator

__all__ = [
    "EvaluateRunOperator",
    "FinalizeRunOperator",
    "PlanRunOperator",
    "ProvisionClusterOperator",
    "ReportRunOperator",
    "SegmentOperator",
    "TeardownClusterOperator",
    "TimingPolicyOperator",
    "ValidateJobOperator",
]
