"""Sync-Switch: train BSP first, switch to ASP; online policies react to stragglers.

validate → provision_cluster (setup) → plan → segment slots 0..N-1 → evaluate → report,
and teardown_cluster (teardown of provision_cluster) always runs last. Slot ``i`` holds
``segment_<i>_bsp``, ``segment_<i>_asp`` (the one matching plan entry ``i`` runs, the other skips) and
``watch_stragglers_<i>`` beside them. Slots past the end of the plan skip. See docs/architecture.md.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG, TriggerRule, cross_downstream
from syncswitch_airflow.dag_params import MAX_SEGMENT_SLOTS, build_params, default_bucket_dir
from syncswitch_airflow.operators import (
    EvaluateRunOperator,
    PlanRunOperator,
    ProvisionClusterOperator,
    ReportRunOperator,
    SegmentOperator,
    TeardownClusterOperator,
    ValidateJobOperator,
)
from syncswitch_airflow.sensors.straggler import StragglerSensor

PROJECT_DIR = Path(__file__).resolve().parent.parent

with DAG(
    dag_id="sync_switch",
    description="Sync-Switch training: BSP then ASP segments with checkpoint handoff",
    doc_md=__doc__,
    schedule=None,  # triggered (UI, REST, `syncswitch run`); recurring jobs set a schedule here
    catchup=False,
    max_active_runs=1,  # one cluster at a time: a run uses every core of a small machine
    params=build_params(default_bucket_dir(PROJECT_DIR)),
    tags=["syncswitch", "training"],
    default_args={"owner": "syncswitch"},
) as dag:
    validate = ValidateJobOperator(task_id="validate")
    provision = ProvisionClusterOperator(task_id="provision_cluster").as_setup()
    plan = PlanRunOperator(task_id="plan", cluster=provision.output)
    # A template rather than plan.output: an XComArg would wire plan directly to every task below.
    run_dir = "{{ ti.xcom_pull(task_ids='plan') }}"
    validate >> provision >> plan

    previous_slot = [plan]
    for slot in range(MAX_SEGMENT_SLOTS):
        after_previous = {"trigger_rule": TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS}
        slot_tasks = [
            SegmentOperator(
                task_id=f"segment_{slot}_{protocol}",
                slot=slot,
                protocol=protocol,
                run_dir=run_dir,
                priority_weight=10,
                **after_previous,
            )
            for protocol in ("bsp", "asp")
        ]
        slot_tasks.append(
            StragglerSensor(
                task_id=f"watch_stragglers_{slot}",
                run_dir=run_dir,
                slot=slot,
                segment_tasks={t.protocol: t.task_id for t in slot_tasks},
                priority_weight=1,  # the segment task is picked first when slots are scarce
                **after_previous,
            )
        )
        cross_downstream(previous_slot, slot_tasks)
        previous_slot = slot_tasks

    # Skipped (unused) slots at the end must not skip evaluation; a failed segment still stops it.
    evaluate = EvaluateRunOperator(task_id="evaluate", run_dir=run_dir, trigger_rule=TriggerRule.NONE_FAILED)
    report = ReportRunOperator(task_id="report", run_dir=run_dir)
    teardown = TeardownClusterOperator(task_id="teardown_cluster")
    cross_downstream(previous_slot, [evaluate])
    evaluate >> report >> teardown
    teardown.as_teardown(setups=provision)
