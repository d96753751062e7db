"""The timing policy task: which BSP fraction this run trains (syncswitch_airflow.timing).

``fixed`` jobs train the ``bsp_fraction`` they were given. ``search`` jobs ask the job's history (one
immutable record per finished run, syncswitch_airflow.history) and the claims of runs still in flight:
BSP baseline runs first, then a halving search, then the smallest accepted fraction. The decision is
claimed before anything is provisioned, so overlapping runs (a backfill) see each other and take the
next item that still needs evidence; a retried task reuses its own claim instead of deciding again.
The decision goes to XCom, the plan task writes it into state.json, and the finalize task records it
with the run's outcome in the history.
"""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk import BaseOperator, Context
from syncswitch import usercode
from syncswitch.spec import JobSpec

from syncswitch_airflow import history, timing
from syncswitch_airflow.hooks.bucket import with_bucket_credentials
from syncswitch_airflow.operators.common import absolute_bucket_dir, job_from_params, run_key


def timing_config(job: JobSpec) -> timing.TimingConfig:
    return timing.TimingConfig(
        repeats=job.timing_repeats,
        tolerance=job.timing_tolerance,
        floor=job.timing_floor,
        refine=job.timing_refine,
    )


class TimingPolicyOperator(BaseOperator):
    """Decide this run's BSP fraction; returns {bsp_fraction, phase, reason, numbers}."""

    ui_color = "#e8f4fd"

    @with_bucket_credentials
    def execute(self, context: Context) -> dict[str, Any]:
        job = job_from_params(context)
        run_id = run_key(context)
        if job.timing_policy == "fixed":
            decision = {
                "bsp_fraction": job.planned_bsp_fraction(),
                "phase": "fixed",
                "reason": f"timing_policy fixed: switch_order {job.switch_order}, as given",
                "numbers": {},
                "protocol": job.protocols()[-1].token,
            }
        else:
            decision = self._search(job, run_id)
        self.log.info(
            "run %s: timing policy %s: BSP fraction %s, then %s (%s): %s",
            run_id,
            job.timing_policy,
            decision["bsp_fraction"],
            decision["protocol"],
            decision["phase"],
            decision["reason"],
        )
        return decision

    def _search(self, job: JobSpec, run_id: str) -> dict[str, Any]:
        bucket = absolute_bucket_dir(job.bucket_dir)
        user_code = usercode.identity(usercode.describe_names(job))
        fingerprint = history.job_fingerprint(job.to_params(), user_code)
        # Records only grow as runs finish: one read a moment old is as good as a fresh one. Claims
        # are read inside the atomic claim, so that overlapping runs see each other.
        records = history.read_records(bucket, job.job_name)
        config = timing_config(job)

        def decide(claims: list[dict[str, Any]]) -> dict[str, Any]:
            now = time.time()
            protocols = job.second_protocols()
            decision = timing.decide_among(records, claims, fingerprint, config, now, protocols).to_dict()
            return {
                "run_id": run_id,
                "fingerprint": fingerprint,
                "bsp_fraction": decision["bsp_fraction"],
                "phase": decision["phase"],
                "claimed_at": now,
                "protocol": decision["protocol"],
                "decision": decision,
            }

        claim, new = history.claim_decision(bucket, job.job_name, run_id, decide)
        if not new:  # a retry of this task: keep the decision this run already claimed
            self.log.info("run %s: reusing this run's claim (%s)", run_id, claim["phase"])
        return claim["decision"]
