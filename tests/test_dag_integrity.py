"""The sync_switch DAG file: it imports cleanly, has the documented shape, and its params schema works.

Fast: parses the DAG (no database, no training).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk import TriggerRule
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import ParamValidationError
from syncswitch.spec import JobSpec
from syncswitch_airflow.dag_params import MAX_SEGMENT_SLOTS

REPO = Path(__file__).resolve().parents[1]

SLOT_TASKS = ("segment_{}_bsp", "segment_{}_asp", "watch_stragglers_{}")


@pytest.fixture(scope="module")
def dag():  # noqa: ANN201 - airflow DAG
    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    assert list(bag.dag_ids) == ["sync_switch"]
    return bag.dags["sync_switch"]


def slot_ids(slot: int) -> set[str]:
    return {name.format(slot) for name in SLOT_TASKS}


def test_dag_settings(dag) -> None:  # noqa: ANN001
    assert dag.schedule is None
    assert dag.catchup is False
    assert dag.max_active_runs == 1
    assert "syncswitch" in dag.tags


def test_task_ids(dag) -> None:  # noqa: ANN001
    expected = {"validate", "provision_cluster", "plan", "evaluate", "report", "teardown_cluster"}
    for slot in range(MAX_SEGMENT_SLOTS):
        expected |= slot_ids(slot)
    assert set(dag.task_ids) == expected


def test_pipeline_order(dag) -> None:  # noqa: ANN001
    assert dag.get_task("validate").downstream_task_ids == {"provision_cluster"}
    assert dag.get_task("provision_cluster").downstream_task_ids == {"plan", "teardown_cluster"}
    assert dag.get_task("plan").downstream_task_ids == slot_ids(0)
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
    assert dag.get_task("teardown_cluster").upstream_task_ids == {"report", "provision_cluster"}


def test_setup_and_teardown(dag) -> None:  # noqa: ANN001
    provision, teardown = dag.get_task("provision_cluster"), dag.get_task("teardown_cluster")
    assert provision.is_setup and not provision.is_teardown
    assert teardown.is_teardown and not teardown.is_setup
    # Runs after success, failure and manual fail, as long as the cluster was provisioned.
    assert teardown.trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS
    # Every work task lies between the setup and the teardown.
    in_scope = provision.get_flat_relative_ids(upstream=False)
    assert set(dag.task_ids) - {"validate", "provision_cluster"} <= in_scope


def test_segment_tasks(dag) -> None:  # noqa: ANN001
    for slot in range(MAX_SEGMENT_SLOTS):
        bsp, asp = dag.get_task(f"segment_{slot}_bsp"), dag.get_task(f"segment_{slot}_asp")
        sensor = dag.get_task(f"watch_stragglers_{slot}")
        assert (bsp.slot, bsp.protocol, asp.slot, asp.protocol) == (slot, "bsp", slot, "asp")
        assert bsp.retries == 1 and asp.retries == 1
        assert sensor.priority_weight < bsp.priority_weight
        assert "xcom_pull(task_ids='plan')" in bsp.run_dir


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
    assert schema["switch_order"]["pattern"] == "^[01]+$"
    assert schema["model"]["enum"] == ["resnet", "cnn"]
    assert "cnn_digits" in schema["hparam_set"]["enum"]
    assert schema["train_steps"]["type"] == "array"
    assert schema["num_workers"]["type"] == "integer" and schema["num_workers"]["minimum"] == 1
    assert set(schema["online_policy"]["enum"]) == {"none", "greedy", "elastic"}
    # The Trigger form shows the title as the label and the description as help text.
    assert all(dag.params.get_param(name).description for name in dag.params)
    assert all(s.get("title") for s in schema.values())


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("switch_order", "12"),
        ("switch_order", ""),
        ("model", "vgg"),
        ("num_workers", 0),
        ("num_workers", "two"),
        ("train_steps", [10, -1]),
        ("hparam_set", "resnet_cifar_99"),
        ("momentum_rule", "nesterov"),
        ("job_name", "Bad_Name"),
        ("stragglers", ["worker=1"]),
        ("bsp_fraction", 1.5),
    ],
)
def test_params_reject_bad_values(dag, name: str, value: object) -> None:  # noqa: ANN001
    params: ParamsDict = copy.deepcopy(dag.params)
    # Assigning a value validates it against the param's schema, as a trigger's conf is.
    with pytest.raises(ParamValidationError, match=f"param {name}:"):
        params[name] = value


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
