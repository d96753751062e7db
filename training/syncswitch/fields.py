"""The job's fields, each declared once: its type, bounds, accepted values, title, description, flag.

``JobSpec`` (spec.py) holds a job's values and the rules between fields; this table holds what each
field accepts on its own and how people set it. Generated from it:

- the ``sync_switch`` DAG's Params, which render the Trigger form and check REST conf
  (``syncswitch_airflow.dag_params``);
- the flags of ``syncswitch run``, the original main.py's spellings included
  (``syncswitch_airflow.tools.cli``), and of ``syncswitch check`` (``add_job_flags``);
- the flags of ``syncswitch train`` for the job fields its one segment takes (``add_train_flags``);
- the per-field checks of ``JobSpec.from_params`` (bounds and accepted values, ``check``).

tests/test_fields.py checks that the three agree for every field.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Any

from syncswitch import plan as plans
from syncswitch.errors import SpecError
from syncswitch.protocols import SPELLINGS

MOMENTUM_RULES = ("keep", "zero", "scaled", "ramped")
ONLINE_POLICIES = ("none", "greedy", "elastic")
TIMING_POLICIES = ("fixed", "search")
JOB_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
# The job name of the built-in demo (the digits CNN without user code) when a job names none.
DEMO_JOB_NAME = "digits-demo"
# The most retries a job may ask for per segment: the segment tasks' own ``retries`` (Airflow's
# ceiling), of which a run uses its job's ``segment_retries``.
MAX_SEGMENT_RETRIES = 20
# Four or five k=v pairs; StragglerSpec.parse checks the keys and values and names what is wrong.
STRAGGLER_PATTERN = r"^(\s*\w+\s*=\s*[^,=\s]+\s*,){3,4}\s*\w+\s*=\s*[^,=\s]+\s*$"


@dataclass(frozen=True)
class Field:
    """One job field. ``type`` is its JSON-schema type; an array's items are ``items``."""

    name: str
    type: str  # string | integer | number | boolean | array | object
    title: str
    description: str
    items: str = ""  # an array's item type: integer | string
    minimum: float | None = None  # of the value, or of every item of an array
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()  # the accepted values
    registry: str = ""  # a name registered under this kind (syncswitch.registry)
    pattern: str = ""  # of a string, or of every item of a string array
    nullable: bool = False  # may be left empty in the form (null): the default applies
    original_flag: str = ""  # the original main.py's spelling, where it had the field
    repeat_flag: str = ""  # a flag given once per item (--host a --host b) instead of one flag with N values
    metavar: str = ""

    @property
    def flag(self) -> str:
        """The flag of ``syncswitch run``: the original's spelling, else the field's name."""
        return self.repeat_flag or self.original_flag or "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        """Raise SpecError unless a parsed value is within the field's bounds and accepted values."""
        values = value if self.type == "array" else (value,)
        for item in values:
            if self.choices and item not in self.choices:
                raise SpecError(self.name, f"{item!r} is not one of: {', '.join(self.choices)}")
            if isinstance(item, int | float) and not isinstance(item, bool) and not self._in_bounds(item):
                raise SpecError(self.name, f"must be {self.bounds_text()}, got {item}")

    def _in_bounds(self, number: float) -> bool:
        if self.minimum is not None and (
            number <= self.minimum if self.exclusive_minimum else number < self.minimum
        ):
            return False
        return self.maximum is None or number <= self.maximum

    def bounds_text(self) -> str:
        """``in 1..64``, ``>= 0``, ``in (0, 0.5]``: what the bounds allow, for error messages."""
        low, high = _number_text(self.minimum), _number_text(self.maximum)
        if self.minimum is not None and self.maximum is not None:
            if self.exclusive_minimum:
                return f"in ({low}, {high}]"
            return f"in {low}..{high}" if self.type == "integer" else f"in [{low}, {high}]"
        if self.minimum is not None:
            return f"> {low}" if self.exclusive_minimum else f">= {low}"
        return f"<= {high}"


def _number_text(number: float | None) -> str:
    return "" if number is None else f"{number:g}"


FIELDS: tuple[Field, ...] = (
    Field(
        "job_name",
        "string",
        "Job name",
        "Names the run folder <bucket_dir>/<job_name>/<run_id>/ and the job's history: lowercase "
        f"letters, digits and '-'. Empty: <model>-<problem> ({DEMO_JOB_NAME} for the built-in demo), "
        "so the runs of different models never share a folder or a history.",
        pattern=JOB_NAME_PATTERN,
        nullable=True,
        original_flag="--job-name",
    ),
    Field(
        "switch_order",
        "string",
        "Switch order",
        "One protocol per segment: digits as the original's flag (1 = BSP, 0 = ASP: '10' trains BSP, "
        "then switches to ASP), or protocols separated by commas: '1,ssp:4,0', 'bsp,local:8', "
        f"'bsp,topk:0.01'. Each is one of: {SPELLINGS}. ssp: stale-synchronous with staleness bound "
        "s; local: local SGD averaging every H steps; fp16 and topk: BSP with a compressed all-reduce.",
        # No pattern: JobSpec names the bad segment and the accepted spellings (syncswitch.protocols).
        original_flag="--switch-order",
    ),
    Field(
        "train_steps",
        "array",
        "Steps per segment",
        "BSP-equivalent steps for each segment, as in the original (one per switch_order digit). "
        "Leave empty to split total_steps by bsp_fraction.",
        items="integer",
        minimum=1,
        original_flag="--train-steps",
    ),
    Field(
        "total_steps",
        "integer",
        "Total steps",
        "The whole workload in BSP-equivalent steps (used when train_steps is empty).",
        minimum=1,
    ),
    Field(
        "bsp_fraction",
        "number",
        "BSP fraction",
        "Share of total_steps trained with BSP (split evenly over the BSP segments).",
        minimum=0,
        maximum=1,
    ),
    Field(
        "ckpt_frequency",
        "array",
        "Checkpoint frequency",
        "Steps between checkpoints, one value for all segments or one per segment (0 = only at segment end).",
        items="integer",
        minimum=0,
        original_flag="--ckpt-frequency",
    ),
    Field(
        "hparams",
        "array",
        "Hyper-parameter overrides",
        "k=v,k=v overrides of hparam_set (tensor2tensor names), one string for all "
        "segments or one per segment.",
        items="string",
        original_flag="--hparams",
    ),
    Field(
        "num_workers",
        "integer",
        "Workers",
        "Training workers in the cluster.",
        minimum=1,
        maximum=64,
        original_flag="--num-worker",
    ),
    Field(
        "num_ps",
        "integer",
        "Parameter servers",
        "Parameter servers (used by ASP segments).",
        minimum=1,
        maximum=16,
        original_flag="--num-ps",
    ),
    Field(
        "model",
        "string",
        "Model",
        "A registered model: cnn for digits, resnet for the CIFAR problems, or one of usr_dir's.",
        registry="model",
        original_flag="--model",
    ),
    Field(
        "hparam_set",
        "string",
        "Hyper-parameter set",
        "A registered set for the model.",
        registry="hparams",
        original_flag="--hparam-set",
    ),
    Field(
        "problem",
        "string",
        "Problem",
        "A registered problem (dataset).",
        registry="problem",
        original_flag="--problem",
    ),
    Field(
        "usr_dir",
        "string",
        "User code",
        "A package folder, .py file or module name that registers models, problems "
        "and hparam sets (tensor2tensor's t2t_usr_dir); checked on one batch before provisioning. "
        "See docs/bring-your-own-model.md.",
        nullable=True,
        metavar="FOLDER|FILE.py|MODULE",
    ),
    Field(
        "hooks",
        "array",
        "Hooks",
        "Registered hooks (a usr_dir's @register_hooks, or entry points) whose on_checkpoint(step, path) "
        "and on_evaluate(step, metrics) run on the chief at each checkpoint and evaluation; a hook's "
        "error is logged and training goes on. See docs/bring-your-own-model.md.",
        items="string",
        registry="hooks",
        repeat_flag="--hook",
        metavar="NAME",
    ),
    Field(
        "data_dir",
        "string",
        "Data folder",
        "Local folder or gs:// URI with the dataset (needed by image_cifar10/100; "
        "may be a template, e.g. gs://bucket/cifar/{{ ds }}). Empty for the bundled digits.",
        # Optional: an empty required string would keep the Trigger form from submitting.
        nullable=True,
        original_flag="--data-dir",
    ),
    Field(
        "bucket_dir",
        "string",
        "Bucket folder",
        "Where run folders go: a local folder, or gs://bucket/prefix for GCS.",
        original_flag="--bucket-dir",
    ),
    Field(
        "cluster_backend",
        "string",
        "Cluster backend",
        "Where the training processes run: local (this machine), hosts (the hosts below, over SSH) "
        "or gce (Compute Engine VMs created for the run, see gce).",
        registry="backend",
    ),
    Field(
        "hosts",
        "array",
        "Hosts",
        "cluster_backend hosts: one item per host, address=10.0.0.2,key=/path/to/ssh-key "
        "[,user=root,port=22,role=chief|worker|ps,python=/venv/bin/python,name=h1,"
        "host_key=ssh-ed25519 AAAA...], "
        "or conn=<ssh_conn_id> (an Airflow SSH connection: key, host-key policy, and address/user/port "
        "unless given). host_key pins the host's SSH host key (as in known_hosts). The key "
        "is a path on the Airflow worker or a gs:// object; its contents never leave the Airflow side. "
        "Needs a gs:// bucket_dir.",
        items="string",
        repeat_flag="--host",
        metavar="address=10.0.0.2,key=/path/to/key[,role=worker] | conn=ssh_conn_id[,role=worker]",
    ),
    Field(
        "hosts_per_cluster",
        "integer",
        "Hosts per cluster",
        "cluster_backend hosts: how many of the hosts a run's cluster takes; 0 = all of them. Fewer than "
        "listed makes the hosts a pool: each run takes free ones, in order, from the deployment's "
        "capacity ledger, so runs of one job (a backfill, a sweep) train at once on different hosts.",
        minimum=0,
    ),
    Field(
        "gce",
        "object",
        "Compute Engine",
        "cluster_backend gce: {project, zones (one, or one per worker), machine_types, gpus "
        "(e.g. [t4, t4, v100, v100:2] or none; g2 and a2 machine types come with their L4 and A100), "
        "ps_machine_type, spot (roles: worker, ps), network, "
        "subnetwork, image, python, ssh_user, max_run_seconds, on_revocation (replace|shrink), disk_gb}. "
        "The chief VM (worker 0) is always on-demand. Needs a gs:// bucket_dir.",
        metavar="project=p;zones=us-central1-a;gpus=t4 t4 v100 v100",
    ),
    Field(
        "momentum_rule",
        "string",
        "Momentum rule",
        "Momentum after a switch to ASP: keep, zero, scaled (m/N) or ramped (m/N back up to m).",
        choices=MOMENTUM_RULES,
    ),
    Field(
        "momentum_ramp_steps",
        "integer",
        "Momentum ramp steps",
        "Steps of the 'ramped' rule.",
        minimum=0,
    ),
    Field(
        "online_policy",
        "string",
        "Online policy",
        "Reaction to stragglers: none, greedy (ASP while one persists) or elastic (switch only "
        "when it pays off).",
        choices=ONLINE_POLICIES,
    ),
    Field(
        "online_protocol",
        "string",
        "Online protocol",
        "What an online switch during BSP goes to: asp (the paper's), ssp:<s> (stale-synchronous, "
        "bound s), local:<H> (local SGD, averaging every H steps), or auto (bounded staleness: SSP "
        "with s from the straggler's slowdown). A switch back is always to BSP.",
    ),
    Field(
        "max_online_switches",
        "integer",
        "Max online switches",
        f"Cap on switches added at run time; planned segments + this must be <= {plans.MAX_SEGMENTS}.",
        minimum=0,
        maximum=plans.MAX_SEGMENTS - 1,
    ),
    Field(
        "stragglers",
        "array",
        "Injected stragglers",
        "One item per slow worker: worker=1,start=20,duration=60,slowdown=4 (CPU: times "
        "slower) or worker=1,start=20,duration=60,delay_ms=30 (network: ms added to every round trip "
        "of the worker's link; hosts or gce backends), optionally every=120 to repeat; seconds after "
        "the first BSP segment starts.",
        items="string",
        pattern=STRAGGLER_PATTERN,
        repeat_flag="--straggler",
        metavar="worker=1,start=20,duration=60,slowdown=4|delay_ms=30",
    ),
    Field("seed", "integer", "Seed", "Random seed.", minimum=0),
    Field("pin_cores", "boolean", "Pin cores", "Pin each process to one core."),
    Field(
        "evaluate_checkpoints",
        "boolean",
        "Evaluate every checkpoint",
        "Test accuracy at every checkpoint: an accuracy-over-time curve, and time to a "
        "target accuracy in comparisons (its seconds are subtracted from training time).",
    ),
    Field(
        "stall_seconds",
        "number",
        "Stall limit (s)",
        "A segment whose global step does not move for this long (or for 20x its usual "
        "time between steps, if longer) is stopped and retried from its last checkpoint.",
        minimum=10,
    ),
    Field(
        "segment_retries",
        "integer",
        "Retries per segment",
        "How many times a failed segment is retried, each time from its last checkpoint: a lost host, "
        "a preempted spot VM, a stall or a lost Airflow worker costs one. A long job on spot VMs wants "
        "several. Past them the run fails; Clear resumes it.",
        minimum=0,
        maximum=MAX_SEGMENT_RETRIES,
    ),
    Field(
        "timing_policy",
        "string",
        "Timing policy",
        "fixed: train bsp_fraction as given. search: the job's history chooses it (BSP baseline runs, "
        "then a halving search 0.5, 0.25, ... accepted while accuracy holds, then the smallest "
        "accepted fraction); needs switch_order of BSP then another protocol ('10', 'bsp,ssp:4').",
        choices=TIMING_POLICIES,
    ),
    Field(
        "timing_protocols",
        "array",
        "Timing: protocols after BSP",
        "With timing_policy search: the protocols to search after BSP, each with its own halving "
        "search (e.g. asp, ssp:4, local:8); once all have finished, runs take the fastest one that "
        "keeps BSP's accuracy. Empty: switch_order's second protocol only.",
        items="string",
    ),
    Field(
        "timing_repeats",
        "integer",
        "Timing: runs per candidate",
        "k runs of each fraction.",
        minimum=1,
    ),
    Field(
        "timing_tolerance",
        "number",
        "Timing: accuracy tolerance",
        "A fraction is accepted while its mean accuracy >= the BSP baseline's mean - this.",
        minimum=0,
    ),
    Field(
        "timing_floor",
        "number",
        "Timing: smallest fraction",
        "The search stops below this BSP fraction.",
        minimum=0,
        exclusive_minimum=True,
        maximum=0.5,
    ),
    Field(
        "timing_refine",
        "integer",
        "Timing: refinement steps",
        "Bisections after the first rejection (0 = off).",
        minimum=0,
    ),
    Field(
        "evaluate_segments",
        "boolean",
        "Evaluate each segment",
        "Test accuracy at the end of every segment, not only the final one.",
    ),
)

FIELDS_BY_NAME = {field.name: field for field in FIELDS}


def default_job_name(model: str, problem: str, usr_dir: str) -> str:
    """The job name of a job that names none: the demo's for the built-in demo, else
    ``<model>-<problem>`` made a valid job name (lowercase, ``-`` for anything else, 63 characters at
    most), so that a user's runs and their history never land in the demo's folder."""
    if not usr_dir and (model, problem) == ("cnn", "digits"):
        return DEMO_JOB_NAME
    name = re.sub(r"[^a-z0-9]+", "-", f"{model}-{problem}".lower()).strip("-")
    return name[:63].rstrip("-") or DEMO_JOB_NAME


# ---- flags -------------------------------------------------------------------------------------------


def add_job_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Every field's flags on ``parser`` (each field's value lands under its name, None where the
    flag is absent), in two groups; returns the group of the original main.py's flags."""
    original = parser.add_argument_group("job: the original main.py flags (dashes or underscores)")
    new = parser.add_argument_group("job: the new fields")
    for field in FIELDS:
        group = original if field.original_flag else new
        group.add_argument(*field_flags(field), dest=field.name, default=None, **_flag_kwargs(field))
    return original


def field_flags(field: Field) -> list[str]:
    """A field's flags: its own (the original's spelling where it had one), then its name's; a
    switch (--pin-cores / --no-pin-cores) only with dashes."""
    if field.type == "boolean":
        return [field.flag]
    return flag_aliases(field.flag, "--" + field.name.replace("_", "-"))


def flag_aliases(*flags: str) -> list[str]:
    """Each flag with dashes and with underscores (the original main.py used both spellings)."""
    names: list[str] = []
    for flag in flags:
        for name in (flag, "--" + flag[2:].replace("-", "_")):
            if name not in names:
                names.append(name)
    return names


def params_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The raw params the user gave by flag (absent flags, and fields the command has no flag for,
    are left to JobSpec's defaults)."""
    params: dict[str, Any] = {}
    for field in FIELDS:
        value = getattr(args, field.name, None)
        if value is not None:
            params[field.name] = value
    if params.get("usr_dir") and os.path.exists(params["usr_dir"]):
        # Whatever runs the job (Airflow's tasks, the cluster) does not run in this shell's folder.
        params["usr_dir"] = os.path.abspath(params["usr_dir"])
    return params


def _flag_kwargs(field: Field) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": field.description.replace("%", "%%")}
    if field.type == "boolean":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif field.repeat_flag:
        kwargs["action"] = "append"
    elif field.type == "array":
        kwargs["nargs"] = "+"
    # No argparse choices: JobSpec names the field and its accepted values in one line.
    if field.metavar:
        kwargs["metavar"] = field.metavar
    return kwargs


# ---- the flags of `syncswitch train` -----------------------------------------------------------------

# The job fields `syncswitch train` takes for its one segment, each with that command's own spellings
# besides the field's flags. Its other flags (the segment's index and target, the launcher's folders)
# are no job fields.
TRAIN_FIELDS: dict[str, tuple[str, ...]] = {
    "num_workers": ("--workers",),
    "num_ps": ("--ps",),
    "problem": (),
    "model": (),
    "hparam_set": (),
    "usr_dir": ("--usr-dir", "--t2t-usr-dir"),
    "hooks": (),
    "hparams": (),
    "data_dir": (),
    "total_steps": (),
    "ckpt_frequency": (),
    "momentum_rule": (),
    "momentum_ramp_steps": (),
    "stragglers": (),
    "pin_cores": (),
    "seed": (),
    "evaluate_checkpoints": ("--eval-checkpoints",),
    "stall_seconds": (),
}
_ARGPARSE_TYPES = {"integer": int, "number": float, "string": str}


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``syncswitch train`` for TRAIN_FIELDS: the command's spellings and the field's own
    flags, typed by the field, with one value for a per-segment array field (the segment's). Each
    value lands under the field's name, None where the flag is absent."""
    for name, spellings in TRAIN_FIELDS.items():
        field = FIELDS_BY_NAME[name]
        flags = list(dict.fromkeys([*spellings, *field_flags(field)]))
        parser.add_argument(*flags, dest=field.name, default=None, **_train_flag_kwargs(field))


def _train_flag_kwargs(field: Field) -> dict[str, Any]:
    kwargs = _flag_kwargs(field)
    kwargs.pop("nargs", None)  # one segment's value of a per-segment array
    if field.type != "boolean":
        kwargs["type"] = _ARGPARSE_TYPES[field.items or field.type]
    if field.choices:
        # No JobSpec checks a segment's fields: argparse names the flag and the accepted values.
        kwargs["choices"] = field.choices
    return kwargs
