"""The job-level tasks of ``sync_switch``: validate, plan, evaluate, report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from syncswitch import checkpoints, usercode
from syncswitch import plan as plans
from syncswitch.errors import SpecError
from syncswitch.hparams import HParams, get_hparams
from syncswitch.layout import RunLayout
from syncswitch.protocols import parse_token
from syncswitch.spec import JobSpec
from syncswitch.state import create_run, record_final

from syncswitch_airflow.assets import emit_run_outputs
from syncswitch_airflow.backends.base import capacity_refusal
from syncswitch_airflow.hooks.bucket import with_bucket_credentials
from syncswitch_airflow.links import RUN_LINKS
from syncswitch_airflow.operators.common import (
    RUN_KEY_XCOM,
    absolute_bucket_dir,
    job_from_params,
    new_run_key,
    require_state,
    run_key,
    run_layout,
)

# An ASP segment may end between whole steps (each update is 1/num_workers of a step).
_STEP_TOLERANCE = 1e-6
# The user-code check imports TensorFlow and the user's modules, builds the model and runs a batch.
USER_CODE_CHECK_SECONDS = 600


class ValidateJobOperator(BaseOperator):
    """Check the DAG run's params as one JobSpec, before anything is provisioned."""

    ui_color = "#e8f4fd"

    @with_bucket_credentials
    def execute(self, context: Context) -> dict[str, Any]:
        job = job_from_params(context)
        executors = conf.get("core", "executor", fallback="")
        if job.cluster_backend == "local":
            from syncswitch_airflow.backends.local import deployment_refusal

            refusal = deployment_refusal(executors)
            if refusal:
                raise AirflowFailException(f"invalid job params: {refusal}")
        refusal = capacity_refusal(executors)
        if refusal:
            raise AirflowFailException(f"cannot run cluster_backend {job.cluster_backend!r} here: {refusal}")
        if job.cluster_backend == "hosts":
            from syncswitch_airflow.hooks.ssh import resolve_hosts

            try:  # the hosts named by an SSH connection: it exists and gives an address
                resolve_hosts(job.hosts)
            except SpecError as err:
                raise AirflowFailException(f"invalid job params: {err}") from None
        from syncswitch_airflow.backends.user_requirements import check_for_validate

        try:  # the user code's requirements.txt: resolvable, or met where nothing installs it
            listed = check_for_validate(job)
        except SpecError as err:
            raise AirflowFailException(f"invalid job params: {err}") from None
        if listed:
            self.log.info("run %s: user code's requirements: %s", context["run_id"], listed)
        from syncswitch.check import needs_check

        if needs_check(job):
            checked = check_user_code(job)
            self.log.info("run %s: user code checked on one batch: %s", context["run_id"], checked)
        steps = job.segment_steps()
        self.log.info(
            "run %s: job %s valid: switch_order %s, steps %s (workload %d), %d worker(s) + %d PS, "
            "%s/%s on %s",
            context["run_id"],
            job.job_name,
            job.switch_order,
            steps,
            sum(steps),
            job.num_workers,
            job.num_ps,
            job.model,
            job.hparam_set,
            job.problem,
        )
        key = new_run_key(context)
        context["ti"].xcom_push(key=RUN_KEY_XCOM, value=key)
        if key != context["run_id"]:
            self.log.info("run %s: the whole run was cleared; this attempt is %s", context["run_id"], key)
        return {"switch_order": job.switch_order, "segment_steps": steps, "workload": sum(steps)}


def check_user_code(job: JobSpec) -> dict[str, Any]:
    """Run ``syncswitch check`` (syncswitch.check) on the job in a subprocess, so that TensorFlow and
    the user's modules stay out of the Airflow worker; bad user code fails the task (no retry) with
    the check's one line naming the registered name, the user's file and line."""
    with tempfile.TemporaryDirectory(prefix="syncswitch-check-") as folder:
        job_file = os.path.join(folder, "job.json")
        with open(job_file, "w", encoding="utf-8") as f:
            json.dump(job.to_params(), f)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "syncswitch.cli", "check", "--job", job_file],
                capture_output=True,
                text=True,
                timeout=USER_CODE_CHECK_SECONDS,
                cwd=folder,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
            )
        except subprocess.TimeoutExpired:
            raise AirflowFailException(
                f"invalid job params: usr_dir: the user-code check took over {USER_CODE_CHECK_SECONDS} s "
                "(one batch on CPU); is a dataset blocking?"
            ) from None
    if done.returncode != 0:
        prefix = "syncswitch check: "
        lines = [line for line in done.stderr.splitlines() if line.startswith(prefix)]
        reason = lines[-1][len(prefix) :] if lines else "\n".join(done.stderr.splitlines()[-20:])
        raise AirflowFailException(f"invalid job params: {reason}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class PlanRunOperator(BaseOperator):
    """Create the run folder's ``state.json`` with the offline plan; returns the run folder.

    Idempotent: on an Airflow retry, an existing state of the same run is kept (its plan may already
    have been changed online and segments may have completed). The cluster handle is already there:
    the provisioning task wrote it.
    """

    template_fields = ("timing",)
    ui_color = "#e8f4fd"

    def __init__(self, *, timing: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timing = timing

    @with_bucket_credentials
    def execute(self, context: Context) -> str:
        job = job_from_params(context)
        if job.timing_policy != "fixed":
            second = self.timing.get("protocol")  # what the search chose after BSP
            job = job.with_bsp_fraction(
                self.timing["bsp_fraction"], parse_token(second, "timing decision") if second else None
            )
        run_id = run_key(context)
        layout = run_layout(job, run_id)
        params = {**job.to_params(), "bucket_dir": absolute_bucket_dir(job.bucket_dir)}
        user_code = ship_user_code(job, layout)
        state, created = create_run(
            layout, run_id, params, job.plan_entries(), self.timing, user_code=user_code
        )
        self.log.info(
            "run %s: %s plan in %s: %s",
            run_id,
            "wrote" if created else "kept existing",
            layout.state,
            ", ".join(f"{e['index']}:{e['protocol']}->{e['until_step']}" for e in state["plan"]),
        )
        return layout.root


def ship_user_code(job: JobSpec, layout: RunLayout) -> dict[str, Any]:
    """The job's user code as state.json keeps it ({usr_dir, digest, packages}, and ``uri``: the
    copy in the run's bucket folder that nodes on other hosts import, so nothing is installed on
    them by hand). A local cluster imports usr_dir where it is."""
    user_code = usercode.describe_names(job)
    shippable = job.usr_dir and usercode.kind_of(job.usr_dir) != "module"
    if shippable and job.cluster_backend != "local":
        user_code["uri"] = layout.cluster_user_code(user_code["digest"])
        usercode.upload(job.usr_dir, user_code["uri"])
    return user_code


class RunFolderOperator(BaseOperator):
    """An operator that works on the run folder planned for this DAG run (templated ``run_dir``)."""

    template_fields = ("run_dir",)
    operator_extra_links = RUN_LINKS
    ui_color = "#eafaea"

    def __init__(self, *, run_dir: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_dir = run_dir


class EvaluateRunOperator(RunFolderOperator):
    """Test accuracy of the run's final checkpoint, checked against the exact workload."""

    @with_bucket_credentials
    def execute(self, context: Context) -> dict[str, Any]:
        state = require_state(self.run_dir)
        job = JobSpec.from_params(state["job"])
        for key in sorted(state.get("segments", {}), key=int):
            seg = state["segments"][key]
            self.log.info(
                "run %s: segment %s (%s) ended at step %s with test accuracy %s",
                state["run_id"],
                key,
                seg.get("protocol"),
                seg.get("end_step"),
                seg.get("test_accuracy", "n/a"),
            )
        final = self._evaluate_final_checkpoint(state, job)
        workload = plans.workload(state["plan"])
        final = {**final, "workload": workload, "evaluated_at": time.time()}
        record_final(RunLayout(self.run_dir), final)
        self.log.info(
            "run %s: final checkpoint at step %s of %s: test accuracy %.4f, loss %.4f (%s)",
            state["run_id"],
            final["global_step"],
            workload,
            final["test_accuracy"],
            final["test_loss"],
            final["checkpoint"],
        )
        if "export" in final:
            self.log.info(
                "run %s: trained model exported: %s (SavedModel), %s (Keras)",
                state["run_id"],
                final["export"]["saved_model"],
                final["export"]["keras"],
            )
        elif "export_error" in final:
            self.log.warning("run %s: the export failed: %s", state["run_id"], final["export_error"])
        if abs(float(final["global_step"]) - float(workload)) > _STEP_TOLERANCE:
            raise AirflowException(
                f"the final checkpoint is at step {final['global_step']}, not at the workload {workload}"
            )
        return {k: final[k] for k in ("test_accuracy", "test_loss", "global_step")}

    def _evaluate_final_checkpoint(self, state: dict[str, Any], job: JobSpec) -> dict[str, Any]:
        """The last segment's chief evaluates its final checkpoint with the same code
        (syncswitch.evaluate) on the warm cluster; reuse that result when it is for the newest
        checkpoint. Otherwise evaluate here, which imports TensorFlow into this worker (a slow import)."""
        latest = checkpoints.latest(RunLayout(self.run_dir))
        segments = state.get("segments", {}) if latest is not None else {}
        for key in sorted(segments, key=int, reverse=True):
            seg = segments[key]
            exported = "export" in seg or "export_error" in seg
            if seg.get("checkpoint") == latest["uri"] and "test_accuracy" in seg and exported:
                self.log.info(
                    "run %s: segment %s already evaluated the final checkpoint %s at its end",
                    state["run_id"],
                    key,
                    latest["uri"],
                )
                return {
                    **{k: v for k, v in seg.items() if k.startswith(("test_", "export"))},
                    "global_step": float(latest["global_step"]),
                    "checkpoint": latest["uri"],
                    "evaluated_by": f"segment {key}",
                }
        from syncswitch.evaluate import evaluate_latest

        usercode.load(job.usr_dir)
        hp = job_hparams(job, len(job.protocols()) - 1)
        final = evaluate_latest(self.run_dir, hp, job.problem, job.data_dir, export=True)
        return {**final, "evaluated_by": "evaluate task"}


def job_hparams(job: JobSpec, plan_index: int) -> HParams:
    """The resolved HParams of original segment ``plan_index`` (its k=v overrides applied)."""
    return get_hparams(job.hparam_set, job.model).override(job.per_segment(job.hparams, plan_index))


class ReportRunOperator(RunFolderOperator):
    """Plots, summary.json and index.html in the run's report folder; its log ends with the summary.
    The report, and the model where the run exported one, become the job's asset events (assets.py)
    for the aliases among the task's outlets."""

    @with_bucket_credentials
    def execute(self, context: Context) -> dict[str, Any]:
        from syncswitch_airflow.report import build_report, format_summary_lines

        summary = build_report(self.run_dir)
        for line in format_summary_lines(summary):
            self.log.info("run %s: %s", context["run_id"], line)
        if self.outlets:
            added = emit_run_outputs(
                context["outlet_events"], require_state(self.run_dir), summary.get("index_html")
            )
            self.log.info("run %s: asset events for %s", context["run_id"], ", ".join(added) or "nothing")
        return {
            "report": summary.get("index_html"),
            "final_accuracy": summary.get("final_accuracy"),
            "total_seconds": summary.get("total_seconds"),
        }
