"""The offline timing policy on synthetic histories: phases, the tolerance edge, refinement, the floor,
configuration change, drift, failed runs, completion order, overlapping runs with claims, and the
search over the protocol after BSP (rule 10).

Accuracies and tolerances are exact binary fractions (0.75, 1/64, ...), so the means and the
``baseline mean - tolerance`` threshold are exact and the tests at the edge cannot flake on rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from syncswitch_airflow.timing import TimingConfig, decide, decide_among, search_state

FP = "f00dfeedcafe0001"
NOW = 1_700_000_000.0
TOL = 1 / 64  # threshold for a 0.75 baseline: 0.734375, exactly
BASE = 0.75
EDGE = BASE - TOL
BELOW_EDGE = EDGE - 2**-20


@dataclass
class History:
    """Records in completion order: each added run finishes one second after the previous one."""

    fingerprint: str = FP
    records: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)

    def run(
        self,
        fraction: float,
        accuracy: float | None,
        *,
        status: str = "success",
        fingerprint: str | None = None,
        **extra: Any,
    ) -> History:
        number = len(self.records) + 1
        self.records.append(
            {
                "run_id": f"run-{number:03d}",
                "fingerprint": fingerprint or self.fingerprint,
                "status": status,
                "bsp_fraction": fraction,
                "final_accuracy": accuracy,
                "finished_at": NOW - 10_000 + number,
                "policy_phase": "search",
                **extra,
            }
        )
        return self

    def runs(self, fraction: float, *accuracies: float) -> History:
        for accuracy in accuracies:
            self.run(fraction, accuracy)
        return self

    def claim(
        self, run_id: str, fraction: float, *, age: float = 60.0, fingerprint: str | None = None
    ) -> None:
        self.claims.append(
            {
                "run_id": run_id,
                "fingerprint": fingerprint or self.fingerprint,
                "bsp_fraction": fraction,
                "phase": "search",
                "claimed_at": NOW - age,
            }
        )

    def decide(self, config: TimingConfig, fingerprint: str | None = None):  # noqa: ANN201
        return decide(self.records, self.claims, fingerprint or self.fingerprint, config, NOW)

    def state(self, config: TimingConfig) -> dict[str, Any]:
        return search_state(self.records, self.claims, self.fingerprint, config, NOW)


K3 = TimingConfig(repeats=3, tolerance=TOL)
K1 = TimingConfig(repeats=1, tolerance=TOL)


# ---- phases -------------------------------------------------------------------------------------------


def test_an_empty_history_starts_with_a_bsp_baseline_run() -> None:
    decision = History().decide(K3)
    assert (decision.bsp_fraction, decision.phase) == (1.0, "baseline")
    assert decision.numbers["generation"] == 1
    assert decision.numbers["baseline"]["n"] == 0
    assert "0 of 3 runs done" in decision.reason


def test_runs_stay_bsp_until_there_are_k_baseline_runs() -> None:
    history = History().runs(1.0, BASE, BASE)
    decision = history.decide(K3)
    assert (decision.bsp_fraction, decision.phase) == (1.0, "baseline")
    assert "2 of 3 runs done" in decision.reason
    history.run(1.0, BASE)
    decision = history.decide(K3)
    assert (decision.bsp_fraction, decision.phase) == (0.5, "search")
    assert decision.numbers["baseline"] == {
        "n": 3,
        "mean": BASE,
        "sd": 0.0,
        "runs": ["run-001", "run-002", "run-003"],
    }
    assert decision.numbers["threshold"] == EDGE


def test_a_candidate_needs_k_runs_before_its_verdict() -> None:
    history = History().runs(1.0, BASE, BASE, BASE).runs(0.5, 0.5, 0.5)
    decision = history.decide(K3)
    assert decision.bsp_fraction == 0.5 and decision.phase == "search"
    assert decision.numbers["candidate_runs_done"] == 2
    assert decision.numbers["rejected"] == []


def test_the_search_halves_while_accepted_and_exploits_the_smallest_accepted_fraction() -> None:
    history = History().runs(1.0, BASE, BASE, BASE).runs(0.5, BASE, BASE, BASE)
    assert history.decide(K3).bsp_fraction == 0.25
    history.runs(0.25, EDGE, EDGE, EDGE)
    assert history.decide(K3).bsp_fraction == 0.125
    history.runs(0.125, 0.5, 0.5, 0.5)
    decision = history.decide(K3)
    assert (decision.bsp_fraction, decision.phase) == (0.25, "exploit")
    assert [a["fraction"] for a in decision.numbers["accepted"]] == [0.5, 0.25]
    assert [r["fraction"] for r in decision.numbers["rejected"]] == [0.125]
    assert decision.numbers["chosen_mean"] == EDGE
    # Exploit runs keep using it.
    history.runs(0.25, BASE, BASE)
    assert history.decide(K3).bsp_fraction == 0.25


def test_acceptance_is_inclusive_exactly_at_the_tolerance_edge() -> None:
    accepted = History().runs(1.0, BASE, BASE, BASE).runs(0.5, EDGE, EDGE, EDGE)
    assert accepted.decide(K3).bsp_fraction == 0.25
    assert accepted.decide(K3).numbers["accepted"][0]["mean"] == EDGE

    rejected = History().runs(1.0, BASE, BASE, BASE).runs(0.5, BELOW_EDGE, BELOW_EDGE, BELOW_EDGE)
    decision = rejected.decide(K3)
    # Even 0.5 fell short, by 2**-20: BSP all the way.
    assert (decision.bsp_fraction, decision.phase) == (1.0, "exploit")
    assert "even 0.5 was rejected" in decision.reason


def test_the_floor_ends_the_search_when_every_candidate_is_accepted() -> None:
    config = TimingConfig(repeats=1, tolerance=TOL, floor=1 / 8)
    assert config.halving_candidates() == [0.5, 0.25, 0.125]
    history = History().runs(1.0, BASE).runs(0.5, BASE).runs(0.25, BASE)
    assert history.decide(config).bsp_fraction == 0.125
    history.runs(0.125, BASE)
    decision = history.decide(config)
    assert (decision.bsp_fraction, decision.phase) == (0.125, "exploit")
    assert "every candidate down to the floor 0.125 accepted" in decision.reason
    assert TimingConfig(floor=0.2).halving_candidates() == [0.5, 0.25]


def test_refinement_bisects_between_the_last_accepted_and_the_first_rejected_fraction() -> None:
    config = TimingConfig(repeats=1, tolerance=TOL, refine=2)
    history = History().runs(1.0, BASE).runs(0.5, BASE).runs(0.25, 0.5)
    decision = history.decide(config)
    assert (decision.bsp_fraction, decision.phase) == (0.375, "search")
    assert decision.numbers["candidate_kind"] == "refine"
    history.runs(0.375, 0.5)  # rejected: the next midpoint is above it
    assert history.decide(config).bsp_fraction == 0.4375
    history.runs(0.4375, BASE)  # accepted; two refinement steps done
    decision = history.decide(config)
    assert (decision.bsp_fraction, decision.phase) == (0.4375, "exploit")
    assert [r["fraction"] for r in decision.numbers["rejected"]] == [0.25, 0.375]


def test_refinement_after_rejecting_one_half_bisects_below_bsp() -> None:
    config = TimingConfig(repeats=1, tolerance=TOL, refine=1)
    history = History().runs(1.0, BASE).runs(0.5, 0.5)
    assert history.decide(config).bsp_fraction == 0.75
    history.runs(0.75, BASE)
    assert history.decide(config).bsp_fraction == 0.75
    assert history.decide(config).phase == "exploit"


def test_without_refinement_the_search_stops_at_the_first_rejection() -> None:
    history = History().runs(1.0, BASE).runs(0.5, BASE).runs(0.25, 0.5)
    decision = history.decide(K1)
    assert (decision.bsp_fraction, decision.phase) == (0.5, "exploit")


# ---- evidence: failed runs, imports, order, configuration -------------------------------------------------


def test_failed_runs_and_runs_without_an_accuracy_never_count() -> None:
    history = History().run(1.0, BASE, status="failed").run(1.0, None).run(1.0, BASE)
    history.run(0.5, 0.0, status="failed")
    decision = history.decide(TimingConfig(repeats=2, tolerance=TOL))
    assert (decision.bsp_fraction, decision.phase) == (1.0, "baseline")
    assert decision.numbers["baseline"]["runs"] == ["run-003"]


def test_the_role_of_a_record_comes_from_its_fraction_not_its_phase() -> None:
    history = History()
    history.run(1.0, BASE, policy_phase="fixed")
    history.run(0.5, BASE, policy_phase="baseline")  # a misleading phase changes nothing
    for record in history.records[:1]:
        del record["policy_phase"]  # an imported record without one
    decision = history.decide(K1)
    assert decision.bsp_fraction == 0.25
    assert decision.numbers["baseline"]["runs"] == ["run-001"]
    assert decision.numbers["accepted"][0]["fraction"] == 0.5


def test_evidence_is_read_in_completion_order_not_list_or_logical_date_order() -> None:
    # A backfill: the run of the later logical date finished first with a low accuracy.
    history = History().runs(1.0, BASE)
    history.run(0.5, 0.5, logical_date="2024-01-02T00:00:00+00:00")
    history.run(0.5, BASE, logical_date="2024-01-01T00:00:00+00:00")
    records = list(reversed(history.records))
    decision = decide(records, [], FP, K1, NOW)
    # The verdict is the first result to complete (0.5: rejected), whatever came later.
    assert (decision.bsp_fraction, decision.phase) == (1.0, "exploit")


def test_ties_in_finished_at_are_broken_by_run_id() -> None:
    history = History().runs(1.0, BASE)
    history.run(0.5, BASE, run_id="b-run").run(0.5, 0.5, run_id="a-run")
    for record in history.records[1:]:
        record["finished_at"] = NOW - 5
    decision = history.decide(K1)
    assert [r["fraction"] for r in decision.numbers["rejected"]] == [0.5]  # "a-run" sorts first


def test_records_without_finished_at_sort_first() -> None:
    history = History().runs(1.0, BASE).run(0.5, BASE).run(0.5, 0.5)
    del history.records[2]["finished_at"]  # the 0.5-accuracy run counts as the earliest
    assert history.decide(K1).numbers["rejected"][0]["fraction"] == 0.5


def test_a_new_fingerprint_searches_from_the_baseline_and_an_old_one_keeps_its_history() -> None:
    history = History().runs(1.0, BASE).runs(0.5, 0.5)
    assert history.decide(K1).phase == "exploit"
    history.run(1.0, BASE, fingerprint="another-config")
    fresh = history.decide(K1, fingerprint="new-config")
    assert (fresh.bsp_fraction, fresh.phase) == (1.0, "baseline")
    assert history.decide(K1, fingerprint="another-config").bsp_fraction == 0.5
    assert history.decide(K1).phase == "exploit"


# ---- drift ---------------------------------------------------------------------------------------------


def _finished_search() -> History:
    """k=3: 0.5 accepted at mean 0.75, 0.25 rejected: exploit 0.5."""
    return History().runs(1.0, BASE, BASE, BASE).runs(0.5, BASE, BASE, BASE).runs(0.25, 0.5, 0.5, 0.5)


def test_drift_below_the_accepted_mean_starts_a_new_generation_from_the_baseline() -> None:
    history = _finished_search().runs(0.5, BASE, BELOW_EDGE, BELOW_EDGE)
    assert history.decide(K3).phase == "exploit"  # latest three: mean above the edge
    history.run(0.5, BELOW_EDGE)
    decision = history.decide(K3)
    assert (decision.bsp_fraction, decision.phase) == (1.0, "baseline")
    assert decision.numbers["generation"] == 2
    assert decision.numbers["ignored_runs"] == 13
    assert decision.numbers["evidence_runs"] == 0
    drift = decision.numbers["drifts"][0]
    assert (
        drift["run_id"] == "run-013" and drift["recent_mean"] == BELOW_EDGE and drift["accepted_mean"] == BASE
    )
    # The new generation's evidence begins after the drift point.
    history.runs(1.0, 0.5, 0.5, 0.5).runs(0.5, 0.5, 0.5, 0.5)
    decision = history.decide(K3)
    assert (decision.bsp_fraction, decision.numbers["generation"]) == (0.25, 2)
    assert decision.numbers["baseline"]["mean"] == 0.5


def test_exploit_runs_exactly_at_the_tolerance_edge_are_no_drift() -> None:
    history = _finished_search().runs(0.5, EDGE, EDGE, EDGE)
    decision = history.decide(K3)
    assert (decision.phase, decision.numbers["generation"]) == ("exploit", 1)
    assert decision.numbers["exploit_recent_mean"] == EDGE


def test_only_runs_completed_after_the_search_ended_are_exploit_runs() -> None:
    # Extra 0.5 runs that completed before 0.25's verdict ended the search are not exploit runs.
    history = History().runs(1.0, BASE, BASE, BASE).runs(0.5, BASE, BASE, BASE)
    history.runs(0.5, 0.5, 0.5, 0.5).runs(0.25, 0.5, 0.5, 0.5)
    decision = history.decide(K3)
    assert (decision.phase, decision.numbers["exploit_runs"]) == ("exploit", 0)


def test_drift_when_bsp_was_chosen_compares_with_the_baseline_mean() -> None:
    history = History().runs(1.0, BASE).runs(0.5, 0.5).runs(1.0, 0.5)
    decision = history.decide(K1)
    assert (decision.phase, decision.numbers["generation"]) == ("baseline", 2)


# ---- overlapping runs ----------------------------------------------------------------------------------


def _decide_and_claim(history: History, run_id: str, config: TimingConfig) -> float:
    decision = history.decide(config)
    history.claim(run_id, decision.bsp_fraction)
    return decision.bsp_fraction


def test_three_overlapping_runs_on_an_empty_history_take_baseline_half_and_quarter() -> None:
    history = History()
    taken = [_decide_and_claim(history, f"backfill-{i}", K1) for i in range(3)]
    assert taken == [1.0, 0.5, 0.25]
    second = decide([], history.claims[:1], FP, K1, NOW)
    assert second.phase == "search" and second.numbers["speculative"] is True
    assert [c["run_id"] for c in second.numbers["in_flight"]] == ["backfill-0"]


def test_a_baseline_with_k_runs_in_flight_is_not_assigned_again() -> None:
    history = History()
    taken = [_decide_and_claim(history, f"r{i}", K3) for i in range(4)]
    assert taken == [1.0, 1.0, 1.0, 0.5]


def test_expired_claims_and_claims_with_a_record_are_not_in_flight() -> None:
    history = History()
    history.claim("died-long-ago", 1.0, age=K1.claim_ttl_seconds + 1)
    history.claim("other-config", 1.0, fingerprint="other")
    decision = history.decide(K1)
    assert decision.bsp_fraction == 1.0
    assert decision.numbers["expired_claims"] == ["died-long-ago"]
    # A claim whose run has finished (even failed) is not in flight either.
    history.claim("run-001", 1.0)
    history.run(1.0, None, status="failed")
    assert history.decide(K1).bsp_fraction == 1.0


def test_when_every_item_is_covered_the_earliest_unresolved_item_is_repeated() -> None:
    config = TimingConfig(repeats=1, tolerance=TOL, floor=1 / 4)
    history = History()
    history.claim("a", 1.0)
    history.claim("b", 0.5)
    history.claim("c", 0.25)
    decision = history.decide(config)
    assert (decision.bsp_fraction, decision.phase) == (1.0, "baseline")
    assert decision.numbers["extra_repeat"] is True
    assert "extra run, harmless" in decision.reason


def test_speculative_results_past_a_rejection_are_kept_but_never_accepted() -> None:
    # 0.25 ran speculatively (and finished first, well above the bar), then 0.5 was rejected.
    history = History().runs(0.25, BASE).runs(1.0, BASE).runs(0.5, 0.5)
    decision = history.decide(K1)
    assert (decision.bsp_fraction, decision.phase) == (1.0, "exploit")
    items = history.state(K1)["generations"][0]["items"]
    assert [(i["fraction"], i["verdict"]) for i in items] == [(0.5, "rejected"), (0.25, "past the rejection")]


def test_during_refinement_only_the_current_midpoint_is_assigned() -> None:
    config = TimingConfig(repeats=1, tolerance=TOL, refine=2)
    history = History().runs(1.0, BASE).runs(0.5, 0.5)
    history.claim("in-flight", 0.75)
    decision = history.decide(config)
    # The next midpoint depends on 0.75's verdict: repeat it rather than guess.
    assert decision.bsp_fraction == 0.75 and decision.numbers["extra_repeat"] is True


def test_exploit_decisions_ignore_claims() -> None:
    history = History().runs(1.0, BASE).runs(0.5, 0.5)
    history.claim("x", 1.0)
    assert history.decide(K1).bsp_fraction == 1.0 and history.decide(K1).phase == "exploit"


# ---- the view, the decision object, the config -------------------------------------------------------------


def test_search_state_lays_out_every_generation() -> None:
    history = _finished_search().runs(0.5, 0.5, 0.5, 0.5).runs(1.0, BASE)
    state = history.state(K3)
    assert state["generation"] == 2
    first, second = state["generations"]
    assert first["finished"] and first["chosen_fraction"] == 0.5 and first["search_ended_by"] == "run-009"
    assert [(i["fraction"], i["verdict"], i["n"]) for i in first["items"]] == [
        (0.5, "accepted", 3),
        (0.25, "rejected", 3),
    ]
    assert first["baseline"]["mean"] == BASE and first["baseline"]["verdict"] == "complete"
    assert first["exploit"]["runs"] == ["run-010", "run-011", "run-012"]
    assert first["drift"]["run_id"] == "run-012"
    assert second["runs"] == ["run-013"] and second["baseline"]["verdict"] == "pending"
    assert state["decision"]["bsp_fraction"] == 1.0
    json.dumps(state)  # plain JSON-able data


def test_the_decision_is_a_plain_dict() -> None:
    decision = History().runs(1.0, BASE).decide(K1)
    data = json.loads(json.dumps(decision.to_dict()))
    assert set(data) == {"bsp_fraction", "phase", "reason", "numbers", "protocol"}
    assert data["numbers"]["config"]["repeats"] == 1


@pytest.mark.parametrize(
    ("changes", "field_name"),
    [
        ({"repeats": 0}, "timing_repeats"),
        ({"repeats": 1.5}, "timing_repeats"),
        ({"tolerance": -0.1}, "timing_tolerance"),
        ({"tolerance": float("nan")}, "timing_tolerance"),
        ({"floor": 0.0}, "timing_floor"),
        ({"floor": 0.75}, "timing_floor"),
        ({"refine": -1}, "timing_refine"),
        ({"claim_ttl_seconds": 0}, "timing_claim_ttl_seconds"),
    ],
)
def test_config_validation_names_the_field(changes: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field_name}: must be"):
        TimingConfig(**changes).validate()
    with pytest.raises(ValueError, match=field_name):
        decide([], [], FP, TimingConfig(**changes), NOW)


# ---- the protocol after BSP (rule 10) -------------------------------------------------------------


def after(protocol: str) -> dict[str, Any]:
    """A record's fields for a run that trained ``protocol`` after BSP."""
    return {"switch_order": "10" if protocol == "asp" else f"bsp,{protocol}"}


def among(history: History, config: TimingConfig, protocols: tuple[str, ...]):  # noqa: ANN201
    return decide_among(history.records, history.claims, FP, config, NOW, protocols)


PROTOCOLS = ("asp", "ssp:4")


def test_each_protocol_is_searched_on_its_own_runs_after_a_shared_baseline() -> None:
    history = History().runs(1.0, BASE)  # the baseline counts for every protocol
    first = among(history, K1, PROTOCOLS)
    assert (first.protocol, first.bsp_fraction, first.phase) == ("asp", 0.5, "search")
    assert first.reason.startswith("Protocol after BSP asp (of asp, ssp:4): Searching candidate 0.5")
    # ASP: 0.5 and 0.25 accepted, 0.125 rejected: its search is over; SSP's starts at 0.5.
    for fraction, accuracy in ((0.5, BASE), (0.25, BASE), (0.125, BELOW_EDGE)):
        history.run(fraction, accuracy, **after("asp"))
    second = among(history, K1, PROTOCOLS)
    assert (second.protocol, second.bsp_fraction) == ("ssp:4", 0.5)
    # A legacy record (no switch_order) is an ASP run: it never counts for SSP's search.
    history.run(0.5, BASE)
    assert among(history, K1, PROTOCOLS).bsp_fraction == 0.5


def test_runs_in_flight_on_one_protocol_send_the_next_run_to_the_next_protocol() -> None:
    history = History().runs(1.0, BASE)
    for run, fraction in (("a", 0.5), ("b", 0.25), ("c", 0.125), ("d", 0.0625), ("e", 0.03125)):
        history.claims.append(
            {
                "run_id": run,
                "fingerprint": FP,
                "bsp_fraction": fraction,
                "phase": "search",
                "claimed_at": NOW - 60,
                "protocol": "asp",
            }
        )
    decision = among(history, K1, PROTOCOLS)
    assert (decision.protocol, decision.bsp_fraction) == ("ssp:4", 0.5)


def test_once_every_search_finished_the_fastest_choice_is_exploited() -> None:
    history = History().run(1.0, BASE, total_seconds=100.0)
    for protocol, seconds in (("asp", 60.0), ("ssp:4", 70.0)):
        history.run(0.5, BASE, total_seconds=seconds + 10, **after(protocol))
        history.run(0.25, BASE, total_seconds=seconds, **after(protocol))
        history.run(0.125, BELOW_EDGE, total_seconds=seconds - 10, **after(protocol))
    decision = among(history, K1, PROTOCOLS)
    assert (decision.protocol, decision.bsp_fraction, decision.phase) == ("asp", 0.25, "exploit")
    assert decision.numbers["protocols"]["ssp:4"] == {
        "fraction": 0.25,
        "mean_accuracy": BASE,
        "mean_seconds": 70.0,
    }
    assert "the fastest choice is asp" in decision.reason
    # SSP's runs at its choice become faster than ASP's: it takes over.
    history.records[5]["total_seconds"] = 50.0
    assert among(history, K1, PROTOCOLS).protocol == "ssp:4"


def test_one_protocol_decides_as_before() -> None:
    history = History().runs(1.0, BASE).runs(0.5, BASE)
    assert among(history, K1, ("asp",)).to_dict() == {**history.decide(K1).to_dict(), "protocol": "asp"}
