"""Compute Engine prices, the checks a ``gce`` VM spec must pass, and the cost ledger of a run.

    Catalog.load(path=None)           the price & catalog file (default: gce_prices.json beside this module)
    Catalog.check_vm(field, ...)      SpecError naming ``field`` for a VM that Compute Engine would refuse
    Catalog.check_offered(field, ...) SpecError for a GPU type Compute Engine has retired (still priced,
                                      for runs recorded before)
    Catalog.hourly(...)               $/h of one VM: its machine type plus its attached GPUs, spot or not
    ledger(vms, segments, catalog)    what the run's VMs cost, per VM, per segment, per protocol

Why a file and not an API call: the runtime must price a run without credentials or network (and
without Airflow), and a report must say which prices it used (``as_of``, ``source``). The checks run
before any VM is created, so a zone that lacks the GPU, or a GPU on a machine type that cannot take
one, is a message naming the field instead of a half-built cluster.

Cost model (as in the transient-server paper): cost = sum over VMs of hourly price x active seconds.
Prices are exact decimals from the file and times are exact binary floats, so every sum is computed
with Fractions and rounded only at output: ``total`` is exactly ``per_segment`` + ``unattributed``
before rounding (after rounding they may differ by a few 1e-4).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

from syncswitch.errors import SpecError
from syncswitch.plan import PROTOCOLS

DEFAULT_PRICES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gce_prices.json")
ROLES = ("chief", "worker", "ps")
NO_GPU = ("", "none")
DIGITS = 4  # costs and prices in the ledger's output
_SECONDS_PER_HOUR = 3600
# region, a dash, the zone letter: us-central1-a, europe-west4-b, northamerica-northeast1-c
_ZONE_RE = re.compile(r"^([a-z]+(?:-[a-z]+)+[0-9]+)-([a-z])$")


@dataclass(frozen=True)
class Price:
    """$/h of one machine or one GPU, exact (the file's decimals as Fractions)."""

    on_demand: Fraction
    spot: Fraction

    def rate(self, spot: bool) -> Fraction:
        return self.spot if spot else self.on_demand


@dataclass(frozen=True)
class BuiltinGpu:
    """The accelerator a machine type comes with (a2, g2): priced in the machine, no extra GPUs."""

    gpu_type: str
    gpu_count: int


@dataclass(frozen=True)
class Catalog:
    """The price & catalog file, parsed and checked once. Regions map to priced machine types and the
    GPU types offered there; a GPU type is canonical (``nvidia-tesla-k80``), aliases (``k80``) resolve
    to it."""

    path: str
    currency: str
    as_of: str
    source: str
    machines: dict[str, dict[str, Price]]  # region -> machine type -> price
    gpus: dict[str, dict[str, Price]]  # region -> canonical GPU type -> price of one GPU
    gpu_aliases: dict[str, str]
    gpu_machine_families: dict[str, tuple[str, ...]]  # GPU type -> machine families it attaches to
    max_gpus_per_vm: dict[str, int]
    builtin_gpu_machines: dict[str, BuiltinGpu]
    retired_gpus: dict[str, str]  # GPU type -> the date Compute Engine stopped offering it

    @classmethod
    def load(cls, path: str | None = None) -> Catalog:
        """Read and check the file; ValueError (naming the file) when it is malformed, so a refreshed
        price list with a typo fails at load rather than as a wrong bill."""
        path = path or DEFAULT_PRICES_PATH
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f, parse_float=Decimal)
            except ValueError as exc:
                raise ValueError(f"{path}: not valid JSON: {exc}") from None
        try:
            return cls._parse(path, data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: malformed price file ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _parse(cls, path: str, data: dict[str, Any]) -> Catalog:
        def fail(message: str) -> ValueError:
            return ValueError(f"{path}: {message}")

        if data["unit"] != "hour":
            raise fail(f"unit must be 'hour', got {data['unit']!r}")
        max_gpus = {str(k): int(v) for k, v in data["max_gpus_per_vm"].items()}
        families = {str(k): tuple(str(f) for f in v) for k, v in data["gpu_machine_families"].items()}
        if set(max_gpus) != set(families):
            raise fail("max_gpus_per_vm and gpu_machine_families must list the same GPU types")
        if any(n < 1 for n in max_gpus.values()):
            raise fail("max_gpus_per_vm values must be >= 1")
        aliases = {str(k).lower(): str(v) for k, v in data["gpu_aliases"].items()}
        for alias, canonical in aliases.items():
            if canonical not in max_gpus:
                raise fail(f"gpu_aliases: {alias!r} -> {canonical!r}, which max_gpus_per_vm does not list")
        builtin = {
            str(k): BuiltinGpu(str(v["gpu_type"]), int(v["gpu_count"]))
            for k, v in data["builtin_gpu_machines"].items()
        }
        retired = {str(k): str(v) for k, v in data.get("retired_gpus", {}).items()}
        unknown_retired = sorted(set(retired) - set(max_gpus))
        if unknown_retired:
            raise fail(f"retired_gpus: {unknown_retired[0]!r} is not in max_gpus_per_vm")
        try:
            datetime.date.fromisoformat(str(data["as_of"]))
        except ValueError:
            raise fail(f"as_of must be a date, YYYY-MM-DD, got {data['as_of']!r}") from None
        machines: dict[str, dict[str, Price]] = {}
        gpus: dict[str, dict[str, Price]] = {}
        if not data["regions"]:
            raise fail("regions is empty")
        for region, entry in data["regions"].items():
            machines[region] = {m: _price(fail, f"{region} {m}", p) for m, p in entry["machines"].items()}
            gpus[region] = {g: _price(fail, f"{region} {g}", p) for g, p in entry.get("gpus", {}).items()}
            unknown = sorted(set(gpus[region]) - set(max_gpus))
            if unknown:
                raise fail(f"{region}: GPU type {unknown[0]!r} is not in max_gpus_per_vm")
        return cls(
            path=path,
            currency=str(data["currency"]),
            as_of=str(data["as_of"]),
            source=str(data["source"]),
            machines=machines,
            gpus=gpus,
            gpu_aliases=aliases,
            gpu_machine_families=families,
            max_gpus_per_vm=max_gpus,
            builtin_gpu_machines=builtin,
            retired_gpus=retired,
        )

    # ---- lookups and checks -------------------------------------------------------------------

    def region(self, zone: str, field: str = "zone") -> str:
        """``us-central1-a`` -> ``us-central1``; SpecError for text that is not a zone name."""
        match = _ZONE_RE.match(zone.strip()) if isinstance(zone, str) else None
        if not match:
            raise SpecError(
                field,
                f"zone {zone!r} is not a Compute Engine zone; expected region-letter, e.g. us-central1-a",
            )
        return match.group(1)

    def accepted_gpu_names(self) -> str:
        """The GPU names users may write, for messages: the aliases, then the canonical names (retired
        types left out)."""
        canonical = sorted(g for g in self.max_gpus_per_vm if g not in self.retired_gpus)
        short = [a for a, g in self.gpu_aliases.items() if a not in canonical and g not in self.retired_gpus]
        return ", ".join(short + canonical + ["none"])

    def age_days(self, today: datetime.date | None = None) -> int:
        """How many days before ``today`` (default: today) the table's prices and offers were read."""
        return ((today or datetime.date.today()) - datetime.date.fromisoformat(self.as_of)).days

    def current_gpu_types(self) -> str:
        """The GPU types a new VM may have, for messages: the attachable ones by their short names and
        the machine families they attach to, then those that come built into a machine type."""
        short = {canonical: alias for alias, canonical in reversed(self.gpu_aliases.items())}
        attachable = [g for g in self.max_gpus_per_vm if g not in self.retired_gpus]
        families = sorted({f for g in attachable for f in self.gpu_machine_families[g]})
        builtin = [
            f"{gpu.gpu_type.rsplit('-', 1)[-1]} (machine type {machine}, with gpus none)"
            for machine, gpu in sorted(self.builtin_gpu_machines.items())
        ]
        named = ", ".join(short.get(g, g) for g in attachable)
        return "; ".join([f"{named} (on {' or '.join(families)} machine types)", *builtin])

    def check_offered(self, field: str, name: str, today: datetime.date | None = None) -> None:
        """SpecError naming ``field`` for a GPU type Compute Engine has retired: a new VM cannot have one
        (the table keeps its prices for runs recorded before). Says how old the table is, since
        Compute Engine may have retired others since."""
        gpu = self.gpu_type(field, name)
        if gpu not in self.retired_gpus:
            return
        raise SpecError(
            field,
            f"{name!r} is retired on Compute Engine since {self.retired_gpus[gpu]} (price table of "
            f"{self.as_of}, {self.age_days(today)} days old); current types: {self.current_gpu_types()}",
        )

    def gpu_type(self, field: str, name: str) -> str:
        """The canonical accelerator type for an alias or canonical name; "" for no GPU ("" or none)."""
        text = str(name or "").strip().lower()
        if text in NO_GPU:
            return ""
        if text in self.gpu_aliases:
            return self.gpu_aliases[text]
        if text in self.max_gpus_per_vm:
            return text
        for machine, gpu in sorted(self.builtin_gpu_machines.items()):
            if text in (gpu.gpu_type, gpu.gpu_type.rsplit("-", 1)[-1]):
                raise SpecError(
                    field,
                    f"GPU type {name!r} cannot be attached: it comes built into {machine}; choose machine "
                    f"type {machine} with no GPU type. Attachable GPU types: {self.accepted_gpu_names()}",
                )
        raise SpecError(field, f"unknown GPU type {name!r}; accepted: {self.accepted_gpu_names()}")

    def gpu_counts(self, gpu_type: str) -> tuple[int, ...]:
        """How many of a GPU type one VM may have: Compute Engine attaches 1, 2, 4 or 8, up to the
        type's maximum (3 or 5 are refused by the API, so they are refused here)."""
        top = self.max_gpus_per_vm[gpu_type]
        return tuple(n for n in (1, 2, 4, 8, 16) if n <= top)

    def check_vm(
        self, field: str, machine_type: str, zone: str, gpu_type: str = "", gpu_count: int = 0
    ) -> None:
        """SpecError naming ``field`` for a VM that Compute Engine would refuse or this file cannot price."""
        region = self.region(zone, field)
        if region not in self.machines:
            raise SpecError(
                field,
                f"zone {zone!r} is in region {region!r}, which the price table (as of {self.as_of}) does not "
                f"cover; covered regions: {', '.join(sorted(self.machines))}",
            )
        priced = self.machines[region]
        if machine_type not in priced:
            elsewhere = [r for r in sorted(self.machines) if machine_type in self.machines[r]]
            hint = f" (it is priced in: {', '.join(elsewhere)})" if elsewhere else ""
            raise SpecError(
                field,
                f"machine type {machine_type!r} is not priced in {region}{hint}; accepted in {region}: "
                f"{', '.join(sorted(priced))}",
            )
        gpu = self.gpu_type(field, gpu_type)
        if isinstance(gpu_count, bool) or not isinstance(gpu_count, int):
            raise SpecError(field, f"gpu_count must be an integer, got {gpu_count!r}")
        if not gpu:
            if gpu_count != 0:
                raise SpecError(
                    field, f"gpu_count {gpu_count} needs a GPU type; accepted: {self.accepted_gpu_names()}"
                )
            return
        builtin = self.builtin_gpu_machines.get(machine_type)
        if builtin:
            raise SpecError(
                field,
                f"{machine_type} has a built-in {builtin.gpu_count} x {builtin.gpu_type} and takes no extra "
                f"accelerators; leave the GPU type empty, or put {gpu} on an n1 machine type",
            )
        _check_family(field, machine_type, gpu, self.gpu_machine_families)
        if gpu not in self.gpus[region]:
            offering = [r for r in sorted(self.gpus) if gpu in self.gpus[r]]
            raise SpecError(
                field,
                f"{gpu} is not offered in {region} (zone {zone}); regions that offer it: "
                f"{', '.join(offering) or 'none in the price table'}",
            )
        counts = self.gpu_counts(gpu)
        if gpu_count not in counts:
            raise SpecError(
                field,
                f"gpu_count {gpu_count} of {gpu} is not possible; accepted: {', '.join(map(str, counts))} "
                f"(at most {self.max_gpus_per_vm[gpu]} per VM)",
            )

    def hourly_exact(
        self, zone: str, machine_type: str, gpu_type: str, gpu_count: int, spot: bool, field: str = "vm"
    ) -> Fraction:
        """$/h of one VM as an exact Fraction (checked first, so an unpriceable VM is a SpecError)."""
        self.check_vm(field, machine_type, zone, gpu_type, gpu_count)
        region = self.region(zone, field)
        rate = self.machines[region][machine_type].rate(spot)
        gpu = self.gpu_type(field, gpu_type)
        if gpu:
            rate += gpu_count * self.gpus[region][gpu].rate(spot)
        return rate

    def hourly(self, zone: str, machine_type: str, gpu_type: str, gpu_count: int, spot: bool) -> float:
        """$/h of one VM: the machine type's price plus ``gpu_count`` x the GPU's, both spot or on-demand."""
        return float(self.hourly_exact(zone, machine_type, gpu_type, gpu_count, spot))


def _price(fail: Any, where: str, value: Any) -> Price:
    on_demand, spot = _exact(value["on_demand"]), _exact(value["spot"])
    if on_demand < 0 or spot < 0:
        raise fail(f"{where}: prices must be >= 0")
    if spot > on_demand:
        raise fail(f"{where}: spot {float(spot)} is above on_demand {float(on_demand)}")
    return Price(on_demand, spot)


def _exact(value: Any) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise TypeError(f"price {value!r} is not a number")
    return Fraction(value)


def _family(machine_type: str) -> str:
    return machine_type.split("-", 1)[0]


def _check_family(field: str, machine_type: str, gpu: str, families: dict[str, tuple[str, ...]]) -> None:
    """GPUs attach to some machine families only (n1 for K80..P4); say which, for this GPU or any GPU."""
    family = _family(machine_type)
    if family in families[gpu]:
        return
    if not any(family in fams for fams in families.values()):
        every = sorted({f for fams in families.values() for f in fams})
        raise SpecError(
            field, f"{machine_type} cannot take GPUs; GPUs attach to {' or '.join(every)} machine types"
        )
    raise SpecError(
        field,
        f"{machine_type} cannot take {gpu}; {gpu} attaches to {' or '.join(families[gpu])} machine types",
    )


# ---- the ledger ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Window:
    """A segment's window as charged: clipped so that no second belongs to two segments."""

    index: int
    protocol: str
    start: Fraction
    end: Fraction


def _time(record: dict[str, Any], key: str, where: str, default: Fraction | None = None) -> Fraction:
    value = record.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{where}: {key} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key} must be epoch seconds, got {value!r}")
    return Fraction(value)


def _windows(segments: list[dict[str, Any]], now: Fraction) -> list[_Window]:
    """Segments in start order; one that starts before the previous one ended is counted from that end
    (records from different clocks can overlap by a moment), so a VM second is charged to one segment."""
    parsed = []
    for position, seg in enumerate(segments):
        where = f"segment {seg.get('index', position)}"
        protocol = seg.get("protocol")
        if protocol not in PROTOCOLS:
            raise ValueError(f"{where}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        start = _time(seg, "started_at", where)
        end = _time(seg, "ended_at", where, default=max(now, start))
        if end < start:
            raise ValueError(f"{where}: ended_at is before started_at")
        parsed.append((start, position, int(seg.get("index", position)), protocol, end))
    windows: list[_Window] = []
    previous_end: Fraction | None = None
    for start, _, index, protocol, end in sorted(parsed):
        if previous_end is not None:
            start = max(start, previous_end)
            end = max(end, start)
        windows.append(_Window(index, protocol, start, end))
        previous_end = end
    return windows


def _overlap(a_start: Fraction, a_end: Fraction, b_start: Fraction, b_end: Fraction) -> Fraction:
    return max(Fraction(0), min(a_end, b_end) - max(a_start, b_start))


def _out(value: Fraction) -> float:
    return float(round(value, DIGITS))


@dataclass(frozen=True)
class _VmSpan:
    """One VM record, checked: its name and the time it was up."""

    record: dict[str, Any]
    name: str
    start: Fraction
    end: Fraction

    @property
    def where(self) -> str:
        return f"vm {self.name}"


def _vm_span(vm: dict[str, Any], position: int, now: Fraction) -> _VmSpan:
    """``vm`` checked (ValueError names the VM and the field); a running VM is charged up to ``now``."""
    name = str(vm.get("name") or f"vm {position}")
    where = f"vm {name}"
    role = vm.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(vm.get("spot"), bool):
        raise ValueError(f"{where}: spot must be true or false, got {vm.get('spot')!r}")
    for key in ("zone", "machine_type"):
        if not vm.get(key):
            raise ValueError(f"{where}: {key} is missing")
    start = _time(vm, "started_at", where)
    end = _time(vm, "ended_at", where, default=max(now, start))
    if end < start:
        raise ValueError(f"{where}: ended_at is before started_at")
    return _VmSpan(vm, name, start, end)


def _hourly_rates(span: _VmSpan, catalog: Catalog) -> tuple[Fraction, Fraction]:
    """The VM's hourly rate as it ran (spot or not), and on-demand."""
    vm = span.record
    price = (vm["zone"], vm["machine_type"], str(vm.get("gpu_type") or ""), vm.get("gpu_count") or 0)
    return (
        catalog.hourly_exact(*price, spot=vm["spot"], field=span.where),
        catalog.hourly_exact(*price, spot=False, field=span.where),
    )


def _vm_line(span: _VmSpan, rate: Fraction, cost: Fraction, catalog: Catalog) -> dict[str, Any]:
    vm = span.record
    return {
        "name": span.name,
        "role": vm["role"],
        "zone": vm["zone"],
        "machine_type": vm["machine_type"],
        "gpu_type": catalog.gpu_type(span.where, str(vm.get("gpu_type") or "")),
        "gpu_count": vm.get("gpu_count") or 0,
        "spot": vm["spot"],
        "active_seconds": float(round(span.end - span.start, 3)),
        "hourly": _out(rate),
        "cost": _out(cost),
    }


def ledger(
    vms: list[dict[str, Any]], segments: list[dict[str, Any]], catalog: Catalog, now: float | None = None
) -> dict[str, Any]:
    """What a run's VMs cost: per VM, per segment (VM time inside the segment's window), per protocol,
    and what fell outside every window (provisioning, switch gaps, teardown), against the same VMs
    all on-demand.

    A VM record: name, role (chief|worker|ps), zone, machine_type, gpu_type (canonical or ""), gpu_count,
    spot, started_at, ended_at (epoch s; None while it runs: charged up to ``now``, default the clock).
    A segment record: index, protocol (bsp|asp), started_at, ended_at (None: still running, up to now).
    A preempted spot VM simply has an early ended_at. ValueError for a malformed record; SpecError for
    a VM the catalog cannot price.
    """
    now_t = Fraction(time.time() if now is None else now)
    windows = _windows(segments, now_t)
    segment_costs = [Fraction(0)] * len(windows)
    total = on_demand_total = Fraction(0)
    per_vm = []
    for position, vm in enumerate(vms):
        span = _vm_span(vm, position, now_t)
        rate, on_demand_rate = _hourly_rates(span, catalog)
        cost = rate * (span.end - span.start) / _SECONDS_PER_HOUR
        total += cost
        on_demand_total += on_demand_rate * (span.end - span.start) / _SECONDS_PER_HOUR
        for k, window in enumerate(windows):
            segment_costs[k] += (
                rate * _overlap(span.start, span.end, window.start, window.end) / _SECONDS_PER_HOUR
            )
        per_vm.append(_vm_line(span, rate, cost, catalog))
    # BSP's and ASP's always (the paper's two), another protocol's where the run used it.
    per_protocol = {p: Fraction(0) for p in ("bsp", "asp")}
    for window, cost in zip(windows, segment_costs, strict=True):
        per_protocol[window.protocol] = per_protocol.get(window.protocol, Fraction(0)) + cost
    savings = on_demand_total - total
    return {
        "currency": catalog.currency,
        "total": _out(total),
        "on_demand_total": _out(on_demand_total),
        "savings": _out(savings),
        "savings_fraction": _out(savings / on_demand_total) if on_demand_total else 0.0,
        "per_vm": per_vm,
        "per_segment": [
            {
                "index": w.index,
                "protocol": w.protocol,
                "seconds": float(round(w.end - w.start, 3)),
                "cost": _out(cost),
            }
            for w, cost in zip(windows, segment_costs, strict=True)
        ],
        "per_protocol": {p: _out(c) for p, c in per_protocol.items()},
        "unattributed": _out(total - sum(segment_costs, Fraction(0))),
        "price_table": {"as_of": catalog.as_of, "source": catalog.source},
    }


def run_ledger(
    run_state: dict[str, Any], catalog: Catalog | None = None, now: float | None = None
) -> dict[str, Any] | None:
    """The ledger of a run from its state.json (``vms``, ``segments``); None for a run without VMs
    (local and hosts clusters). VMs that never ran (refused, still requested) cost nothing."""
    vms = [vm for vm in (run_state.get("vms") or {}).values() if vm.get("started_at") is not None]
    if not run_state.get("vms"):
        return None
    segments = [
        {
            "index": int(index),
            "protocol": s["protocol"],
            "started_at": s["started_at"],
            "ended_at": s.get("ended_at"),
        }
        for index, s in sorted((run_state.get("segments") or {}).items(), key=lambda item: int(item[0]))
        if s.get("started_at") is not None
    ]
    return ledger(vms, segments, catalog or Catalog.load(), now=now)


def cost_headline(cost: dict[str, Any] | None) -> dict[str, Any] | None:
    """A ledger's totals (what the history record and ``syncswitch run``'s JSON carry); None if none."""
    if not cost:
        return None
    keys = ("currency", "total", "on_demand_total", "savings", "savings_fraction", "per_protocol")
    return {key: cost.get(key) for key in keys}
