"""Online policies: none, greedy, elastic, the switch cap, and the protocol a switch goes to."""

from __future__ import annotations

import dataclasses

import pytest
from syncswitch.fields import ONLINE_POLICIES
from syncswitch_airflow.detector import Verdict
from syncswitch_airflow.policies import (
    ONLINE_RECOVERY,
    POLICY_NAMES,
    ElasticPolicy,
    PolicyContext,
    get_policy,
    measured_switch_gap,
)

NOW = 1_700_000_000.0


def verdict(
    straggling: bool, *, lasted: float = 10.0, extra_time: float = 0.2, slowdown: float = 3.0
) -> Verdict:
    return Verdict(
        straggling=straggling,
        workers=[1] if straggling else [],
        slowdown=slowdown if straggling else 1.0,
        since=NOW - lasted if straggling else None,
        window_start=NOW - 5.0,
        window_end=NOW,
        stats={},
        signal="compute_time",
        change="raised" if straggling else "cleared",
        baseline=0.1,
        extra_time=extra_time if straggling else 0.0,
        step_time=0.32,
        global_step=300.0,
    )


def context(
    v: Verdict,
    *,
    protocol: str = "bsp",
    origin: str = "plan",
    until_step: float = 1300.0,
    switches: int = 0,
    cap: int = 2,
    gap: float = 15.0,
    online_protocol: str = "asp",
) -> PolicyContext:
    return PolicyContext(
        segment_index=0,
        protocol=protocol,
        origin=origin,
        until_step=until_step,
        global_step=v.global_step,
        verdict=v,
        step_time=v.step_time,
        switch_gap=gap,
        online_protocol=online_protocol,
        online_switches=switches,
        max_online_switches=cap,
    )


def test_registry_matches_the_job_spec_choices() -> None:
    assert POLICY_NAMES == ONLINE_POLICIES
    assert [get_policy(name).name for name in POLICY_NAMES] == list(POLICY_NAMES)
    with pytest.raises(ValueError, match="greedy"):
        get_policy("random")


def test_none_never_switches_but_records_the_detection() -> None:
    decision = get_policy("none").decide(context(verdict(True)))
    assert decision.action == "stay" and decision.reason == "policy none"
    assert decision.numbers["workers"] == [1] and decision.numbers["slowdown"] == 3.0
    assert (
        get_policy("none").decide(context(verdict(False), protocol="asp", origin="online")).action == "stay"
    )


def test_greedy_switches_to_asp_when_a_straggler_appears_during_bsp() -> None:
    decision = get_policy("greedy").decide(context(verdict(True)))
    assert decision.action == "switch"
    assert "worker(s) 1" in decision.reason and "1000 BSP steps" in decision.reason
    assert decision.numbers["remaining_steps"] == 1000.0
    assert decision.to_dict()["numbers"]["switch_gap"] == 15.0


def test_greedy_switches_back_when_the_straggler_clears_during_online_asp() -> None:
    decision = get_policy("greedy").decide(
        context(verdict(False), protocol="asp", origin="online", switches=1)
    )
    assert decision.action == "switch_back"
    assert "cleared" in decision.reason


@pytest.mark.parametrize(
    ("straggling", "protocol", "origin", "reason"),
    [
        (False, "bsp", "plan", "no straggler"),
        (True, "asp", "plan", "tolerates it"),
        (True, "asp", "online", "tolerates it"),  # still there: stay in ASP
        (False, "asp", "plan", "no straggler"),  # a planned ASP segment is never switched back
    ],
)
def test_greedy_stays_otherwise(straggling: bool, protocol: str, origin: str, reason: str) -> None:
    decision = get_policy("greedy").decide(context(verdict(straggling), protocol=protocol, origin=origin))
    assert decision.action == "stay" and reason in decision.reason


@pytest.mark.parametrize("name", ["greedy", "elastic"])
def test_the_cap_stops_further_switches(name: str) -> None:
    long = verdict(True, lasted=3600.0)
    assert get_policy(name).decide(context(long, switches=1, cap=2)).action == "switch"
    capped = get_policy(name).decide(context(long, switches=2, cap=2))
    assert capped.action == "stay" and capped.reason.startswith("cap reached")
    back = get_policy(name).decide(
        context(verdict(False), protocol="asp", origin="online", switches=1, cap=1)
    )
    assert back.action == "stay" and back.reason.startswith("cap reached")
    assert get_policy(name).decide(context(long, cap=0)).action == "stay"


def test_no_switch_when_the_segment_is_at_its_target() -> None:
    decision = get_policy("greedy").decide(context(verdict(True), until_step=300.0))
    assert decision.action == "stay" and "target" in decision.reason


def test_elastic_declines_a_short_straggler() -> None:
    # 10 s so far -> 10 s expected -> 31 steps at 0.32 s -> 6.25 s saved < 2 x 15 s.
    decision = get_policy("elastic").decide(context(verdict(True, lasted=10.0)))
    assert decision.action == "stay"
    numbers = decision.numbers
    assert numbers["expected_remaining"] == 10.0
    assert numbers["affected_steps"] == pytest.approx(10.0 / 0.32, abs=1e-3)
    assert numbers["saving"] == pytest.approx(0.2 * 10.0 / 0.32, abs=1e-3)
    assert numbers["cost"] == 30.0
    assert "<= switch cost" in decision.reason


def test_elastic_accepts_a_long_straggler_capped_by_the_remaining_bsp_steps() -> None:
    # 600 s so far -> 600 s expected -> 1875 steps, but only 1000 BSP steps remain: 200 s saved.
    decision = get_policy("elastic").decide(context(verdict(True, lasted=600.0)))
    assert decision.action == "switch"
    assert decision.numbers["affected_steps"] == 1000.0
    assert decision.numbers["saving"] == pytest.approx(200.0)
    assert decision.numbers["saving"] > decision.numbers["cost"]


def test_elastic_weighs_the_measured_switch_gap() -> None:
    medium = verdict(True, lasted=120.0)  # 375 steps x 0.2 s = 75 s saved
    assert get_policy("elastic").decide(context(medium, gap=15.0)).action == "switch"
    assert get_policy("elastic").decide(context(medium, gap=60.0)).action == "stay"


def test_elastic_switches_back_like_greedy() -> None:
    decision = get_policy("elastic").decide(
        context(verdict(False), protocol="asp", origin="online", switches=1)
    )
    assert decision.action == "switch_back"


def test_elastic_without_a_per_worker_baseline_uses_the_slowdown_share_of_the_step_time() -> None:
    v = dataclasses.replace(verdict(True, lasted=60.0, slowdown=4.0), extra_time=0.0)
    numbers = ElasticPolicy.estimate(context(v))
    assert numbers["extra_time_per_step"] == pytest.approx(0.32 * 0.75)


def test_measured_switch_gap_prefers_gaps_then_startup_then_the_default() -> None:
    segments = {
        "0": {"ended_at": 100.0, "first_step_at": 20.0, "startup": {"process_start": 5.0, "first_step": 7.0}},
        "1": {
            "ended_at": 300.0,
            "first_step_at": 118.0,
            "startup": {"process_start": 6.0, "first_step": 9.0},
        },
    }
    assert measured_switch_gap(segments, 15.0) == (18.0, "measured gaps between segments")
    assert measured_switch_gap({"0": segments["0"]}, 15.0) == (12.0, "measured segment start-up")
    assert measured_switch_gap({}, 15.0) == (15.0, "default estimate")


@pytest.mark.parametrize(
    ("online_protocol", "slowdown", "to", "label"),
    [
        ("asp", 3.0, "asp", "ASP"),
        ("ssp:4", 3.0, "ssp:4", "SSP (s=4)"),
        ("local:8", 3.0, "local:8", "local SGD (H=8)"),
        ("auto", 3.0, "ssp:3", "SSP (s=3)"),
        ("auto", 4.4, "ssp:5", "SSP (s=5)"),
    ],
)
def test_a_switch_goes_to_the_jobs_online_protocol_or_autos_choice(
    online_protocol: str, slowdown: float, to: str, label: str
) -> None:
    v = verdict(True, slowdown=slowdown)
    decision = get_policy("greedy").decide(context(v, online_protocol=online_protocol))
    assert decision.action == "switch" and decision.numbers["to"] == to
    assert f"switch to {label} for the remaining" in decision.reason


@pytest.mark.parametrize("protocol", ["ssp", "local", "asp"])
def test_any_online_segment_switches_back_to_bsp_when_the_straggler_clears(protocol: str) -> None:
    back = get_policy("greedy").decide(
        context(verdict(False), protocol=protocol, origin="online", switches=1)
    )
    assert back.action == "switch_back" and back.numbers["to"] == "bsp"
    stay = get_policy("greedy").decide(context(verdict(True), protocol=protocol, origin="online", switches=1))
    assert stay.action == "stay"


def test_elastic_counts_only_the_share_of_the_straggler_time_the_protocol_recovers() -> None:
    long = verdict(True, lasted=600.0)
    for online_protocol in ("asp", "ssp:3", "local:8"):
        numbers = ElasticPolicy.estimate(context(long, online_protocol=online_protocol))
        share = ONLINE_RECOVERY[online_protocol.split(":")[0]]
        assert numbers["recovered_share"] == share
        assert numbers["saving"] == pytest.approx(200.0 * share)


def test_a_switch_decision_rewrites_the_plan_to_its_protocol(tmp_path) -> None:  # noqa: ANN001
    from syncswitch import state as run_state
    from syncswitch.layout import RunLayout
    from syncswitch.spec import JobSpec

    layout = RunLayout(str(tmp_path / "run"))
    job = JobSpec(switch_order="10", total_steps=400, bsp_fraction=0.5)
    run_state.create_run(layout, "run", job.to_params(), job.plan_entries())
    item = job.plan_entries()[0]
    decision = get_policy("greedy").decide(context(verdict(True), online_protocol="local:8"))
    record = {**decision.numbers, "segment": 0, "action": decision.action, "reason": decision.reason}
    run_state.apply_switch(layout, item, record)
    state = run_state.apply_switch(layout, item, record)  # a repeat inserts nothing more
    assert [(e["protocol"], e.get("protocol_args"), e["origin"]) for e in state["plan"]] == [
        ("bsp", None, "plan"),
        ("local", {"period": 8}, "online"),
        ("asp", None, "plan"),
    ]
