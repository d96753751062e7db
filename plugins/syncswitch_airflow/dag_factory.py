"""The one builder of Sync-Switch DAGs: the ad-hoc ``sync_switch`` DAG and every recurring job's DAG.

    validate -> timing_policy -> plan --------+
    validate -> provision_cluster (setup) ----+-> segment_0 -> ... -> segment_<N-1> --+
       segment_<N-1> -> evaluate -> report -------------------------------------------+-> finalize
       segment_<N-1> -> teardown_cluster (teardown of provision_cluster) -------------+

Each ``segment_<i>`` task group holds one task per protocol (``bsp``, ``asp``, ``ssp``, ``local``,
``cbsp``: syncswitch.protocols; the one matching plan entry ``i`` runs, the others skip, so the grid
shows which protocol each slot ran) and ``watch_stragglers`` beside them; when the plan's last segment
ends, its watcher skips every later group at once, so that no task of an unused group starts.

The cluster starts as soon as the params are valid, beside the timing policy and the plan, because its
nodes' start (importing TensorFlow) is the longest wait before the first step. It is torn down as soon
as the last segment has ended, beside evaluation and the report, which need only the bucket: a cloud
cluster is not billed while the report renders. finalize runs after both whatever happened: it
records the run's outcome in state.json, the report and the job's history, then fails if another task
failed or the run was stopped before its report: it is the one leaf that decides the DAG run's state.
It is a teardown task itself (of no setup, ``on_failure_fail_dagrun``): marking a run failed by hand
skips every pending task except the teardowns and leaves the run's state to its leaves, so a finalize
that was skipped would have let a stopped run end "success".
"""

from __future__ import annotations

import datetime
from typing import Any

from airflow.sdk import DAG, Param, TaskGroup, TriggerRule, cross_downstream
from syncswitch.plan import MAX_SEGMENTS, PROTOCOLS

from syncswitch_airflow.assets import MODELS, REPORTS
from syncswitch_airflow.operators import (
    EvaluateRunOperator,
    FinalizeRunOperator,
    PlanRunOperator,
    ProvisionClusterOperator,
    ReportRunOperator,
    SegmentOperator,
    TeardownClusterOperator,
    TimingPolicyOperator,
    ValidateJobOperator,
)
from syncswitch_airflow.sensors.straggler import StragglerSensor
from syncswitch_airflow.ui import PLAN_TASK_ID

# A template rather than plan.output: an XComArg would wire plan directly to every task below. The
# plugin's pages find a DAG run's folder in the same XCom (syncswitch_airflow.ui).
RUN_DIR = f"{{{{ ti.xcom_pull(task_ids='{PLAN_TASK_ID}') }}}}"


def build_sync_switch_dag(
    dag_id: str,
    params: dict[str, Param],
    *,
    schedule: Any = None,
    start_date: datetime.datetime | None = None,
    end_date: datetime.datetime | None = None,
    catchup: bool = False,
    max_active_runs: int = 1,
    tags: list[str] | None = None,
    description: str = "Sync-Switch training: BSP then ASP segments with checkpoint handoff",
    doc_md: str | None = None,
) -> DAG:
    with DAG(
        dag_id=dag_id,
        description=description,
        doc_md=doc_md or __doc__,
        schedule=schedule,
        start_date=start_date,
        end_date=end_date,
        catchup=catchup,
        max_active_runs=max_active_runs,
        params=params,
        tags=sorted({"syncswitch", *(tags or [])}),
        # Every task is idempotent, and on a distributed Airflow a lost worker fails whatever it ran
        # (a watcher, a skipped branch, the report): one retry, on any worker. Bad params and bad user
        # code fail at once (AirflowFailException), without a retry.
        default_args={"owner": "syncswitch", "retries": 1, "retry_delay": datetime.timedelta(seconds=10)},
    ) as dag:
        validate = ValidateJobOperator(task_id="validate")
        timing = TimingPolicyOperator(task_id="timing_policy")
        provision = ProvisionClusterOperator(task_id="provision_cluster").as_setup()
        plan = PlanRunOperator(task_id=PLAN_TASK_ID, timing=timing.output)
        validate >> timing >> plan
        validate >> provision
        last_slot = _segment_slots([plan, provision])
        # Skipped (unused) slots at the end must not skip evaluation; a failed segment still stops it.
        evaluate = EvaluateRunOperator(
            task_id="evaluate", run_dir=RUN_DIR, trigger_rule=TriggerRule.NONE_FAILED
        )
        # One report at a time across the DAG's runs: a job's first asset events create its assets,
        # and Airflow 3.3 creates one without a guard, so two runs of a new job reporting at once on
        # PostgreSQL would hit its unique index and the api-server would mark the second report
        # failed though its code succeeded. A report waits for the other's instead.
        report = ReportRunOperator(
            task_id="report", run_dir=RUN_DIR, outlets=[MODELS, REPORTS], max_active_tis_per_dag=1
        )
        teardown = TeardownClusterOperator(task_id="teardown_cluster")
        finalize = FinalizeRunOperator(task_id="finalize")
        cross_downstream(last_slot, [evaluate, teardown])
        evaluate >> report >> finalize
        teardown >> finalize
        teardown.as_teardown(setups=provision)
        # A teardown of no setup, so that it runs whatever happened (its upstream all done), even
        # after the run is marked failed by hand, which skips every pending task but the teardowns;
        # and one that fails the run when it fails, as it decides the run's state.
        finalize.as_teardown(on_failure_fail_dagrun=True)
    return dag


def _segment_slots(first_upstream: list[Any]) -> list[Any]:
    """MAX_SEGMENTS task groups after ``first_upstream``, each after the one before; the last group's
    tasks."""
    previous: list[Any] = first_upstream
    for slot in range(MAX_SEGMENTS):
        # A later slot runs after a skipped one; the first follows the setup, which Airflow wants
        # followed by ALL_SUCCESS (the plan and the cluster, neither of which skips).
        rule = TriggerRule.ALL_SUCCESS if slot == 0 else TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS
        after_previous = {"trigger_rule": rule}
        with TaskGroup(
            group_id=f"segment_{slot}",
            tooltip=f"plan entry {slot}: the task of its protocol, and its watcher",
        ):
            segments = [
                SegmentOperator(
                    task_id=protocol,
                    slot=slot,
                    protocol=protocol,
                    run_dir=RUN_DIR,
                    priority_weight=10,
                    **after_previous,
                )
                for protocol in PROTOCOLS
            ]
            watcher = StragglerSensor(
                task_id="watch_stragglers",
                run_dir=RUN_DIR,
                slot=slot,
                segment_tasks={t.protocol: t.task_id for t in segments},
                priority_weight=1,  # the segment task is picked first when slots are scarce
                **after_previous,
            )
        current = [*segments, watcher]
        cross_downstream(previous, current)
        previous = current
    return previous
