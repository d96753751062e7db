"""The DAG files: sync_switch and the recurring jobs' DAGs import cleanly, have the documented shape, and
their params schema works; bad job files name the file and the field and break no other DAG.

Fast: parses the DAG (no database, no training).
"""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk import TriggerRule
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import ParamValidationError
from syncswitch.fields import MAX_SEGMENT_RETRIES
from syncswitch.plan import MAX_SEGMENTS as MAX_SEGMENT_SLOTS
from syncswitch.protocols import PROTOCOLS
from syncswitch.spec import JobSpec, SpecError

REPO = Path(__file__).resolve().parents[1]
REAPER = "sync_switch_reaper"
CONSUMER = "on_new_model"  # the example downstream DAG

SLOT_TASKS = tuple(f"segment_{{}}.{task}" for task in (*PROTOCOLS, "watch_stragglers"))


@pytest.fixture(scope="module")
def bag() -> DagBag:
    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag


@pytest.fixture(scope="module")
def dag(bag: DagBag):  # noqa: ANN201 - airflow DAG
    assert {"sync_switch", "job_digits_nightly", REAPER, CONSUMER} <= set(bag.dag_ids)
    return bag.dags["sync_switch"]


def slot_ids(slot: int) -> set[str]:
    return {name.format(slot) for name in SLOT_TASKS}


def test_dag_settings(dag) -> None:  # noqa: ANN001
    assert dag.schedule is None
    assert dag.catchup is False
    # Concurrency is the clusters' capacity's to bound (provision_cluster waits, deferred), not the DAG's.
    assert dag.max_active_runs == 16
    assert "syncswitch" in dag.tags


def test_task_ids(dag) -> None:  # noqa: ANN001
    expected = {
        "validate",
        "timing_policy",
        "provision_cluster",
        "plan",
        "evaluate",
        "report",
        "teardown_cluster",
        "finalize",
    }
    for slot in range(MAX_SEGMENT_SLOTS):
        expected |= slot_ids(slot)
    assert set(dag.task_ids) == expected


def test_pipeline_order(dag) -> None:  # noqa: ANN001
    # The cluster starts beside the timing policy and the plan: its nodes take the longest to start.
    assert dag.get_task("validate").downstream_task_ids == {"timing_policy", "provision_cluster"}
    assert dag.get_task("timing_policy").downstream_task_ids == {"plan"}
    assert dag.get_task("provision_cluster").downstream_task_ids == slot_ids(0) | {"teardown_cluster"}
    assert dag.get_task("plan").downstream_task_ids == slot_ids(0)
    for task_id in slot_ids(0):
        task = dag.get_task(task_id)
        assert task.upstream_task_ids == {"plan", "provision_cluster"}, task_id
        assert task.trigger_rule == TriggerRule.ALL_SUCCESS  # Airflow's rule after a setup task
    for slot in range(1, MAX_SEGMENT_SLOTS):
        for task_id in slot_ids(slot):
            task = dag.get_task(task_id)
            assert task.upstream_task_ids == slot_ids(slot - 1), task_id
            assert task.trigger_rule == TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS
    evaluate = dag.get_task("evaluate")
    assert evaluate.upstream_task_ids == slot_ids(MAX_SEGMENT_SLOTS - 1)
    # Unused slots at the end skip; evaluation must still run.
    assert evaluate.trigger_rule == TriggerRule.NONE_FAILED
    assert dag.get_task("report").upstream_task_ids == {"evaluate"}
    # The cluster goes as soon as the last segment has ended, beside evaluation and the report.
    last_slot = slot_ids(MAX_SEGMENT_SLOTS - 1)
    assert dag.get_task("teardown_cluster").upstream_task_ids == last_slot | {"provision_cluster"}
    # The outcome is recorded after the report and the teardown, whatever happened before.
    finalize = dag.get_task("finalize")
    assert finalize.upstream_task_ids == {"report", "teardown_cluster"} and not finalize.downstream_task_ids
    # A teardown of no setup: all done is enough (no upstream setup to wait on), it still runs after
    # the run is marked failed by hand (which skips every pending task but teardowns), and it decides
    # the run's state.
    assert finalize.trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS
    assert finalize.is_teardown and finalize.on_failure_fail_dagrun
    assert not any(dag.get_task(task_id).is_setup for task_id in finalize.upstream_task_ids)


def test_setup_and_teardown(dag) -> None:  # noqa: ANN001
    provision, teardown = dag.get_task("provision_cluster"), dag.get_task("teardown_cluster")
    assert provision.is_setup and not provision.is_teardown
    assert teardown.is_teardown and not teardown.is_setup
    # Runs after success, failure and manual fail, as long as the cluster was provisioned.
    assert teardown.trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS
    # Every work task lies between the setup and the teardown.
    in_scope = provision.get_flat_relative_ids(upstream=False)
    assert set(dag.task_ids) - {"validate", "timing_policy", "plan", "provision_cluster"} <= in_scope


def test_segment_tasks(dag) -> None:  # noqa: ANN001
    for slot in range(MAX_SEGMENT_SLOTS):
        tasks = {p: dag.get_task(f"segment_{slot}.{p}") for p in PROTOCOLS}
        sensor = dag.get_task(f"segment_{slot}.watch_stragglers")
        assert sensor.segment_tasks == {p: task.task_id for p, task in tasks.items()}
        for protocol, task in tasks.items():
            assert (task.slot, task.protocol) == (slot, protocol)
            # The ceiling of the job's segment_retries (the other tasks keep the DAG's one retry).
            assert task.retries == MAX_SEGMENT_RETRIES
            assert sensor.priority_weight < task.priority_weight
            assert "xcom_pull(task_ids='plan')" in task.run_dir
        assert sensor.retries == 1


def test_params_cover_the_job_spec(dag) -> None:  # noqa: ANN001
    params = dag.params
    defaults = params.validate()
    assert set(defaults) == set(JobSpec().to_params())
    spec = JobSpec.from_params(defaults)
    # The embedded demo: local cluster of 1 PS + 2 workers, digits, "10" with a 25/75 split.
    assert (spec.cluster_backend, spec.num_ps, spec.num_workers, spec.problem) == ("local", 1, 2, "digits")
    assert spec.switch_order == "10"
    assert spec.segment_steps() == [spec.total_steps // 4, spec.total_steps - spec.total_steps // 4]
    assert defaults["bucket_dir"]


def test_params_render_as_typed_form_fields(dag) -> None:  # noqa: ANN001
    schema = {name: dag.params.get_param(name).schema for name in dag.params}
    # Any text: the validate task names the bad segment and the accepted spellings (below).
    assert "pattern" not in schema["switch_order"] and schema["switch_order"]["minLength"] == 1
    # Registered names are proposed, not enforced: a run's usr_dir may register others, and the
    # validate task checks them against the loaded registry.
    assert {"resnet", "cnn"} <= set(schema["model"]["examples"]) and "enum" not in schema["model"]
    assert "cnn_digits" in schema["hparam_set"]["examples"]
    assert "digits" in schema["problem"]["examples"]
    assert schema["train_steps"]["type"] == "array"
    assert schema["num_workers"]["type"] == "integer" and schema["num_workers"]["minimum"] == 1
    assert set(schema["online_policy"]["enum"]) == {"none", "greedy", "elastic"}
    # The Trigger form shows the title as the label and the description as help text.
    assert all(dag.params.get_param(name).description for name in dag.params)
    assert all(s.get("title") for s in schema.values())


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("switch_order", ""),
        ("model", ""),
        ("num_workers", 0),
        ("num_workers", "two"),
        ("train_steps", [10, -1]),
        ("momentum_rule", "nesterov"),
        ("job_name", "Bad_Name"),
        ("stragglers", ["worker=1"]),
        ("bsp_fraction", 1.5),
        ("timing_policy", "guess"),
        ("timing_floor", 0),
    ],
)
def test_params_reject_bad_values(dag, name: str, value: object) -> None:  # noqa: ANN001
    params: ParamsDict = copy.deepcopy(dag.params)
    # Assigning a value validates it against the param's schema, as a trigger's conf is.
    with pytest.raises(ParamValidationError, match=f"param {name}:"):
        params[name] = value


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        # The registry is the process's: other tests' user code may have added names to the lists.
        ("model", "vgg", r"^model: unknown 'vgg'; accepted: cnn, .*resnet"),
        ("problem", "mnist", r"^problem: unknown 'mnist'; accepted: .*digits, .*image_cifar10"),
        ("hparam_set", "resnet_cifar_99", r"^hparam_set: unknown 'resnet_cifar_99'; accepted: .*cnn_digits"),
        ("usr_dir", "/no/such/folder", r"^usr_dir: '/no/such/folder': no such folder or \.py file"),
        ("switch_order", "12", r"^switch_order: segment 0 \('12'\): unknown protocol; accepted: 1 or bsp"),
        ("switch_order", "1,ssp:x", r"^switch_order: segment 1 \('ssp:x'\): the staleness bound s must be"),
    ],
)
def test_unregistered_names_fail_validation_naming_the_field(
    dag,
    name: str,
    value: str,
    message: str,  # noqa: ANN001
) -> None:
    params: ParamsDict = copy.deepcopy(dag.params)
    params[name] = value  # the form proposes names; it cannot know a run's usr_dir
    with pytest.raises(SpecError, match=message):
        JobSpec.from_params(params.validate())


def test_params_accept_the_original_style_job(dag) -> None:  # noqa: ANN001
    params: ParamsDict = copy.deepcopy(dag.params)
    for name, value in {
        "switch_order": "101",
        "train_steps": [100, 200, 100],
        "ckpt_frequency": [50, 100, 50],
        "hparams": ["batch_size=64", "", "learning_rate=0.05"],
        "stragglers": ["worker=1,start=20,duration=60,slowdown=4"],
        "bucket_dir": "gs://bucket/prefix",
    }.items():
        params[name] = value
    spec = JobSpec.from_params(params.validate())
    assert spec.segment_steps() == [100, 200, 100]


# ---- plan entries -> segment specs (pure helpers of the plan and segment tasks) -------------------


def test_offline_plan_has_cumulative_targets_and_original_positions() -> None:
    job = JobSpec(switch_order="101", train_steps=(10, 20, 30))
    assert job.plan_entries() == [
        {"index": 0, "protocol": "bsp", "until_step": 10, "origin": "plan", "plan_index": 0},
        {"index": 1, "protocol": "asp", "until_step": 30, "origin": "plan", "plan_index": 1},
        {"index": 2, "protocol": "bsp", "until_step": 60, "origin": "plan", "plan_index": 2},
    ]


def test_online_segments_take_the_settings_of_the_segment_they_split() -> None:
    from syncswitch import plan as plans

    job = JobSpec(
        switch_order="101",
        train_steps=(10, 20, 30),
        hparams=("batch_size=16", "batch_size=32", "batch_size=64"),
        ckpt_frequency=(5, 10, 15),
    )
    # A straggler during segment 0: it stops early at 6, an online ASP segment finishes its budget.
    plan = plans.truncate(plans.insert_switch(job.plan_entries(), 0, "asp"), 0, 6)
    specs = [job.segment_spec(entry, "r1", "/runs/demo/r1") for entry in plan]
    assert [(s.index, s.protocol, s.until_step) for s in specs] == [
        (0, "bsp", 6),
        (1, "asp", 10),
        (2, "asp", 30),
        (3, "bsp", 60),
    ]
    assert [s.hparams for s in specs] == ["batch_size=16", "batch_size=16", "batch_size=32", "batch_size=64"]
    assert [s.ckpt_frequency for s in specs] == [5, 5, 10, 15]
    assert {s.total_steps for s in specs} == {60}
    assert {(s.run_id, s.run_dir) for s in specs} == {("r1", "/runs/demo/r1")}


def test_a_result_ends_its_entry_at_the_target_or_when_stopped_on_purpose() -> None:
    from syncswitch_airflow.triggers.segment import is_finished

    entry = {"index": 1, "protocol": "asp", "until_step": 30}
    assert is_finished({"end_step": 30.0, "stopped_early": False}, entry)
    assert is_finished({"end_step": 17.5, "stopped_early": True}, entry)
    assert not is_finished({"end_step": 17.5, "stopped_early": False}, entry)


def test_every_param_of_every_dag_accepts_its_default(bag: DagBag) -> None:
    """What the Trigger form submits unchanged must validate: no required field left empty."""
    for dag_id, dag in bag.dags.items():
        values = copy.deepcopy(dag.params).validate()
        if dag_id == REAPER:
            assert values == {"projects": []}
            continue
        if dag_id == CONSUMER:
            assert values == {}
            continue
        JobSpec.from_params(values)  # and the job it describes is valid
        assert values["data_dir"] is None or values["data_dir"], dag_id


def test_the_reaper_runs_hourly_and_refuses_a_malformed_project(bag: DagBag) -> None:
    dag = bag.dags[REAPER]
    assert dag.task_ids == ["reap"] and dag.max_active_runs == 1 and not dag.catchup
    params = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError, match="projects"):
        params["projects"] = ["My Project"]


# ---- recurring jobs from files -----------------------------------------------------------------


def test_the_example_job_file_is_a_scheduled_dag_with_its_defaults(bag: DagBag) -> None:
    dag = bag.dags["job_digits_nightly"]
    assert dag.schedule == "@daily" and dag.catchup is False and dag.start_date.year == 2026
    assert {"syncswitch", "recurring", "digits"} <= set(dag.tags)
    defaults = JobSpec.from_params(copy.deepcopy(dag.params).validate())
    assert (defaults.job_name, defaults.timing_policy, defaults.timing_repeats) == (
        "digits-nightly",
        "search",
        2,
    )
    assert set(dag.task_ids) == set(bag.dags["sync_switch"].task_ids)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("params:\n  total_steps: lots\n", "bad.yaml: params.total_steps: must be an integer"),
        ("params:\n  timing_policy: search\n  switch_order: '101'\n", "bad.yaml: params.switch_order:"),
        ('schedule: "every tuesday"\nstart_date: 2026-11-01\n', "bad.yaml: schedule:"),
        ('schedule: "@daily"\n', "bad.yaml: start_date: is needed with a schedule"),
        ("schedule: {every: soon}\nstart_date: 2026-11-01\n", "bad.yaml: schedule.every:"),
        (
            'schedule: "@daily"\nstart_date: 2026-11-01\nend_date: 2026-10-01\n',
            "bad.yaml: end_date: must be on",
        ),
        ("owner: me\n", "bad.yaml: owner: unknown key"),
        (
            "params:\n  cluster_backend: gce\n  bucket_dir: gs://b/runs\n"
            "  gce: {project: sync-proj-1, zones: [mars-1a]}\n",
            "bad.yaml: params.gce.zones:",
        ),
        ("params: [1, 2]\n", "bad.yaml: params: must be a mapping"),
    ],
)
def test_a_bad_job_file_is_an_import_error_naming_it_and_breaks_no_other_dag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str, named: str
) -> None:
    (tmp_path / "good.yaml").write_text(
        "schedule: {every: 6h}\nstart_date: 2026-11-01\nparams:\n  total_steps: 200\n"
    )
    (tmp_path / "bad.yaml").write_text(content)
    monkeypatch.setenv("SYNCSWITCH_JOBS_DIR", str(tmp_path))
    bag = DagBag(dag_folder=str(REPO / "dags" / "recurring_jobs.py"))
    [(path, message)] = bag.import_errors.items()
    assert path.endswith("recurring_jobs.py") and named in message, message
    assert set(bag.dag_ids) == {"job_good"}
    assert bag.dags["job_good"].schedule == datetime.timedelta(hours=6)


def test_the_dags_and_the_task_side_never_import_the_local_tools() -> None:
    """The folder tree's split holds: parsing every DAG file and importing every task-side package
    loads none of the user's commands (syncswitch_airflow/tools) and nothing of the embedded Airflow
    (syncswitch_airflow/embedded)."""
    import subprocess
    import sys

    code = (
        "import runpy, sys, pathlib\n"
        "for path in sorted(pathlib.Path(sys.argv[1]).glob('*.py')): runpy.run_path(str(path))\n"
        "import syncswitch_airflow.operators, syncswitch_airflow.sensors, syncswitch_airflow.hooks\n"
        "import syncswitch_airflow.triggers.segment, syncswitch_airflow.triggers.straggler\n"
        "import syncswitch_airflow.triggers.capacity, syncswitch_airflow.backends.gce\n"
        "local = ('syncswitch_airflow.tools', 'syncswitch_airflow.embedded')\n"
        "print(sorted(m for m in sys.modules if m.startswith(local)))\n"
    )
    dags = Path(__file__).resolve().parents[1] / "dags"
    argv = [sys.executable, "-c", code, str(dags)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
