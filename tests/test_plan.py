"""Plan mutation for online switches (docs/architecture.md, "Online switching")."""

from __future__ import annotations

import copy

import pytest
from syncswitch import plan as plans
from syncswitch.plan import PlanError
from syncswitch.protocols import Protocol
from syncswitch.spec import JobSpec


def offline_plan() -> list[dict]:
    """What the plan task writes for switch_order "10", 400 steps, a quarter of them BSP."""
    specs = JobSpec(switch_order="10", total_steps=400, bsp_fraction=0.25).plan("run", "/tmp/run")
    return [
        {"index": s.index, "protocol": s.protocol, "until_step": s.until_step, "origin": "plan"}
        for s in specs
    ]


def segment_lengths(plan: list[dict]) -> list[float]:
    previous, lengths = 0, []
    for item in plan:
        lengths.append(item["until_step"] - previous)
        previous = item["until_step"]
    return lengths


def test_offline_plan_is_valid() -> None:
    plan = offline_plan()
    plans.check(plan)
    assert [(p["protocol"], p["until_step"]) for p in plan] == [("bsp", 100), ("asp", 400)]
    assert plans.workload(plan) == 400


def test_insert_switch_adds_an_online_entry_with_the_same_target_and_shifts_later_ones() -> None:
    plan = offline_plan()
    before = copy.deepcopy(plan)
    switched = plans.insert_switch(plan, 0, "asp")
    assert plan == before  # the input is untouched
    assert switched == [
        {"index": 0, "protocol": "bsp", "until_step": 100, "origin": "plan"},
        {"index": 1, "protocol": "asp", "until_step": 100, "origin": "online"},
        {"index": 2, "protocol": "asp", "until_step": 400, "origin": "plan"},
    ]
    assert plans.workload(switched) == plans.workload(plan)


def test_switch_truncate_switch_back_truncate_keeps_the_workload() -> None:
    plan = plans.insert_switch(offline_plan(), 0, "asp")
    plan = plans.truncate(plan, 0, 40)  # the BSP segment stopped early at step 40
    plan = plans.insert_switch(plan, 1, "bsp")  # straggler cleared during the online ASP segment
    plan = plans.truncate(plan, 1, 70.5)  # ASP stops between steps (1/N of a step per update)
    assert [(p["index"], p["protocol"], p["until_step"], p["origin"]) for p in plan] == [
        (0, "bsp", 40, "plan"),
        (1, "asp", 70.5, "online"),
        (2, "bsp", 100, "online"),
        (3, "asp", 400, "plan"),
    ]
    plans.check(plan)
    assert sum(segment_lengths(plan)) == 400
    # The BSP budget is still 100 steps, split around the ASP detour.
    bsp = sum(n for n, p in zip(segment_lengths(plan), plan, strict=True) if p["protocol"] == "bsp")
    assert bsp == 100 - 30.5


def test_truncate_keeps_whole_steps_as_ints() -> None:
    plan = plans.truncate(plans.insert_switch(offline_plan(), 0, "asp"), 0, 40.0)
    assert plan[0]["until_step"] == 40 and isinstance(plan[0]["until_step"], int)


@pytest.mark.parametrize("end_step", [-1, 101])
def test_truncate_rejects_a_step_outside_the_segment(end_step: float) -> None:
    plan = plans.insert_switch(offline_plan(), 0, "asp")
    with pytest.raises(PlanError, match="cannot end"):
        plans.truncate(plan, 0, end_step)


def test_truncate_rejects_a_step_below_the_previous_target() -> None:
    plan = plans.insert_switch(plans.insert_switch(offline_plan(), 0, "asp"), 1, "bsp")
    plan = plans.truncate(plan, 0, 40)
    with pytest.raises(PlanError, match="runs from 40"):
        plans.truncate(plan, 1, 30)


def test_truncating_the_last_segment_would_shrink_the_workload() -> None:
    with pytest.raises(PlanError, match="workload"):
        plans.truncate(offline_plan(), 1, 300)
    assert plans.truncate(offline_plan(), 1, 400) == offline_plan()


def test_insert_switch_rejects_the_same_protocol_and_missing_entries() -> None:
    with pytest.raises(PlanError, match="already runs bsp"):
        plans.insert_switch(offline_plan(), 0, "bsp")
    with pytest.raises(PlanError, match="no entry 5"):
        plans.insert_switch(offline_plan(), 5, "asp")
    with pytest.raises(PlanError, match="ssp needs its setting"):
        plans.insert_switch(offline_plan(), 0, "ssp")
    with pytest.raises(PlanError, match="unknown protocol"):
        plans.insert_switch(offline_plan(), 0, "sync")


def test_a_switch_to_a_protocol_with_settings_carries_them_and_the_plan_checks_them() -> None:
    switched = plans.insert_switch(offline_plan(), 0, "ssp:4")
    assert switched[1] == {
        "index": 1,
        "protocol": "ssp",
        "protocol_args": {"staleness": 4},
        "until_step": 100,
        "origin": "online",
    }
    assert plans.protocol_of(switched[1]) == Protocol("ssp", staleness=4)
    assert plans.insert_switch(switched, 1, "ssp:2")[2]["protocol_args"] == {"staleness": 2}
    with pytest.raises(PlanError, match="already runs ssp:4"):
        plans.insert_switch(switched, 1, "ssp:4")
    broken = copy.deepcopy(switched)
    broken[1]["protocol_args"] = {"period": 3}
    with pytest.raises(PlanError, match="entry 1"):
        plans.check(broken)


def test_a_switch_order_plans_each_segment_with_its_protocol_and_splits_the_steps() -> None:
    """bsp_fraction goes to the BSP segments, the rest evenly to the others, whatever they run."""
    job = JobSpec.from_params({"switch_order": "1,ssp:4,local:8", "total_steps": 400, "bsp_fraction": 0.25})
    assert job.switch_order == "bsp,ssp:4,local:8"
    assert [(e["protocol"], e.get("protocol_args"), e["until_step"]) for e in job.plan_entries()] == [
        ("bsp", None, 100),
        ("ssp", {"staleness": 4}, 250),
        ("local", {"period": 8}, 400),
    ]
    spec = job.segment_spec(job.plan_entries()[1], "run", "/tmp/run")
    assert (spec.protocol, spec.protocol_args, spec.segment_protocol.staleness) == (
        "ssp",
        {"staleness": 4},
        4,
    )
    assert job.planned_bsp_fraction() == 0.25
    assert JobSpec.from_params({"switch_order": "fp16"}).segment_steps() == [400]


def test_entry_by_slot() -> None:
    plan = offline_plan()
    assert plans.entry(plan, 1) == plan[1]
    assert plans.entry(plan, 2) is None
    assert plans.entry([], 0) is None


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ([{"index": 0, "protocol": "bsp", "until_step": 100, "origin": "plan"}] * 2, "has index 0"),
        (
            [
                {"index": 0, "protocol": "bsp", "until_step": 100, "origin": "plan"},
                {"index": 1, "protocol": "asp", "until_step": 50, "origin": "plan"},
            ],
            "below the previous target",
        ),
        ([{"index": 0, "protocol": "x", "until_step": 1, "origin": "plan"}], "protocol"),
        ([{"index": 0, "protocol": "bsp", "until_step": 1, "origin": "manual"}], "origin"),
    ],
)
def test_check_catches_broken_plans(broken: list[dict], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plans.check(broken)


def test_straggler_specs_of_both_kinds_round_trip_and_repeat() -> None:
    from itertools import islice

    from syncswitch.spec import StragglerSpec

    cpu = StragglerSpec.parse("worker=1,start=20,duration=60,slowdown=4")
    network = StragglerSpec.parse({"worker": 2, "start": 5, "duration": 10, "delay_ms": 30, "every": 60})
    assert [StragglerSpec.parse(s.to_text()) for s in (cpu, network)] == [cpu, network]
    assert (cpu.kind, cpu.describe(), network.kind, network.describe()) == ("cpu", "x4", "network", "+30 ms")
    assert list(cpu.episodes(1000.0)) == [(1020.0, 1080.0)]
    assert list(islice(network.episodes(1000.0), 3)) == [(1005.0, 1015.0), (1065.0, 1075.0), (1125.0, 1135.0)]


@pytest.mark.parametrize(("order", "online", "fits"), [("10", 4, True), ("10", 5, False), ("101", 4, False)])
def test_a_job_fits_the_plans_segment_limit_with_every_online_switch(
    order: str, online: int, fits: bool
) -> None:
    from syncswitch.errors import SpecError

    params = {"switch_order": order, "max_online_switches": online}
    if fits:
        JobSpec.from_params(params)
    else:
        with pytest.raises(SpecError, match="max_online_switches"):
            JobSpec.from_params(params)


def test_steps_read_as_whole_numbers_and_asp_fractions_keep_one_decimal() -> None:
    assert [plans.step_text(s) for s in (0.0, 400.0, 370.5, 1_000_000.0, 99.96, None)] == [
        "0",
        "400",
        "370.5",
        "1,000,000",
        "100",
        "?",
    ]
