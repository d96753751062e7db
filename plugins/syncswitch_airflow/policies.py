"""Online policies: what to do when the straggler detector raises or clears. Pure logic.

A policy gets a :class:`PolicyContext` (the running segment, progress, the detector's verdict, measured
step time and switch gap, switches used) and returns a :class:`Decision`:

    "switch"       stop the running BSP segment and go on in the policy's protocol (``to``: ASP, or
                   the job's ``online_protocol``) to the same target
    "switch_back"  stop the running online segment and finish the BSP budget in BSP
    "stay"         do nothing; the reason and numbers are still recorded

Policies (DAG param ``online_policy``):

    none     never switches; detections are still recorded ("policy none").
    greedy   the paper's observed behaviour: a straggler during BSP -> the online protocol; when it
             clears during the online segment -> back to BSP for the rest of the BSP budget.
    elastic  switches only when the predicted saving exceeds the cost. The saving is the measured
             extra time per step times the steps the straggler is expected to slow down (the remaining
             BSP steps, capped by the expected remaining straggler duration: it is assumed to last as
             long again as it has lasted so far), times the share of that extra time the protocol
             recovers (ONLINE_RECOVERY). The cost is the measured switch gap, twice (there and back).
             Switches back like greedy.

The online protocol (job field ``online_protocol``): ``asp`` (the paper's), ``ssp:<s>``, ``local:<H>``,
or ``auto``, which picks among the bounded-staleness protocols by :func:`choose_online_protocol`.

Every switch counts against ``max_online_switches``; beyond it the decision is "stay" ("cap reached").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from syncswitch import protocols

from syncswitch_airflow.detector import Verdict

ACTIONS = ("switch", "stay", "switch_back")
POLICY_NAMES = ("none", "greedy", "elastic")
AUTO = "auto"
# The share of a straggler's extra time per step that each online protocol gives back: 1 - (its step
# time under the straggler - BSP's without) / (BSP's under it - BSP's without), measured with one
# worker at a quarter speed and rounded down (docs/benchmarks.md, "Protocols after BSP"; SSP's grows
# with s, local SGD's with H).
ONLINE_RECOVERY = {"asp": 1.0, "ssp": 0.85, "local": 0.9}


@dataclass(frozen=True)
class PolicyContext:
    segment_index: int
    protocol: str  # of the running segment: "bsp" | "asp"
    origin: str  # of the running segment's plan entry: "plan" | "online"
    until_step: float  # the running segment's cumulative target
    global_step: float  # progress reached, BSP-equivalent steps
    verdict: Verdict
    step_time: float  # measured seconds per BSP-equivalent step, under the straggler
    switch_gap: float  # measured (or estimated) seconds from one segment's stop to the next's first step
    online_switches: int  # switches (either direction) already made in this run
    max_online_switches: int
    now: float | None = None  # decision time (epoch s); None = the verdict's window end
    switch_gap_source: str = "default estimate"
    online_protocol: str = "asp"  # the job's: a switch order's spelling, or "auto"

    @property
    def remaining_steps(self) -> float:
        return max(self.until_step - self.global_step, 0.0)

    @property
    def decision_time(self) -> float:
        return self.verdict.window_end if self.now is None else self.now


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action {self.action!r} is not one of {ACTIONS}")

    @property
    def switches(self) -> bool:
        return self.action != "stay"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Policy(Protocol):
    name: str

    def decide(self, context: PolicyContext) -> Decision: ...


def base_numbers(context: PolicyContext) -> dict[str, Any]:
    """The numbers every decision records, whatever the policy."""
    verdict = context.verdict
    return {
        "straggling": verdict.straggling,
        "workers": list(verdict.workers),
        "slowdown": round(verdict.slowdown, 4),
        "since": verdict.since,
        "global_step": round(context.global_step, 4),
        "until_step": context.until_step,
        "remaining_steps": round(context.remaining_steps, 4),
        "step_time": round(context.step_time, 6),
        "switch_gap": round(context.switch_gap, 3),
        "switch_gap_source": context.switch_gap_source,
        "online_switches": context.online_switches,
        "max_online_switches": context.max_online_switches,
    }


def choose_online_protocol(context: PolicyContext) -> tuple[protocols.Protocol, str]:
    """The protocol a switch goes to, and why. The job's ``online_protocol``, or for ``auto``: a
    straggler during the BSP phase is met with bounded staleness, never ASP, because that phase is
    BSP for its accuracy (the offline search keeps BSP exactly as long as ASP loses accuracy; early
    ASP collapsed on MNIST-1D at its large learning rate): SSP with s = the straggler's slowdown
    rounded up (the fast workers may then run ahead by as many steps as one straggler step costs
    them). Under a straggler SSP gave back most of its time (ONLINE_RECOVERY) and kept BSP's accuracy
    where ASP lost some and local SGD with a long period collapsed (docs/benchmarks.md, "Protocols
    after BSP")."""
    if context.online_protocol != AUTO:
        return protocols.parse_token(context.online_protocol, "online_protocol"), "the job's online_protocol"
    staleness = max(1, math.ceil(context.verdict.slowdown))
    return protocols.Protocol("ssp", staleness=staleness), (
        f"auto: bounded staleness in the BSP phase, s = slowdown x{context.verdict.slowdown:.2f} rounded up"
    )


def _candidate(context: PolicyContext) -> tuple[str | None, str]:
    """The switch the verdict calls for in this segment (None: none), and why."""
    verdict = context.verdict
    workers = ", ".join(str(w) for w in verdict.workers)
    if verdict.straggling and context.protocol == "bsp":
        return "switch", f"straggler on worker(s) {workers} (x{verdict.slowdown:.2f}) during BSP"
    title = protocols.family(context.protocol).title
    if not verdict.straggling and context.protocol != "bsp" and context.origin == "online":
        return "switch_back", f"straggler cleared during the online {title} segment"
    if verdict.straggling:
        tolerance = "tolerates it" if context.protocol == "asp" else "bounds the wait for it"
        return None, f"straggler on worker(s) {workers} during {title}, which {tolerance}"
    return None, "no straggler"


def _precheck(context: PolicyContext) -> tuple[str | None, Decision | None]:
    """The candidate action, or a "stay" decision that no policy can override."""
    action, reason = _candidate(context)
    numbers = base_numbers(context)
    if action is None:
        return None, Decision("stay", reason, numbers)
    if context.online_switches >= context.max_online_switches:
        return None, Decision("stay", f"cap reached ({reason})", numbers)
    if context.remaining_steps <= 0:
        return None, Decision("stay", f"segment already at its target ({reason})", numbers)
    return action, None


def _switch_decision(action: str, context: PolicyContext, numbers: dict[str, Any]) -> Decision:
    steps = context.remaining_steps
    if action == "switch":
        _, why = _candidate(context)
        target, chosen_by = choose_online_protocol(context)
        numbers = {**numbers, "to": target.token, "to_chosen_by": chosen_by}
        return Decision(
            "switch", f"{why}: switch to {target.label} for the remaining {steps:g} BSP steps", numbers
        )
    return Decision(
        "switch_back",
        f"straggler cleared: back to BSP for the remaining {steps:g} BSP steps",
        {**numbers, "to": "bsp"},
    )


@dataclass(frozen=True)
class NonePolicy:
    name: str = "none"

    def decide(self, context: PolicyContext) -> Decision:
        reason = "policy none" if context.verdict.straggling else "no straggler"
        return Decision("stay", reason, base_numbers(context))


@dataclass(frozen=True)
class GreedyPolicy:
    name: str = "greedy"

    def decide(self, context: PolicyContext) -> Decision:
        action, stay = _precheck(context)
        if stay is not None:
            return stay
        assert action is not None
        return _switch_decision(action, context, base_numbers(context))


@dataclass(frozen=True)
class ElasticPolicy:
    name: str = "elastic"

    def decide(self, context: PolicyContext) -> Decision:
        action, stay = _precheck(context)
        if stay is not None:
            return stay
        assert action is not None
        if action == "switch_back":
            return _switch_decision(action, context, base_numbers(context))
        numbers = {**base_numbers(context), **self.estimate(context)}
        if numbers["saving"] > numbers["cost"]:
            return _switch_decision(action, context, numbers)
        return Decision(
            "stay",
            f"predicted saving {numbers['saving']:.1f} s <= switch cost {numbers['cost']:.1f} s",
            numbers,
        )

    @staticmethod
    def estimate(context: PolicyContext) -> dict[str, float]:
        """Saving and cost of switching now, in seconds, and the numbers behind them."""
        verdict = context.verdict
        recovery = ONLINE_RECOVERY.get(choose_online_protocol(context)[0].name, 1.0)
        extra_per_step = verdict.extra_time
        if extra_per_step <= 0 and verdict.slowdown > 1:
            # No per-worker baseline: attribute the slowdown's share of the measured step time.
            extra_per_step = context.step_time * (1 - 1 / verdict.slowdown)
        since = verdict.since if verdict.since is not None else context.decision_time
        elapsed = max(context.decision_time - since, 0.0)
        expected_remaining = elapsed  # a straggler is expected to last as long again as it has so far
        if context.step_time > 0:
            affected_steps = min(context.remaining_steps, expected_remaining / context.step_time)
        else:
            affected_steps = context.remaining_steps
        return {
            "extra_time_per_step": round(extra_per_step, 6),
            "straggler_elapsed": round(elapsed, 3),
            "expected_remaining": round(expected_remaining, 3),
            "affected_steps": round(affected_steps, 3),
            "recovered_share": recovery,
            "saving": round(extra_per_step * affected_steps * recovery, 3),
            "cost": round(2 * context.switch_gap, 3),
        }


def get_policy(name: str) -> Policy:
    """The policy called ``name`` (the DAG param ``online_policy``)."""
    factories: dict[str, Callable[[], Policy]] = {
        "none": NonePolicy,
        "greedy": GreedyPolicy,
        "elastic": ElasticPolicy,
    }
    try:
        return factories[name]()
    except KeyError:
        raise ValueError(
            f"unknown online policy {name!r}; expected one of {', '.join(POLICY_NAMES)}"
        ) from None


def measured_switch_gap(segments: dict[str, dict[str, Any]], default: float) -> tuple[float, str]:
    """Seconds a switch costs, from this run's segment results, and where the number came from.

    Best: the mean gap between one segment's end and the next one's first step. Else the mean
    start-up (launch to first step) of the finished segments, most of a switch's cost. Else
    ``default``.
    """
    by_index = {int(k): v for k, v in segments.items()}
    gaps = [
        by_index[i + 1]["first_step_at"] - by_index[i]["ended_at"]
        for i in sorted(by_index)
        if i + 1 in by_index
        and by_index[i].get("ended_at") is not None
        and by_index[i + 1].get("first_step_at") is not None
    ]
    if gaps:
        return sum(gaps) / len(gaps), "measured gaps between segments"
    startups = [t for t in (_startup_seconds(r.get("startup")) for r in by_index.values()) if t is not None]
    if startups:
        return sum(startups) / len(startups), "measured segment start-up"
    return default, "default estimate"


def _startup_seconds(startup: Any) -> float | None:
    """Launch to first step: a SegmentResult's ``startup`` is a split (phase -> s) or a number."""
    if isinstance(startup, dict) and startup:
        return float(sum(startup.values()))
    if isinstance(startup, int | float) and not isinstance(startup, bool):
        return float(startup)
    return None
