"""The offline timing policy: which BSP fraction the next run of a recurring job trains with. Pure logic.

Sync-Switch (ICDCS'21) trains BSP for a fraction of the workload, then ASP. For a recurring job the
offline timing policy searches, across runs, for the smallest BSP fraction that still reaches BSP's
accuracy, and later runs reuse it. :func:`decide` answers one run's question ("which fraction?") from
the job's history records (``syncswitch_airflow.history``) and the claims of runs still in flight;
:func:`search_state` is the same reasoning laid out for people (``syncswitch history``). Nothing here
reads or writes storage, and the clock is an argument (``now``), so the same inputs always give the
same decision.

Rules (k = ``TimingConfig.repeats``, tol = ``TimingConfig.tolerance``):

1. Evidence. Only records of the current configuration count: same ``fingerprint``, ``status``
   "success" and a ``final_accuracy``. Failed runs never count. A record's role comes from its
   ``bsp_fraction``: 1.0 is a BSP baseline run, anything else a run of that candidate fraction. Its
   ``policy_phase`` is never read, so histories imported from elsewhere work. A fraction that is not an
   item of the search (say 0.3 from a hand-made run) is shown but never used.
2. Order. Evidence is replayed in completion order (``finished_at``, ties by ``run_id``): the order in
   which results became known. A backfill runs logical dates out of order and several at once, so the
   logical date says nothing about what the policy knew when; completion order also makes every
   verdict final at the moment its k-th result arrives, whatever finishes later.
3. Baseline. Until there are k baseline runs, runs train BSP (fraction 1.0). The baseline's numbers
   are its first k runs (in completion order); extra baseline runs are kept but change nothing.
4. Search. Candidates are 0.5, 0.25, 0.125, ... down to ``floor``. The current candidate is the largest
   one without a verdict. A candidate's verdict comes from its first k runs, once the baseline is
   complete: accepted if their mean accuracy >= baseline mean - tol, else rejected. The search stops
   at the first rejection, or when every candidate down to the floor is accepted.
5. Refinement (``refine`` > 0). After the first rejection, bisect between the last accepted fraction
   (1.0 if none) and the rejected one, ``refine`` times: each midpoint gets k runs and the same
   acceptance rule; an accepted midpoint becomes the new upper end, a rejected one the new lower end.
   Midpoints lie strictly between two halving candidates, so they never share runs with one.
6. Exploit. Once the search has stopped, every run uses the smallest accepted fraction (1.0 when even
   0.5 was rejected).
7. Drift. Exploit runs are runs at the chosen fraction completed after the result that ended the
   search. When the mean of the latest k of them falls below the chosen fraction's accepted mean (the
   baseline mean when the choice is 1.0) by more than tol, a new generation starts: evidence up to and
   including that run is ignored and the search begins again with the baseline. Runs that complete
   after the drift point count in the new generation whatever they were started as, since they
   measured the job as it is now. ``numbers["generation"]`` counts generations from 1.
8. Configuration change. A new fingerprint has no evidence, so its search starts from the baseline;
   coming back to an old fingerprint resumes that fingerprint's history.
9. Overlapping runs. A run claims ``{run_id, fingerprint, bsp_fraction, phase, claimed_at}`` as it
   decides, before it trains. A claim of this fingerprint, younger than
   ``claim_ttl_seconds`` and without a record of its run id (either status) is *in flight*. The items
   that could still need evidence are, in search order: while the baseline is incomplete, the baseline
   and then every halving candidate; during the halving search, the current candidate and every smaller
   one; during refinement, only the current midpoint (the next midpoint depends on its verdict). The
   search order does not depend on results (only where it stops does), so a run takes the first item
   whose runs done plus in flight are fewer than k, speculatively if it is not the first item. If
   every such item is covered, the run repeats the first item (an extra repeat: harmless, only its
   first k runs count). Speculative results past a rejection stay in the history and are never
   accepted. With k=1, an empty history and three overlapping runs, the first decides BSP (1.0,
   baseline), the second 0.5 (baseline in flight) and the third 0.25 (1.0 and 0.5 in flight). The
   exploit phase ignores claims. Deciding and claiming are one atomic step
   (``history.claim_decision``), so runs deciding in the same instant still see each other.
10. The protocol after BSP (:func:`decide_among`, the job's ``timing_protocols``). Each candidate
   protocol (a switch order's spelling: asp, ssp:4, local:8, ...) has its own search, rules 1-9 on the
   records and claims of runs that trained it after BSP (a record's ``switch_order``; a claim's
   ``protocol``; a record without either trained ASP, the only protocol before the others), and the
   BSP baseline's runs, which count for every candidate. Candidates are searched in the order given:
   the first whose search is unfinished decides, unless every item it could use is covered by runs in
   flight (an extra repeat), when the next candidate's search is tried first. Once every search has
   finished, the run exploits the candidate whose chosen fraction's runs took the least total time
   (mean ``total_seconds``; ties go to the earlier candidate): the fastest way found to BSP's accuracy.

One module past the usual length, on purpose: the rules above and the code that applies them are
read side by side, and the replay, the generations and the decision's explanation share private
records (``_Item``, ``_Search``, ``_Generation``) that a split would have to export.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from syncswitch.protocols import parse_switch_order

BASELINE_FRACTION = 1.0
PHASES = ("baseline", "search", "exploit")
# Fractions are compared with this slack so that a history written by another tool (0.25 spelled
# 0.2500000001) still lines up with the search's exact binary fractions.
_SAME_FRACTION = 1e-9

Record = dict[str, Any]


@dataclass(frozen=True)
class TimingConfig:
    repeats: int = 3  # k: runs per candidate (and baseline runs)
    tolerance: float = 0.005  # accept while mean accuracy >= baseline mean - tolerance
    floor: float = 1 / 32  # smallest fraction searched
    refine: int = 0  # bisection steps after the first rejection (0 = off, as the paper's CIFAR-100 search)
    claim_ttl_seconds: float = 6 * 3600  # an older in-flight claim is ignored: its run died without a record

    def validate(self) -> None:
        """Raise ValueError("timing_<field>: ...") naming the field and the accepted values."""
        if not _is_int(self.repeats) or self.repeats < 1:
            raise ValueError(f"timing_repeats: must be an integer >= 1, got {self.repeats!r}")
        if not _is_number(self.tolerance) or self.tolerance < 0:
            raise ValueError(f"timing_tolerance: must be a number >= 0, got {self.tolerance!r}")
        if not _is_number(self.floor) or not 0 < self.floor <= 0.5:
            raise ValueError(f"timing_floor: must be a number in (0, 0.5], got {self.floor!r}")
        if not _is_int(self.refine) or self.refine < 0:
            raise ValueError(f"timing_refine: must be an integer >= 0, got {self.refine!r}")
        if not _is_number(self.claim_ttl_seconds) or self.claim_ttl_seconds <= 0:
            raise ValueError(
                f"timing_claim_ttl_seconds: must be a number of seconds > 0, got {self.claim_ttl_seconds!r}"
            )

    def halving_candidates(self) -> list[float]:
        """0.5, 0.25, ... down to the floor (exact binary fractions)."""
        candidates = []
        fraction = 0.5
        while fraction >= self.floor:
            candidates.append(fraction)
            fraction /= 2
        return candidates


@dataclass(frozen=True)
class TimingDecision:
    bsp_fraction: float
    phase: str  # "baseline" | "search" | "exploit"
    reason: str  # one human sentence with the numbers
    numbers: dict[str, Any]  # everything behind it
    protocol: str = "asp"  # what trains after BSP (a switch order's spelling; rule 10)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r} is not one of {PHASES}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- evidence -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    """One successful run of the current fingerprint; ``position`` is its place in completion order."""

    run_id: str
    fraction: float
    accuracy: float
    position: int


@dataclass(frozen=True)
class _Item:
    """One item of the search (the baseline, a halving candidate or a refinement midpoint) and its runs."""

    fraction: float
    kind: str  # "baseline" | "halving" | "refine"
    runs: tuple[_Run, ...]  # every run at this fraction in the generation, in completion order
    repeats: int

    @property
    def counted(self) -> tuple[_Run, ...]:
        """The runs the verdict is made from: the first k to complete."""
        return self.runs[: self.repeats]

    @property
    def complete(self) -> bool:
        return len(self.runs) >= self.repeats

    @property
    def mean(self) -> float | None:
        return statistics.mean(r.accuracy for r in self.counted) if self.counted else None

    @property
    def sd(self) -> float | None:
        """Sample standard deviation of the counted runs; None below two runs."""
        return statistics.stdev(r.accuracy for r in self.counted) if len(self.counted) >= 2 else None

    def summary(self, verdict: str) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "kind": self.kind,
            "n": len(self.counted),
            "mean": self.mean,
            "sd": self.sd,
            "runs": [r.run_id for r in self.counted],
            "extra_runs": [r.run_id for r in self.runs[self.repeats :]],
            "verdict": verdict,
        }


def _evidence(records: Iterable[Record], fingerprint: str) -> list[_Run]:
    usable = [
        r
        for r in records
        if r.get("fingerprint") == fingerprint
        and r.get("status") == "success"
        and _is_number(r.get("final_accuracy"))
        and _is_number(r.get("bsp_fraction"))
    ]
    usable.sort(key=completion_key)
    return [
        _Run(str(r["run_id"]), float(r["bsp_fraction"]), float(r["final_accuracy"]), position)
        for position, r in enumerate(usable)
    ]


def completion_key(record: Record) -> tuple[float, str]:
    """Sort key of completion order: ``finished_at`` (0 when absent), ties by ``run_id``."""
    finished_at = record.get("finished_at")
    return (float(finished_at) if _is_number(finished_at) else 0.0, str(record.get("run_id", "")))


def _same_fraction(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=0.0, abs_tol=_SAME_FRACTION)


# ---- one generation's search -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Search:
    """Where the search of one generation stands after replaying its evidence."""

    baseline: _Item
    threshold: float | None  # baseline mean - tolerance, once the baseline is complete
    path: tuple[_Item, ...]  # items with a verdict on the search path, in the order they were decided
    accepted: tuple[_Item, ...]
    rejected: tuple[_Item, ...]
    pending: _Item | None  # the item the search waits for (the baseline while it is incomplete)
    needing: tuple[_Item, ...]  # items that could still need evidence, in search order
    off_path: tuple[tuple[_Item, str], ...]  # halving candidates with runs that are not on the path

    @property
    def finished(self) -> bool:
        return self.pending is None

    @property
    def chosen(self) -> _Item:
        """The smallest accepted item, or the baseline when nothing was accepted."""
        return min(self.accepted, key=lambda item: item.fraction, default=self.baseline)

    @property
    def ending_run(self) -> _Run:
        """The result that ended the search (call only when finished)."""
        return max((item.counted[-1] for item in (self.baseline, *self.path)), key=lambda r: r.position)

    def verdict_of(self, item: _Item) -> str:
        if any(item is a for a in self.accepted):
            return "accepted"
        return "rejected" if any(item is r for r in self.rejected) else "pending"


class _SearchReplay:
    """Walks one generation's search path over its evidence: baseline, halving, then refinement."""

    def __init__(self, runs: list[_Run], config: TimingConfig) -> None:
        self.runs = runs
        self.config = config
        self.baseline = self.item(BASELINE_FRACTION, "baseline")
        self.threshold: float | None = None
        self.path: list[_Item] = []
        self.accepted: list[_Item] = []
        self.rejected: list[_Item] = []

    def item(self, fraction: float, kind: str) -> _Item:
        at_fraction = tuple(r for r in self.runs if _same_fraction(r.fraction, fraction))
        return _Item(fraction, kind, at_fraction, self.config.repeats)

    def judge(self, candidate: _Item) -> bool:
        """Record the verdict of a complete item; True when accepted."""
        assert self.threshold is not None and candidate.mean is not None
        accepted = candidate.mean >= self.threshold
        self.path.append(candidate)
        (self.accepted if accepted else self.rejected).append(candidate)
        return accepted

    def state(
        self, pending: _Item | None, needing: list[_Item], off_path: list[tuple[_Item, str]]
    ) -> _Search:
        return _Search(
            self.baseline,
            self.threshold,
            tuple(self.path),
            tuple(self.accepted),
            tuple(self.rejected),
            pending,
            tuple(needing),
            tuple(off_path),
        )

    def run(self) -> _Search:
        halving = [self.item(c, "halving") for c in self.config.halving_candidates()]
        if not self.baseline.complete:
            off_path = [(c, "speculative") for c in halving if c.runs]
            return self.state(self.baseline, [self.baseline, *halving], off_path)
        assert self.baseline.mean is not None
        self.threshold = self.baseline.mean - self.config.tolerance
        for index, candidate in enumerate(halving):
            later = halving[index + 1 :]
            if not candidate.complete:
                return self.state(
                    candidate, [candidate, *later], [(c, "speculative") for c in later if c.runs]
                )
            if not self.judge(candidate):
                return self.refine(candidate, [(c, "past the rejection") for c in later if c.runs])
        return self.state(None, [], [])

    def refine(self, first_rejected: _Item, past: list[tuple[_Item, str]]) -> _Search:
        """Bisect between the last accepted fraction (1.0 if none) and the first rejected one."""
        upper = self.accepted[-1].fraction if self.accepted else BASELINE_FRACTION
        lower = first_rejected.fraction
        for _ in range(self.config.refine):
            midpoint = self.item((upper + lower) / 2, "refine")
            if not midpoint.complete:
                # The next midpoint depends on this one's verdict: nothing to speculate on.
                return self.state(midpoint, [midpoint], past)
            if self.judge(midpoint):
                upper = midpoint.fraction
            else:
                lower = midpoint.fraction
        return self.state(None, [], past)


def _search(runs: list[_Run], config: TimingConfig) -> _Search:
    return _SearchReplay(runs, config).run()


# ---- generations ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Generation:
    number: int
    runs: tuple[_Run, ...]
    search: _Search
    exploit_runs: tuple[_Run, ...]  # runs at the chosen fraction after the search ended
    drift: dict[str, Any] | None  # what ended this generation, if drift did


def _generations(evidence: list[_Run], config: TimingConfig) -> list[_Generation]:
    generations: list[_Generation] = []
    start = 0
    while True:
        runs = evidence[start:]
        search = _search(runs, config)
        exploit = _exploit_runs(runs, search)
        drift = _find_drift(exploit, search, config)
        if drift is None:
            generations.append(_Generation(len(generations) + 1, tuple(runs), search, exploit, None))
            return generations
        # Lay out the ended generation from its own runs only, so later runs do not show up in it.
        end = drift["position"] + 1
        runs = evidence[start:end]
        search = _search(runs, config)
        exploit = _exploit_runs(runs, search)
        generations.append(_Generation(len(generations) + 1, tuple(runs), search, exploit, drift))
        start = end


def _exploit_runs(runs: list[_Run], search: _Search) -> tuple[_Run, ...]:
    if not search.finished:
        return ()
    chosen, ended_at = search.chosen.fraction, search.ending_run.position
    return tuple(r for r in runs if r.position > ended_at and _same_fraction(r.fraction, chosen))


def _find_drift(exploit: tuple[_Run, ...], search: _Search, config: TimingConfig) -> dict[str, Any] | None:
    """The first exploit run at which the latest k exploit runs fell below the accepted mean - tol."""
    if not search.finished:
        return None
    accepted_mean = search.chosen.mean
    k = config.repeats
    for end in range(k, len(exploit) + 1):
        window = exploit[end - k : end]
        recent_mean = statistics.mean(r.accuracy for r in window)
        if recent_mean < accepted_mean - config.tolerance:
            return {
                "run_id": window[-1].run_id,
                "position": window[-1].position,
                "fraction": search.chosen.fraction,
                "recent_runs": [r.run_id for r in window],
                "recent_mean": recent_mean,
                "accepted_mean": accepted_mean,
            }
    return None


# ---- claims ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Claims:
    in_flight: tuple[Record, ...]
    expired: tuple[Record, ...]

    def count_at(self, fraction: float) -> int:
        return sum(1 for c in self.in_flight if _same_fraction(float(c["bsp_fraction"]), fraction))


def _sort_claims(
    claims: Iterable[Record], records: Iterable[Record], fingerprint: str, config: TimingConfig, now: float
) -> _Claims:
    finished = {str(r.get("run_id")) for r in records}
    in_flight, expired = [], []
    for claim in claims:
        if claim.get("fingerprint") != fingerprint or str(claim.get("run_id")) in finished:
            continue
        if not _is_number(claim.get("bsp_fraction")):
            continue
        age = now - float(claim.get("claimed_at") or 0.0)
        (expired if age > config.claim_ttl_seconds else in_flight).append(claim)
    in_flight.sort(key=lambda c: (float(c.get("claimed_at") or 0.0), str(c.get("run_id"))))
    return _Claims(tuple(in_flight), tuple(expired))


# ---- the decision -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Analysis:
    fingerprint: str
    config: TimingConfig
    generations: list[_Generation]
    claims: _Claims

    @property
    def current(self) -> _Generation:
        return self.generations[-1]


def _analyse(
    records: list[Record], claims: list[Record], fingerprint: str, config: TimingConfig, now: float
) -> _Analysis:
    config.validate()
    generations = _generations(_evidence(records, fingerprint), config)
    return _Analysis(
        fingerprint, config, generations, _sort_claims(claims, records, fingerprint, config, now)
    )


def decide(
    records: list[Record], claims: list[Record], fingerprint: str, config: TimingConfig, now: float
) -> TimingDecision:
    """The BSP fraction of the next run of this fingerprint, with the reason and the numbers behind it.

    ``records``: the job's history records (any fingerprint, any status); ``claims``: the job's claims;
    ``now``: epoch seconds, to expire claims. Raises ValueError if ``config`` is invalid.
    """
    return _decision(_analyse(records, claims, fingerprint, config, now))


def _decision(analysis: _Analysis) -> TimingDecision:
    if analysis.current.search.finished:
        return _exploit_decision(analysis)
    return _search_decision(analysis)


def _exploit_decision(analysis: _Analysis) -> TimingDecision:
    generation, config = analysis.current, analysis.config
    search = generation.search
    chosen = search.chosen
    recent = generation.exploit_runs[-config.repeats :]
    numbers = {
        **_common_numbers(analysis),
        "chosen_fraction": chosen.fraction,
        "chosen_mean": chosen.mean,
        "chosen_runs": [r.run_id for r in chosen.counted],
        "exploit_runs": len(generation.exploit_runs),
        "exploit_recent_mean": statistics.mean(r.accuracy for r in recent) if recent else None,
    }
    if search.accepted:
        why = (
            f"smallest accepted fraction {_f(chosen.fraction)} (mean {_acc(chosen.mean)} >= "
            f"{_acc(search.threshold)} = baseline {_acc(search.baseline.mean)} - {config.tolerance:g})"
        )
    else:
        why = (
            f"even 0.5 was rejected (mean {_acc(search.rejected[0].mean)} < {_acc(search.threshold)} = "
            f"baseline {_acc(search.baseline.mean)} - {config.tolerance:g}), so BSP all the way"
        )
    stop = _stop_phrase(search, config)
    reason = f"Search of generation {generation.number} finished ({stop}): {why}."
    return TimingDecision(chosen.fraction, "exploit", reason, numbers)


def _stop_phrase(search: _Search, config: TimingConfig) -> str:
    if not search.rejected:
        return f"every candidate down to the floor {_f(config.floor)} accepted"
    rejected = ", ".join(f"{_f(r.fraction)} ({_acc(r.mean)})" for r in search.rejected)
    return f"rejected {rejected}"


def _search_decision(analysis: _Analysis) -> TimingDecision:
    generation, config, claims = analysis.current, analysis.config, analysis.claims
    search = generation.search
    needing = search.needing
    item = next(
        (i for i in needing if len(i.runs) + claims.count_at(i.fraction) < config.repeats),
        None,
    )
    extra_repeat = item is None
    if item is None:
        item = needing[0]
    speculative = item is not needing[0]
    done, in_flight = len(item.runs), claims.count_at(item.fraction)
    phase = "baseline" if item.kind == "baseline" else "search"
    numbers = {
        **_common_numbers(analysis),
        "candidate": item.fraction,
        "candidate_kind": item.kind,
        "candidate_runs_done": done,
        "candidate_in_flight": in_flight,
        "waiting_for": needing[0].fraction,
        "speculative": speculative,
        "extra_repeat": extra_repeat,
    }
    reason = _search_reason(search, config, item, needing[0], done, in_flight, speculative, extra_repeat)
    return TimingDecision(item.fraction, phase, reason, numbers)


def _search_reason(
    search: _Search,
    config: TimingConfig,
    item: _Item,
    first: _Item,
    done: int,
    in_flight: int,
    speculative: bool,
    extra_repeat: bool,
) -> str:
    k = config.repeats
    progress = f"{done} of {k} runs done, {in_flight} in flight"
    if extra_repeat:
        return (
            f"Every item that could need evidence is covered by runs done or in flight; repeating "
            f"{_name(first)} ({progress}) as an extra run, harmless: only its first {k} runs count."
        )
    if speculative:
        return (
            f"{_sentence_start(_name(first))} is covered by runs done or in flight; speculatively running "
            f"{_name(item)} ({progress}), since the search order does not depend on results."
        )
    if item.kind == "baseline":
        mean = f", mean {_acc(item.mean)}" if item.mean is not None else ""
        return f"BSP baseline: {progress}{mean}; the search starts after {k} baseline runs."
    so_far = f", mean so far {_acc(item.mean)}" if item.mean is not None else ""
    accepted = ", ".join(f"{_f(a.fraction)} ({_acc(a.mean)})" for a in search.accepted) or "none yet"
    return (
        f"Searching {_name(item)} ({progress}{so_far}): accepted if the mean of {k} runs >= "
        f"{_acc(search.threshold)} = baseline {_acc(search.baseline.mean)} - {config.tolerance:g}; "
        f"accepted so far: {accepted}."
    )


def _name(item: _Item) -> str:
    if item.kind == "baseline":
        return "the BSP baseline (1.0)"
    return f"{'midpoint' if item.kind == 'refine' else 'candidate'} {_f(item.fraction)}"


def _sentence_start(text: str) -> str:
    return text[:1].upper() + text[1:]


def _common_numbers(analysis: _Analysis) -> dict[str, Any]:
    generation, config = analysis.current, analysis.config
    search = generation.search
    baseline = search.baseline
    return {
        "fingerprint": analysis.fingerprint,
        "generation": generation.number,
        "config": asdict(config),
        "evidence_runs": len(generation.runs),
        "ignored_runs": sum(len(g.runs) for g in analysis.generations[:-1]),
        "baseline": {
            "n": len(baseline.counted),
            "mean": baseline.mean,
            "sd": baseline.sd,
            "runs": [r.run_id for r in baseline.counted],
        },
        "threshold": search.threshold,
        "accepted": [_brief(i) for i in search.accepted],
        "rejected": [_brief(i) for i in search.rejected],
        "in_flight": [_claim_brief(c) for c in analysis.claims.in_flight],
        "expired_claims": [str(c.get("run_id")) for c in analysis.claims.expired],
        "drifts": [_drift_brief(g) for g in analysis.generations if g.drift],
    }


def _brief(item: _Item) -> dict[str, Any]:
    return {"fraction": item.fraction, "kind": item.kind, "n": len(item.counted), "mean": item.mean}


def _claim_brief(claim: Record) -> dict[str, Any]:
    return {
        "run_id": claim.get("run_id"),
        "bsp_fraction": claim.get("bsp_fraction"),
        "claimed_at": claim.get("claimed_at"),
    }


def _drift_brief(generation: _Generation) -> dict[str, Any]:
    drift = dict(generation.drift or {})
    drift.pop("position", None)
    return {"generation": generation.number, **drift}


# ---- the state machine's view ------------------------------------------------------------------------


def search_state(
    records: list[Record], claims: list[Record], fingerprint: str, config: TimingConfig, now: float
) -> dict[str, Any]:
    """Every generation of this fingerprint's search, and the next decision, as plain JSON-able data.

    Per generation: its runs, the baseline's stats, each searched item's stats and verdict ("accepted",
    "rejected", "pending", "speculative", "past the rejection"), whether the search finished, the chosen
    fraction, the exploit runs and the drift that ended it (if any).
    """
    analysis = _analyse(records, claims, fingerprint, config, now)
    return {
        "fingerprint": fingerprint,
        "config": asdict(config),
        "generation": analysis.current.number,
        "generations": [_generation_view(g, config) for g in analysis.generations],
        "decision": _decision(analysis).to_dict(),
    }


def _generation_view(generation: _Generation, config: TimingConfig) -> dict[str, Any]:
    search = generation.search
    baseline_verdict = "complete" if search.baseline.complete else "pending"
    items = [item.summary(search.verdict_of(item)) for item in search.path]
    if search.pending is not None and search.pending.kind != "baseline":
        items.append(search.pending.summary("pending"))
    items.extend(item.summary(label) for item, label in search.off_path)
    recent = generation.exploit_runs[-config.repeats :]
    view: dict[str, Any] = {
        "generation": generation.number,
        "runs": [r.run_id for r in generation.runs],
        "baseline": search.baseline.summary(baseline_verdict),
        "threshold": search.threshold,
        "items": items,
        "finished": search.finished,
        "chosen_fraction": search.chosen.fraction if search.finished else None,
        "chosen_mean": search.chosen.mean if search.finished else None,
        "search_ended_by": search.ending_run.run_id if search.finished else None,
        "exploit": {
            "runs": [r.run_id for r in generation.exploit_runs],
            "recent_mean": statistics.mean(r.accuracy for r in recent) if recent else None,
        },
        "drift": _drift_brief(generation) if generation.drift else None,
    }
    return view


# ---- small helpers -----------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _f(fraction: float) -> str:
    return f"{fraction:g}"


def _acc(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


# ---- the protocol after BSP (rule 10) ----------------------------------------------------------------


def second_protocol(entry: Record) -> str | None:
    """The protocol a record's or claim's run trained after BSP, as a switch order spells it; None for
    a BSP baseline run; "asp" where it does not say (it was written before the other protocols)."""
    fraction = entry.get("bsp_fraction")
    if _is_number(fraction) and _same_fraction(float(fraction), BASELINE_FRACTION):
        return None
    if entry.get("protocol"):
        return str(entry["protocol"])
    order = entry.get("switch_order")
    if not order:
        return "asp"
    after = [p for p in parse_switch_order(order) if p.name != "bsp"]
    return after[-1].token if after else None


def _of_protocol(entries: Iterable[Record], protocol: str) -> list[Record]:
    """The records or claims of ``protocol``'s search: its own runs and the baseline's."""
    return [e for e in entries if second_protocol(e) in (None, protocol)]


def decide_among(
    records: list[Record],
    claims: list[Record],
    fingerprint: str,
    config: TimingConfig,
    now: float,
    protocols: Sequence[str] = ("asp",),
) -> TimingDecision:
    """The BSP fraction and the protocol after it of the next run (rule 10): ``decide`` for each
    candidate protocol on its own runs and the baseline's, then the fastest finished choice."""
    analyses = {
        p: _analyse(_of_protocol(records, p), _of_protocol(claims, p), fingerprint, config, now)
        for p in protocols
    }
    repeat: TimingDecision | None = None
    for protocol, analysis in analyses.items():
        if analysis.current.search.finished:
            continue
        decision = replace(_search_decision(analysis), protocol=protocol)
        if not decision.numbers["extra_repeat"]:
            return _among(decision, protocols)
        repeat = repeat or decision
    if repeat is not None:
        return _among(repeat, protocols)
    return _fastest(records, {p: _exploit_decision(a) for p, a in analyses.items()}, protocols)


def _among(decision: TimingDecision, protocols: Sequence[str]) -> TimingDecision:
    if len(protocols) == 1:
        return decision
    reason = f"Protocol after BSP {decision.protocol} (of {', '.join(protocols)}): {decision.reason}"
    return replace(decision, reason=reason, numbers={**decision.numbers, "protocols": list(protocols)})


def _fastest(
    records: list[Record], choices: dict[str, TimingDecision], protocols: Sequence[str]
) -> TimingDecision:
    """Every search finished: the candidate whose chosen fraction's counted runs took least time."""
    seconds = {str(r["run_id"]): r.get("total_seconds") for r in records}
    summary = {}
    for protocol, decision in choices.items():
        runs = decision.numbers.get("chosen_runs") or []
        times = [float(seconds[run]) for run in runs if _is_number(seconds.get(run))]
        summary[protocol] = {
            "fraction": decision.bsp_fraction,
            "mean_accuracy": decision.numbers["chosen_mean"],
            "mean_seconds": statistics.mean(times) if times else None,
        }
    best = min(
        protocols,
        key=lambda p: (
            math.inf if summary[p]["mean_seconds"] is None else summary[p]["mean_seconds"],
            protocols.index(p),
        ),
    )
    decision = replace(choices[best], protocol=best)
    if len(protocols) == 1:
        return decision
    times = ", ".join(
        f"{p} at {_f(s['fraction'])} ({_seconds(s['mean_seconds'])})" for p, s in summary.items()
    )
    reason = f"Every protocol's search finished; the fastest choice is {best}: {times}. {decision.reason}"
    return replace(decision, reason=reason, numbers={**decision.numbers, "protocols": summary})
