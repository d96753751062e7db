"""The job spec and the segment spec: what a user asks for, and what one training segment runs.

    JobSpec.from_params(params)            validates DAG params / CLI flags / REST conf, naming the bad field
    JobSpec.parse_params(params)           the same params as field values, parsed but not checked
    JobSpec.plan_entries()                 the offline plan: one entry per segment of switch_order
                                           (the plan-entry contract: syncswitch.plan; the grammar
                                           and the protocols: syncswitch.protocols)
    JobSpec.segment_spec(entry, ...)       -> SegmentSpec: what one plan entry's processes run (the
                                           one builder of SegmentSpecs, `syncswitch train`'s too)
    JobSpec.plan(run_id, run_dir)          -> [SegmentSpec, ...] of the offline plan

Units. Every step number in the interface is a BSP-equivalent step: one global batch of
``num_workers x batch_size`` samples. Progress is counted exactly in samples; an ASP worker update of
``batch_size`` samples is 1/num_workers of a step. ``until_step`` is cumulative over the job, so the
global step and the LR schedule continue across segments.

The module is longer than the runtime's others for one reason: what a job accepts reads in one place,
JobSpec's parsing, checks and planning, with the specs it builds and its fields' parsers beside it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from syncswitch import plan as plans
from syncswitch import protocols as protocol_grammar
from syncswitch.errors import SpecError
from syncswitch.fields import DEMO_JOB_NAME, FIELDS, JOB_NAME_PATTERN, MOMENTUM_RULES, default_job_name
from syncswitch.gce import GceSpec
from syncswitch.hosts import HostSpec, parse_hosts
from syncswitch.hparams import (
    HParams,
    HParamsError,
    PythonOps,
    check_one_optimizer,
    first_moment,
    get_hparams,
)
from syncswitch.protocols import Protocol
from syncswitch.stall import DEFAULT_STALL_SECONDS

# The built-in models' pairing with problems (the digits CNN takes 8x8 images, the ResNet 32x32).
_BUILTIN_IMAGE_MODELS = {"cnn": ("digits",), "resnet": ("image_cifar10", "image_cifar100", "synthetic_cifar")}
_JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)
# What an online switch away from BSP may go to: the protocols that do not wait for every worker each step.
ONLINE_PROTOCOLS = ("asp", "ssp", "local")


@dataclass(frozen=True)
class StragglerSpec:
    """Slow ``worker`` down for ``duration`` s, ``start`` s after the reference time, and again every
    ``every`` s when given. Two kinds, as in the original:

    - CPU (``slowdown``): the worker runs ``slowdown`` times slower (SIGSTOP/SIGCONT duty cycle).
    - network (``delay_ms``): the worker's link adds ``delay_ms`` to every round trip (``tc netem``, or
      syncswitch.linkdelay's NFQUEUE delayer where the kernel has no netem). Needs the worker on a host
      of its own: cluster_backend hosts or gce.

    The reference is the start of the first BSP segment in a pipeline run, or the launch of
    ``syncswitch train``.
    """

    worker: int
    start: float
    duration: float
    slowdown: float | None = None
    delay_ms: float | None = None
    every: float | None = None

    EXAMPLE = (
        "worker=1,start=20,duration=60,slowdown=4 or worker=1,start=20,duration=60,delay_ms=30[,every=120]"
    )

    @property
    def kind(self) -> str:
        return "network" if self.delay_ms is not None else "cpu"

    def describe(self) -> str:
        """What it does to the worker, for logs and plots: 'x4' or '+30 ms'."""
        return f"+{self.delay_ms:g} ms" if self.delay_ms is not None else f"x{self.slowdown:g}"

    @classmethod
    def parse(cls, text: str | dict) -> StragglerSpec:
        """Parse ``worker=1,start=20,duration=60,slowdown=4`` (or the same keys as a dict)."""
        name = "straggler"
        if isinstance(text, dict):
            pairs = {str(k): str(v) for k, v in text.items() if v is not None}
        else:
            pairs = {}
            for item in str(text).split(","):
                key, sep, value = item.strip().partition("=")
                if not sep:
                    raise SpecError(name, f"malformed item {item!r}; expected {cls.EXAMPLE}")
                pairs[key.strip()] = value.strip()
        required, optional = {"worker", "start", "duration"}, {"every"}
        kinds = {"slowdown", "delay_ms"} & set(pairs)
        unknown = set(pairs) - required - optional - {"slowdown", "delay_ms"}
        if not required <= set(pairs) or len(kinds) != 1 or unknown:
            raise SpecError(
                name,
                "needs worker, start, duration and exactly one of slowdown (CPU) or delay_ms (network), "
                f"optionally every; got {sorted(pairs)}; e.g. {cls.EXAMPLE}",
            )
        try:
            values = {k: int(v) if k == "worker" else float(v) for k, v in pairs.items()}
        except ValueError:
            raise SpecError(name, f"values must be numbers: {text!r}") from None
        spec = cls(**values)
        if spec.worker < 0 or spec.start < 0 or spec.duration <= 0:
            raise SpecError(name, "needs worker >= 0, start >= 0 and duration > 0")
        if spec.slowdown is not None and spec.slowdown <= 1:
            raise SpecError(name, f"slowdown must be > 1 (times slower), got {spec.slowdown:g}")
        if spec.delay_ms is not None and not 0 < spec.delay_ms <= 10_000:
            raise SpecError(name, f"delay_ms must be in (0, 10000] ms per round trip, got {spec.delay_ms:g}")
        if spec.every is not None and spec.every <= spec.duration:
            raise SpecError(
                name, f"every ({spec.every:g} s) must be longer than duration ({spec.duration:g} s)"
            )
        return spec

    def to_text(self) -> str:
        text = f"worker={self.worker},start={self.start:g},duration={self.duration:g},"
        text += f"delay_ms={self.delay_ms:g}" if self.delay_ms is not None else f"slowdown={self.slowdown:g}"
        return text + (f",every={self.every:g}" if self.every is not None else "")

    def episodes(self, reference: float) -> Iterator[tuple[float, float]]:
        """(start, end) wall times of each slow episode: one, or one every ``every`` s without end."""
        start = reference + self.start
        while True:
            yield start, start + self.duration
            if self.every is None:
                return
            start += self.every


@dataclass(frozen=True)
class SegmentSpec:
    """Everything one segment's processes need. Written to the cluster as JSON; no Airflow types."""

    run_id: str
    run_dir: str
    index: int
    protocol: str  # one of syncswitch.protocols.PROTOCOLS
    until_step: int  # cumulative BSP-equivalent target; the segment ends exactly here
    total_steps: int  # the whole job's workload, for the LR schedule
    model: str
    hparam_set: str
    problem: str
    data_dir: str = ""
    hparams: str = ""  # this segment's k=v,k=v overrides
    # The job's user code (syncswitch.usercode): imported by every process before names are looked up.
    # usr_code_uri: its copy in the run's bucket folder, which nodes use instead of the path (hosts, gce).
    usr_dir: str = ""
    usr_code_uri: str = ""
    usr_code_digest: str = ""
    hooks: tuple[str, ...] = ()  # registered hooks the chief calls (syncswitch.hooks)
    num_workers: int = 2
    num_ps: int = 1
    ckpt_frequency: int = 0  # steps between checkpoints; 0 = only at segment end
    momentum_rule: str = "ramped"
    momentum_ramp_steps: int = 50
    seed: int = 0
    evaluate: bool = False
    evaluate_checkpoints: bool = False  # test accuracy at every checkpoint (an accuracy-over-time curve)
    pin_cores: bool = False
    watchdog_seconds: float = 60.0
    stall_seconds: float = DEFAULT_STALL_SECONDS  # the floor of syncswitch.stall's rule
    stragglers: tuple[StragglerSpec, ...] = ()
    straggler_reference_time: float | None = None  # epoch seconds; None = launch time
    protocol_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # the protocol's settings

    @property
    def segment_protocol(self) -> Protocol:
        """The protocol this segment runs, with its settings (staleness bound, period, compression)."""
        return Protocol.of(self.protocol, self.protocol_args)

    def resolved_hparams(self) -> HParams:
        return get_hparams(self.hparam_set, self.model).override(self.hparams)

    def global_batch(self, hp: HParams | None = None) -> int:
        hp = hp or self.resolved_hparams()
        return self.num_workers * hp.batch_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SegmentSpec:
        data = dict(data)
        data["stragglers"] = tuple(StragglerSpec(**s) for s in data.get("stragglers", ()))
        data["hooks"] = tuple(data.get("hooks", ()))
        return cls(**data)

    def replace(self, **changes: Any) -> SegmentSpec:
        return dataclasses.replace(self, **changes)

    def on_workers(self, active: int) -> SegmentSpec:
        """This segment on at most ``active`` workers with the same global batch, so a step, the LR
        schedule and the BSP learning rate stay what they were (ASP's per-update LR follows the
        worker count through switch_config). The per-worker batch becomes global / k for the largest
        k <= active that divides the global batch: steps stay exact."""
        total = self.global_batch()
        workers = max(d for d in range(1, max(active, 1) + 1) if total % d == 0)
        if workers == self.num_workers:
            return self
        batch = f"batch_size={total // workers}"
        return self.replace(
            num_workers=workers,
            hparams=f"{self.hparams},{batch}" if self.hparams else batch,
            stragglers=tuple(s for s in self.stragglers if s.worker < workers),
        )


@dataclass(frozen=True)
class SwitchConfig:
    """The configuration policy: effective LR factor and momentum of one protocol at a given point."""

    learning_rate_scale: float
    momentum: float  # momentum SGD's momentum; Adam's beta1


def switch_config(
    protocol: str,
    hp: HParams,
    num_workers: int,
    rule: str,
    ramp_steps: int,
    steps_into_segment: Any,
    ops: Any = PythonOps,
) -> SwitchConfig:
    """The configuration policy, per protocol (``ops`` as in hparams.learning_rate_at):

    - BSP, compressed BSP and local SGD: the base LR and momentum. Each of their updates is the
      global batch's (compressed BSP's is BSP's with a lossy all-reduce), and a local SGD replica
      steps at that LR on its own batch: with momentum SGD, whose update is linear in the gradient,
      averaged every step that is BSP's update exactly; with Adam, whose update is about the LR per
      element whatever the batch, each replica steps as far as BSP would.
    - ASP and SSP: the LR divided by N (an update is one worker's batch b instead of N x b), and the
      momentum rule, as N updates in flight add momentum of their own: keep m, zero, scaled m/N, or
      ramped (m/N rising linearly back to m over ``ramp_steps`` BSP-equivalent steps).

    Adam and AdamW take the LR scale alone; ``momentum`` is their beta1, unchanged under every rule
    and protocol (their second moment is rescaled at the switch instead: second_moment_scale).
    The rule exists because heavy-ball momentum multiplies the step (by 1/(1-m) at steady state) on top
    of the momentum that stale asynchronous updates add; Adam's first moment is an average, which
    does not multiply the step, and its update has a size of about the LR per element, so N updates
    at LR/N move the weights as far per sample as one BSP step at the LR."""
    m = first_moment(hp)
    if not protocol_grammar.family(protocol).per_worker_updates:
        return SwitchConfig(1.0, m)
    scale = 1.0 / num_workers
    if hp.optimizer != "momentum":
        return SwitchConfig(scale, m)
    if rule == "keep":
        momentum = m
    elif rule == "zero":
        momentum = 0.0
    elif rule == "scaled":
        momentum = m / num_workers
    elif rule == "ramped":
        frac = 1.0 if ramp_steps <= 0 else ops.clip(steps_into_segment / ramp_steps, 0.0, 1.0)
        momentum = m / num_workers + (m - m / num_workers) * frac
    else:
        raise SpecError("momentum_rule", f"{rule!r} is not one of {', '.join(MOMENTUM_RULES)}")
    return SwitchConfig(scale, momentum)


def examples_per_update(protocol: str, batch_size: int, num_workers: int) -> int:
    """The examples behind one update's gradient: the global batch where every worker's gradient is
    summed into it (BSP, compressed BSP), one worker's batch where an update is one worker's (ASP,
    SSP) or one replica's (local SGD, between its averages)."""
    if protocol_grammar.family(protocol).per_worker_updates or protocol == "local":
        return batch_size
    return batch_size * num_workers


def second_moment_scale(hp: HParams, previous_update_batch: int | None, update_batch: int) -> float:
    """Adam's second moment across a switch: multiplied by the previous update's batch over this
    segment's (examples_per_update: BSP -> ASP, SSP or local SGD with N workers: N; back: 1/N;
    between two of the per-worker or two of the global-batch protocols: 1), where the checkpoint
    records it (else 1).

    The second moment estimates E[g^2] of one update's gradient, which is mostly noise once training
    is under way, and noise variance goes as 1/batch: carried over unchanged from BSP's N x b batch, it
    is about N times too small for ASP's b, so ASP's first updates would be about sqrt(N) times too
    large until it re-estimates (1/(1 - beta2) updates). Momentum SGD keeps no second moment."""
    if hp.optimizer == "momentum" or not previous_update_batch:
        return 1.0
    return previous_update_batch / update_batch


@dataclass(frozen=True)
class JobSpec:
    """A validated job: the DAG params, the CLI flags and the REST conf all end up here."""

    job_name: str = DEMO_JOB_NAME  # none given: fields.default_job_name (parse_params)
    # One protocol per segment (syncswitch.protocols): digits "10", or "1,ssp:4,0"; canonical text.
    switch_order: str = "10"
    train_steps: tuple[int, ...] = ()  # per segment; empty = total_steps x bsp_fraction
    total_steps: int = 400
    bsp_fraction: float = 0.25
    ckpt_frequency: tuple[int, ...] = (50,)  # per segment; one value applies to all
    hparams: tuple[str, ...] = ("",)  # per segment; one value applies to all
    num_workers: int = 2
    num_ps: int = 1
    model: str = "cnn"
    hparam_set: str = "cnn_digits"
    problem: str = "digits"
    data_dir: str = ""
    usr_dir: str = ""  # user code registering models, problems, hparam sets (syncswitch.usercode)
    hooks: tuple[str, ...] = ()  # registered hooks called on the chief (syncswitch.hooks)
    bucket_dir: str = "runs"
    cluster_backend: str = "local"
    hosts: tuple[HostSpec, ...] = ()  # cluster_backend "hosts": the cluster's hosts (syncswitch.hosts)
    hosts_per_cluster: int = 0  # of ``hosts``, a run takes this many free ones (0: all)
    gce: GceSpec | None = None  # cluster_backend "gce": the VMs to create (syncswitch.gce)
    momentum_rule: str = "ramped"
    momentum_ramp_steps: int = 50
    online_policy: str = "none"
    online_protocol: str = "asp"  # asp, ssp:<s>, local:<H> or auto (syncswitch_airflow.policies)
    max_online_switches: int = 2
    stragglers: tuple[StragglerSpec, ...] = ()
    seed: int = 0
    pin_cores: bool = False
    evaluate_segments: bool = True
    evaluate_checkpoints: bool = False
    stall_seconds: float = DEFAULT_STALL_SECONDS
    segment_retries: int = 1  # Airflow retries of a failed segment task, each from the last checkpoint
    # The offline timing policy (syncswitch_airflow.timing): "fixed" runs bsp_fraction as given;
    # "search" lets the job's history choose it (halving search, then the smallest accepted fraction).
    timing_policy: str = "fixed"
    timing_protocols: tuple[str, ...] = ()  # search: the protocols after BSP to search (canonical)
    timing_repeats: int = 3
    timing_tolerance: float = 0.005
    timing_floor: float = 1 / 32
    timing_refine: int = 0

    # ---- parsing ---------------------------------------------------------------------------

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> JobSpec:
        """Validate raw params (DAG params, CLI, REST conf). Raises SpecError naming the field."""
        values = cls.parse_params(params)
        for field in FIELDS:  # each field's bounds and accepted values, from the one table
            field.check(values[field.name])
        spec = cls(**values)
        spec.validate()
        return spec

    @classmethod
    def parse_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Every field's value from raw params: its default where the param is absent or empty, else
        the param parsed to the field's type. SpecError naming the field for an unknown param or a
        value that does not parse; bounds and the rules between fields are from_params's."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise SpecError(unknown[0], f"unknown parameter; accepted: {', '.join(sorted(known))}")
        defaults = cls()
        values: dict[str, Any] = {}
        for name in known:
            raw = params.get(name)
            # Absent or empty means "use the default"; data_dir's default is itself empty.
            values[name] = getattr(defaults, name) if _absent(raw) else raw
        if _absent(params.get("job_name")):  # the job is named after its model and problem
            values["job_name"] = default_job_name(
                str(values["model"]), str(values["problem"]), str(values["usr_dir"])
            )
        values["switch_order"] = protocol_grammar.switch_order_text(
            protocol_grammar.parse_switch_order(values["switch_order"])
        )
        values["train_steps"] = _int_list("train_steps", values["train_steps"])
        values["ckpt_frequency"] = _int_list("ckpt_frequency", values["ckpt_frequency"])
        values["hparams"] = _str_list("hparams", values["hparams"])
        values["hooks"] = _name_list("hooks", values["hooks"])
        values["timing_protocols"] = tuple(
            protocol_grammar.parse_token(t, f"protocol {i}", "timing_protocols").token
            for i, t in enumerate(_seq(values["timing_protocols"]))
        )
        values["stragglers"] = tuple(StragglerSpec.parse(s) for s in _seq(values["stragglers"]))
        values["hosts"] = parse_hosts(values["hosts"])
        scalar_parsers = {"integer": _int, "number": _float, "boolean": _bool}
        for field in FIELDS:  # each scalar by its type in the one table
            if field.type in scalar_parsers:
                values[field.name] = scalar_parsers[field.type](field.name, values[field.name])
        values["gce"] = GceSpec.parse(values["gce"], max(values["num_workers"], 1))
        return values

    def validate(self) -> None:
        """SpecError naming the first bad field and what it accepts (checked in the order below)."""
        if not _JOB_NAME_RE.match(self.job_name):
            raise SpecError(
                "job_name",
                f"{self.job_name!r} must be 1-63 lowercase letters, digits or "
                "'-', starting and ending with a letter or digit",
            )
        self._validate_plan()
        self._validate_names()
        self._validate_hosts()
        self._validate_timing()
        self._validate_online_protocol()
        self._validate_workload()
        self._validate_stragglers()
        if not self.bucket_dir:
            raise SpecError("bucket_dir", "must be a local folder or a gs://bucket/prefix URI")
        if self.bucket_dir.startswith("gs://") and len(self.bucket_dir) <= len("gs://"):
            raise SpecError("bucket_dir", "gs:// URI needs a bucket name")
        if not self.usr_dir:  # a usr_dir's names exist once imported: syncswitch.check checks them
            self._validate_hparams()

    def protocols(self) -> tuple[Protocol, ...]:
        """The planned protocol of each segment, from switch_order."""
        return protocol_grammar.parse_switch_order(self.switch_order)

    def _validate_plan(self) -> None:
        """The switch order, and per-segment values that match it."""
        n = len(self.protocols())  # SpecError naming the segment and the accepted spellings
        if self.train_steps and len(self.train_steps) != n:
            raise SpecError(
                "train_steps",
                f"has {len(self.train_steps)} values but switch_order {self.switch_order!r} has {n} segments",
            )
        if not self.train_steps and self.total_steps < n:
            raise SpecError("total_steps", f"must be >= the number of segments ({n})")
        for name, values in (("ckpt_frequency", self.ckpt_frequency), ("hparams", self.hparams)):
            if len(values) not in (1, n):
                raise SpecError(name, f"needs 1 value or one per segment ({n}), got {len(values)}")

    def _validate_workload(self) -> None:
        """Built-in models and problems that go together, and room for the online switches."""
        if self.problem in ("image_cifar10", "image_cifar100") and not self.data_dir:
            raise SpecError("data_dir", f"problem {self.problem!r} needs a data_dir (local path or gs://)")
        if self.model == "cnn" and self.problem in _BUILTIN_IMAGE_MODELS["resnet"]:
            raise SpecError(
                "model",
                f"model 'cnn' is the small digits CNN; use model 'resnet' for problem {self.problem!r}",
            )
        if self.model == "resnet" and self.problem == "digits":
            raise SpecError("model", "problem 'digits' (8x8 images) takes model 'cnn'")
        n = len(self.protocols())
        if n + self.max_online_switches > plans.MAX_SEGMENTS:
            raise SpecError(
                "switch_order/max_online_switches",
                f"{n} planned segment(s) + max_online_switches {self.max_online_switches} exceed the "
                f"{plans.MAX_SEGMENTS} segments a run may have; shorten switch_order or lower "
                "max_online_switches",
            )

    def _validate_stragglers(self) -> None:
        for s in self.stragglers:
            if s.worker >= self.num_workers:
                raise SpecError(
                    "stragglers", f"worker {s.worker} does not exist; workers are 0..{self.num_workers - 1}"
                )
            if s.kind == "network" and self.cluster_backend == "local":
                raise SpecError(
                    "stragglers",
                    f"{s.to_text()!r}: a network straggler (delay_ms) delays a host's link, and every node "
                    "of cluster_backend 'local' shares one host; use cluster_backend 'hosts' or 'gce'",
                )

    def _validate_hparams(self) -> None:
        """The built-in hparam set and the overrides apply."""
        try:
            hp = get_hparams(self.hparam_set, self.model)
            check_one_optimizer([hp.override(overrides) for overrides in self.hparams])
        except HParamsError as exc:
            raise SpecError(
                "hparams" if str(exc).startswith("hparams") else "hparam_set", str(exc).split(": ", 1)[1]
            ) from None

    def _validate_names(self) -> None:
        """Cluster backend, model and problem are names of the registry (syncswitch.registry). A
        usr_dir's names exist only once it is imported, which validation does not do (it imports
        TensorFlow, and parsing a job must stay cheap): there syncswitch.check resolves them, before
        anything is provisioned."""
        from syncswitch import usercode
        from syncswitch.registry import REGISTRY

        REGISTRY.entry("backend", self.cluster_backend)  # unknown: the error lists the known ones
        if self.usr_dir:
            usercode.kind_of(self.usr_dir)  # an existing folder, file or importable module
            return
        for kind, value in (("model", self.model), ("problem", self.problem)):
            REGISTRY.entry(kind, value)
        for name in self.hooks:
            REGISTRY.entry("hooks", name)

    def _validate_hosts(self) -> None:
        """hosts and gce describe the cluster of their own backend only; both share through a bucket."""
        backend = self.cluster_backend
        for name, value in (("hosts", self.hosts), ("gce", self.gce)):
            if value and backend != name:
                raise SpecError(name, f"only for cluster_backend {name!r} (this job's is {backend!r})")
        if self.hosts_per_cluster and backend != "hosts":
            raise SpecError(
                "hosts_per_cluster", f"only for cluster_backend 'hosts' (this job's is {backend!r})"
            )
        if backend == "local":
            return
        if self.cluster_backend == "hosts" and not self.hosts:
            raise SpecError("hosts", "cluster_backend 'hosts' needs at least one host (address=..., key=...)")
        # A DNS name with each_address is as many hosts as it resolves to, counted at provisioning.
        if self.hosts_per_cluster > len(self.hosts) and not any(h.each_address for h in self.hosts):
            raise SpecError(
                "hosts_per_cluster",
                f"{self.hosts_per_cluster} of {len(self.hosts)} host(s): at most the number of hosts listed",
            )
        if self.cluster_backend == "gce" and not self.gce:
            raise SpecError("gce", "cluster_backend 'gce' needs the gce param (project=...;zones=...)")
        if not self.bucket_dir.startswith("gs://"):
            raise SpecError(
                "bucket_dir",
                f"cluster_backend {backend!r} needs a gs:// bucket: it is the only thing the hosts share",
            )
        if self.data_dir and not self.data_dir.startswith("gs://"):
            raise SpecError(
                "data_dir",
                f"cluster_backend {backend!r} reads data from gs:// (every host stages its own copy)",
            )

    def _validate_timing(self) -> None:
        if self.timing_policy == "search":
            # The policy chooses the BSP share of one BSP-then-X job, as the paper's search did.
            protocols = self.protocols()
            if len(protocols) != 2 or protocols[0].name != "bsp" or protocols[1].name == "bsp":
                raise SpecError(
                    "switch_order",
                    "timing_policy 'search' needs two segments, BSP then another protocol ('10', "
                    f"'bsp,ssp:4'), got {self.switch_order!r}",
                )
            if self.train_steps:
                raise SpecError(
                    "train_steps", "timing_policy 'search' splits total_steps itself; leave it empty"
                )
        elif self.timing_protocols:
            raise SpecError("timing_protocols", "only for timing_policy 'search'")
        if "bsp" in self.timing_protocols:
            raise SpecError(
                "timing_protocols", "the protocols after BSP: asp, ssp:<s>, local:<H>, fp16, topk:<r>"
            )

    def second_protocols(self) -> tuple[str, ...]:
        """The protocols a timing search tries after BSP: timing_protocols, else switch_order's second."""
        return self.timing_protocols or (self.protocols()[-1].token,)

    def _validate_online_protocol(self) -> None:
        if self.online_protocol == "auto":
            return
        name = protocol_grammar.parse_token(self.online_protocol, "the protocol", "online_protocol").name
        if name not in ONLINE_PROTOCOLS:
            raise SpecError(
                "online_protocol",
                f"{self.online_protocol!r}: a straggler's switch goes to asp, ssp:<s>, local:<H> or auto",
            )

    def with_bsp_fraction(self, fraction: float, second: Protocol | None = None) -> JobSpec:
        """This run's plan once a timing policy chose its BSP share (and, where it searches it, the
        protocol after BSP; else the job's own second segment's): all BSP at 1.0, else BSP then that
        protocol; the choice is now fixed for this run (the decision itself is kept in state.json)."""
        second = second or self.protocols()[-1]
        order = [Protocol("bsp")] if fraction >= 1.0 else [Protocol("bsp"), second]
        return dataclasses.replace(
            self,
            bsp_fraction=fraction,
            switch_order=protocol_grammar.switch_order_text(order),
            timing_policy="fixed",
        )

    def planned_bsp_fraction(self) -> float:
        """The share of the workload planned as BSP (before any online switch)."""
        steps = self.segment_steps()
        return sum(s for s, p in zip(steps, self.protocols(), strict=True) if p.name == "bsp") / sum(steps)

    # ---- planning --------------------------------------------------------------------------

    def segment_steps(self) -> list[int]:
        """Steps per segment. With total_steps + bsp_fraction, the BSP share is split evenly over the
        BSP segments and the rest evenly over the others (whatever their protocols); rounding goes to
        the last segment of each share."""
        if self.train_steps:
            return list(self.train_steps)
        is_bsp = [p.name == "bsp" for p in self.protocols()]
        n_bsp, n_other = is_bsp.count(True), is_bsp.count(False)
        bsp_total = round(self.total_steps * self.bsp_fraction) if n_other else self.total_steps
        if n_bsp == 0:
            bsp_total = 0
        other_total = self.total_steps - bsp_total
        if n_other and other_total < n_other or n_bsp and bsp_total < n_bsp:
            raise SpecError(
                "bsp_fraction",
                f"{self.bsp_fraction} leaves a segment of switch_order "
                f"{self.switch_order!r} with no steps out of {self.total_steps}",
            )
        shares = {True: _even_split(bsp_total, n_bsp), False: _even_split(other_total, n_other)}
        return [shares[bsp].pop(0) for bsp in is_bsp]

    @property
    def workload(self) -> int:
        return sum(self.segment_steps())

    def per_segment(self, values: tuple, index: int) -> Any:
        return values[index] if len(values) > 1 else values[0]

    def plan_entries(self) -> list[dict[str, Any]]:
        """The offline plan (``state["plan"]`` before any online switch): one entry per
        switch_order segment with its cumulative target. ``plan_index`` is the entry's position in
        switch_order; per-segment settings (hparams, ckpt_frequency) follow it, also after online
        switches renumber the entries."""
        until = 0
        entries = []
        for index, (protocol, steps) in enumerate(zip(self.protocols(), self.segment_steps(), strict=True)):
            until += steps
            entries.append(
                {
                    "index": index,
                    **plans.entry_fields(protocol),
                    "until_step": until,
                    "origin": "plan",
                    "plan_index": index,
                }
            )
        plans.check(entries)
        return entries

    def plan(self, run_id: str, run_dir: str) -> list[SegmentSpec]:
        """The SegmentSpecs of the offline plan."""
        return [self.segment_spec(entry, run_id, run_dir) for entry in self.plan_entries()]

    def segment_spec(self, entry: dict[str, Any], run_id: str, run_dir: str) -> SegmentSpec:
        """What the processes of one plan entry run: the job's settings for the original segment it
        belongs to. Online entries carry no ``plan_index``; they take the settings of the original
        segment they were carved from (the first whose target is at or beyond theirs)."""
        position = entry.get("plan_index")
        if position is None:
            position = self._original_position(entry["until_step"])
        return SegmentSpec(
            run_id=run_id,
            run_dir=run_dir,
            index=entry["index"],
            protocol=entry["protocol"],
            protocol_args=dict(entry.get("protocol_args") or {}),
            until_step=entry["until_step"],
            total_steps=self.workload,
            model=self.model,
            hparam_set=self.hparam_set,
            problem=self.problem,
            data_dir=self.data_dir,
            hparams=self.per_segment(self.hparams, position),
            usr_dir=self.usr_dir,
            hooks=self.hooks,
            num_workers=self.num_workers,
            num_ps=self.num_ps,
            ckpt_frequency=self.per_segment(self.ckpt_frequency, position),
            momentum_rule=self.momentum_rule,
            momentum_ramp_steps=self.momentum_ramp_steps,
            seed=self.seed,
            evaluate=self.evaluate_segments,
            evaluate_checkpoints=self.evaluate_checkpoints,
            pin_cores=self.pin_cores,
            stall_seconds=self.stall_seconds,
            stragglers=self.stragglers,
        )

    def _original_position(self, until_step: float) -> int:
        until = 0
        for position, steps in enumerate(self.segment_steps()):
            until += steps
            if until_step <= until:
                return position
        return len(self.protocols()) - 1

    def to_params(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["stragglers"] = [s.to_text() for s in self.stragglers]
        data["hosts"] = [h.to_text() for h in self.hosts]
        data["gce"] = self.gce.to_params() if self.gce else {}
        for key in ("train_steps", "ckpt_frequency", "hparams", "hooks", "timing_protocols"):
            data[key] = list(data[key])
        return data


def _even_split(total: int, count: int) -> list[int]:
    """``total`` in ``count`` equal shares, the remainder on the last."""
    if not count:
        return []
    share = [total // count] * count
    share[-1] += total - sum(share)
    return share


# ---- field parsers: each names its field in the error -------------------------------------------


def _absent(raw: Any) -> bool:
    """A param left out, or left empty (null, "", []): the field's default applies."""
    return raw is None or raw == "" or raw == []


def _seq(value: Any) -> list:
    if value is None or value == "":
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            return list(json.loads(stripped))
        return [stripped]
    return [value]


def _int_list(name: str, value: Any) -> tuple[int, ...]:
    items = _seq(value)
    if len(items) == 1 and isinstance(items[0], str) and " " in items[0].strip():
        items = items[0].split()
    try:
        return tuple(int(v) for v in items)
    except (TypeError, ValueError):
        raise SpecError(name, f"must be integers, got {value!r}") from None


def _str_list(name: str, value: Any) -> tuple[str, ...]:
    items = _seq(value)
    if not all(isinstance(v, str) for v in items):
        raise SpecError(name, f"must be strings, got {value!r}")
    return tuple(items) or ("",)


def _name_list(name: str, value: Any) -> tuple[str, ...]:
    """Registered names: a list, or one string of comma-separated names."""
    items = _seq(value)
    if not all(isinstance(v, str) for v in items):
        raise SpecError(name, f"must be names (strings), got {value!r}")
    return tuple(n.strip() for item in items for n in item.split(",") if n.strip())


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise SpecError(name, f"must be an integer, got {value!r}")
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise SpecError(name, f"must be an integer, got {value!r}") from None
    if not as_float.is_integer():
        raise SpecError(name, f"must be an integer, got {value!r}")
    return int(as_float)


def _float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SpecError(name, f"must be a number, got {value!r}") from None


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise SpecError(name, f"must be true or false, got {value!r}")
