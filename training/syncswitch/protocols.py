"""The segment protocols: what each one is, how a job spells it, and what it needs of a cluster.

    protocol  spelled        what a step is
    bsp       1, bsp         every worker's gradient summed by one all-reduce, then one update
                             (MultiWorkerMirroredStrategy, RING collectives)
    cbsp      fp16,          BSP whose gradient all-reduce is compressed: cast to float16, or the
              topk:<ratio>   largest ``ratio`` of the elements (values and indices all-gathered) with
                             error feedback (what was not sent is added to the next step's gradient)
    local     local:<H>      local SGD: every worker steps its own replica on its own batch; every H
                             steps the replicas' weights, optimizer slots and batch-norm statistics are
                             averaged by one all-reduce
    asp       0, asp         every worker's update applied at the parameter servers as it comes
                             (ParameterServerStrategy + ClusterCoordinator)
    ssp       ssp:<s>        stale-synchronous: ASP whose workers keep per-worker clocks (steps done
                             in the segment, on the parameter servers): no worker starts step k+s+1
                             before every worker has finished step k (Ho et al., 2013); s=0 is
                             lockstep, a large s is ASP

A switch order (``JobSpec.switch_order``) names one protocol per segment: digits as the original's
flag ("10": BSP then ASP), or comma-separated names ("1,ssp:4,0", "bsp,local:8"), or a list of them
(a job file's ``[bsp, "ssp:4"]``). A plan entry and a SegmentSpec carry the protocol's name
(``protocol``: the segment's folder, its events, its DAG task) and its settings (``protocol_args``).

Topologies. The all-reduce protocols (bsp, cbsp, local) run N workers, worker 0 the chief; the
parameter-server protocols (asp, ssp) a coordinator (the chief), N workers and P parameter servers.
An update is the global batch in the first (one BSP-equivalent step), one worker's batch in the
second (1/N of a step), which is why the configuration policy divides the latter's learning rate by N.

Worker loss: ASP goes on with the survivors (its coordinator reschedules a lost worker's closures).
Every other protocol fails the segment, and its retry resumes from the last checkpoint: the
all-reduce protocols' collectives abort with any worker, and SSP's clocks would hold every survivor
within s steps of the lost one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from syncswitch.errors import SpecError

ALLREDUCE = "allreduce"
PARAMETER_SERVER = "parameter_server"
COMPRESSIONS = ("fp16", "topk")
MAX_STALENESS = 10_000
MAX_PERIOD = 100_000
# One accepted spelling per form, for error messages and the field's description.
SPELLINGS = "1 or bsp, 0 or asp, ssp:<s> (s >= 0), local:<H> (H >= 1), fp16, topk:<ratio> (0 < ratio <= 1)"
FIELD = "switch_order"


@dataclass(frozen=True)
class Family:
    """What one protocol is: its topology, whether an update is one worker's batch, and whether it
    outlives a lost worker."""

    name: str
    title: str
    topology: str
    per_worker_updates: bool
    survives_worker_loss: bool


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("bsp", "BSP", ALLREDUCE, per_worker_updates=False, survives_worker_loss=False),
        Family("asp", "ASP", PARAMETER_SERVER, per_worker_updates=True, survives_worker_loss=True),
        Family("ssp", "SSP", PARAMETER_SERVER, per_worker_updates=True, survives_worker_loss=False),
        Family("local", "local SGD", ALLREDUCE, per_worker_updates=False, survives_worker_loss=False),
        Family("cbsp", "compressed BSP", ALLREDUCE, per_worker_updates=False, survives_worker_loss=False),
    )
}
PROTOCOLS = tuple(FAMILIES)
DIGITS = {"1": "bsp", "0": "asp"}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"protocol {name!r} is not one of {', '.join(PROTOCOLS)}") from None


@dataclass(frozen=True)
class Protocol:
    """One segment's protocol and its settings; the defaults are those of the protocols without one."""

    name: str
    staleness: int = 0  # ssp: s
    period: int = 1  # local: H
    compression: str = ""  # cbsp: fp16 | topk
    ratio: float = 1.0  # cbsp topk: the share of the gradient's elements sent each step

    @property
    def family(self) -> Family:
        return family(self.name)

    @property
    def topology(self) -> str:
        return self.family.topology

    @property
    def token(self) -> str:
        """The protocol as a switch order spells it: 'bsp', 'ssp:4', 'local:8', 'fp16', 'topk:0.01'."""
        if self.name == "ssp":
            return f"ssp:{self.staleness}"
        if self.name == "local":
            return f"local:{self.period}"
        if self.name == "cbsp":
            return "fp16" if self.compression == "fp16" else f"topk:{self.ratio:.12g}"
        return self.name

    @property
    def label(self) -> str:
        """For people: 'SSP (s=4)', 'local SGD (H=8)', 'compressed BSP (top-k 1%)'."""
        detail = {
            "ssp": f" (s={self.staleness})",
            "local": f" (H={self.period})",
            "cbsp": " (FP16)" if self.compression == "fp16" else f" (top-k {self.ratio:.3g})",
        }.get(self.name, "")
        return self.family.title + detail

    def args(self) -> dict[str, Any]:
        """The settings of this protocol, as plan entries and SegmentSpecs carry them ({} for BSP, ASP)."""
        if self.name == "ssp":
            return {"staleness": self.staleness}
        if self.name == "local":
            return {"period": self.period}
        if self.name == "cbsp":
            return {"compression": self.compression, "ratio": self.ratio}
        return {}

    @classmethod
    def of(cls, name: str, args: dict[str, Any] | None = None) -> Protocol:
        """The protocol of a plan entry or SegmentSpec (its name and ``protocol_args``). ValueError
        for settings that no switch order spells."""
        family(name)
        try:
            protocol = cls(name, **(args or {}))
        except TypeError:
            raise ValueError(f"protocol {name}: unknown settings in {args!r}") from None
        if parse_token(protocol.token, "protocol") != protocol:
            raise ValueError(f"protocol {name}: settings {args!r} are not those of {protocol.token!r}")
        return protocol


def parse_token(text: Any, where: str, field: str = FIELD) -> Protocol:
    """One segment's protocol from its spelling; SpecError naming the ``field``, ``where`` in it, and
    the accepted spellings."""
    token = str(text).strip().lower()
    name, _, value = token.partition(":")
    name = DIGITS.get(name, name)

    def refuse(why: str) -> SpecError:
        return SpecError(field, f"{where} ({text!r}): {why}; accepted: {SPELLINGS}")

    if name in ("bsp", "asp", "fp16"):
        if value:
            raise refuse(f"{name} takes no setting")
        return Protocol("cbsp", compression="fp16", ratio=0.5) if name == "fp16" else Protocol(name)
    if name not in ("ssp", "local", "topk"):
        raise refuse("unknown protocol")
    if not value:
        raise refuse(f"{name} needs its setting after a colon")
    if name == "topk":
        ratio = _number(value)
        if ratio is None or not 0 < ratio <= 1:
            raise refuse("the ratio is the share of the gradient sent each step, in (0, 1]")
        return Protocol("cbsp", compression="topk", ratio=ratio)
    number = _number(value)
    low, high = (0, MAX_STALENESS) if name == "ssp" else (1, MAX_PERIOD)
    if number is None or not number.is_integer() or not low <= number <= high:
        setting = "the staleness bound s" if name == "ssp" else "the averaging period H"
        raise refuse(f"{setting} must be an integer in {low}..{high}")
    if name == "ssp":
        return Protocol("ssp", staleness=int(number))
    return Protocol("local", period=int(number))


def _number(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def parse_switch_order(value: Any) -> tuple[Protocol, ...]:
    """A switch order's protocols, one per segment: a string of digits ("10"), comma-separated
    spellings ("1,ssp:4,0"), or a list of spellings (also as JSON text). SpecError naming the
    segment and the accepted spellings."""
    tokens = switch_order_tokens(value)
    if not tokens:
        raise SpecError(
            FIELD, f"must name at least one segment's protocol, e.g. '10' or 'bsp,ssp:4'; {SPELLINGS}"
        )
    return tuple(parse_token(token, f"segment {i}") for i, token in enumerate(tokens))


def switch_order_tokens(value: Any) -> list[str]:
    """The per-segment spellings of a switch order, unchecked."""
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    text = str(value or "").strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise SpecError(FIELD, f"is not a valid JSON list: {exc}") from None
        return switch_order_tokens(items if isinstance(items, list) else [items])
    if "," in text:
        return [t.strip() for t in text.split(",")]
    if text and set(text) <= set(DIGITS):
        return list(text)
    return [text] if text else []


def switch_order_text(protocols: tuple[Protocol, ...] | list[Protocol]) -> str:
    """The canonical switch order: digits where every segment is BSP or ASP ("10", as before), else
    the spellings joined by commas ("bsp,ssp:4,asp")."""
    if all(p.name in ("bsp", "asp") for p in protocols):
        return "".join("1" if p.name == "bsp" else "0" for p in protocols)
    return ",".join(p.token for p in protocols)
