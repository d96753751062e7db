"""Pure functions over ``state["plan"]``: a list of ``{index, protocol, until_step, origin}``, with
``protocol_args`` where the protocol has settings (``syncswitch.protocols``: ``{"staleness": 4}``).

Online switching (docs/architecture.md): when a policy switches during segment ``i`` (target ``U``),
entry ``i`` keeps its protocol, a new entry ``i+1`` with the policy's protocol and target ``U`` is
inserted with ``origin: "online"``, and later entries shift by one. When segment ``i`` then stops
early at step ``s``, :func:`truncate` sets entry ``i``'s ``until_step`` to ``s``. The job's workload
(the last entry's ``until_step``) never changes, and targets never decrease along the plan.

Every function returns a new list and leaves its input untouched.
"""

from __future__ import annotations

import copy
from typing import Any

from syncswitch.protocols import DIGITS, PROTOCOLS, Protocol, parse_token

Entry = dict[str, Any]
# A switch order's digits, as the original's flag spelled a plan: "1" BSP, "0" ASP.
PROTOCOL_DIGITS = DIGITS
ORIGINS = ("plan", "online")
# A run's plan holds at most this many segments: the offline ones plus one per online switch. The DAG
# has one task slot per segment; 6 covers "101" with 2 online switches and keeps the graph readable.
MAX_SEGMENTS = 6


class PlanError(ValueError):
    """A plan that breaks an invariant, or an operation that would break one."""


def step_text(step: float | None) -> str:
    """A global step for people: whole steps as integers ("400"), the fractions that ASP makes (a
    worker's step is its share of the global batch) to one decimal ("370.5")."""
    if step is None:
        return "?"
    return f"{step:,.0f}" if abs(step - round(step)) < 0.05 else f"{step:,.1f}"


def protocol_of(item: Entry) -> Protocol:
    """The protocol an entry runs, with its settings."""
    return Protocol.of(item["protocol"], item.get("protocol_args"))


def entry_fields(protocol: Protocol) -> Entry:
    """An entry's protocol keys: ``protocol``, and ``protocol_args`` where it has settings."""
    args = protocol.args()
    return {"protocol": protocol.name, **({"protocol_args": args} if args else {})}


def check(plan: list[Entry]) -> None:
    """Raise PlanError unless indices run 0..n-1, fields are valid and targets never decrease."""
    previous = 0.0
    for position, item in enumerate(plan):
        if item.get("index") != position:
            raise PlanError(f"entry at position {position} has index {item.get('index')!r}")
        if item.get("protocol") not in PROTOCOLS:
            raise PlanError(f"entry {position}: protocol {item.get('protocol')!r} is not one of {PROTOCOLS}")
        try:
            protocol_of(item)
        except ValueError as err:
            raise PlanError(f"entry {position}: {err}") from None
        if item.get("origin") not in ORIGINS:
            raise PlanError(f"entry {position}: origin {item.get('origin')!r} is not one of {ORIGINS}")
        until = item.get("until_step")
        if not isinstance(until, int | float) or until < previous:
            raise PlanError(f"entry {position}: until_step {until!r} is below the previous target {previous}")
        previous = until


def workload(plan: list[Entry]) -> float:
    """The job's total steps: the last target (0 for an empty plan)."""
    return plan[-1]["until_step"] if plan else 0


def entry(plan: list[Entry], slot: int) -> Entry | None:
    """The plan entry that DAG slot ``slot`` runs, or None past the end of the plan."""
    for item in plan:
        if item.get("index") == slot:
            return item
    return None


def _require(plan: list[Entry], index: int) -> Entry:
    item = entry(plan, index)
    if item is None:
        raise PlanError(f"the plan has no entry {index} (it has {len(plan)})")
    return item


def insert_switch(plan: list[Entry], index: int, new_protocol: Protocol | str) -> list[Entry]:
    """The plan after switching to ``new_protocol`` (a Protocol, or as a switch order spells one:
    "asp", "ssp:4") during segment ``index``."""
    check(plan)
    current = _require(plan, index)
    try:
        target = new_protocol if isinstance(new_protocol, Protocol) else parse_token(new_protocol, "switch")
    except ValueError as err:
        raise PlanError(str(err)) from None
    if target == protocol_of(current):
        raise PlanError(f"segment {index} already runs {target.token}; a switch goes to another protocol")
    switched: list[Entry] = []
    for item in plan:
        moved = copy.deepcopy(item)
        if item["index"] > index:
            moved["index"] = item["index"] + 1
        switched.append(moved)
        if item["index"] == index:
            switched.append(
                {
                    "index": index + 1,
                    **entry_fields(target),
                    "until_step": item["until_step"],
                    "origin": "online",
                }
            )
    check(switched)
    return switched


def truncate(plan: list[Entry], index: int, end_step: float) -> list[Entry]:
    """The plan after segment ``index`` stopped early at ``end_step`` (the step it reached)."""
    check(plan)
    current = _require(plan, index)
    previous = plan[index - 1]["until_step"] if index > 0 else 0
    if not previous <= end_step <= current["until_step"]:
        target = current["until_step"]
        raise PlanError(f"segment {index} cannot end at step {end_step}: it runs from {previous} to {target}")
    if index == len(plan) - 1 and end_step != current["until_step"]:
        raise PlanError(f"segment {index} is the last one: ending it at {end_step} would shrink the workload")
    truncated = copy.deepcopy(plan)
    # Whole steps stay ints in state.json; an ASP stop can fall between steps (1/N of a step each).
    truncated[index]["until_step"] = int(end_step) if float(end_step).is_integer() else end_step
    check(truncated)
    return truncated
