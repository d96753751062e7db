"""The ``sync_switch`` DAG's params: one Airflow Param per JobSpec field, JSON-schema typed.

The schema renders the Trigger form (selects for enums, number fields with minimums) and rejects
malformed conf before a run is created (REST answers 400 naming the param). Cross-field rules (e.g.
three switch-order digits but two step counts) need the whole job; ``JobSpec.from_params`` checks them
in the DAG's validate task.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from airflow.sdk import Param
from syncswitch import plan as plans
from syncswitch.registry import REGISTRY
from syncswitch.spec import (
    MOMENTUM_RULES,
    ONLINE_POLICIES,
    TIMING_POLICIES,
    JobSpec,
)

from syncswitch_airflow import settings

# Four k=v pairs; JobSpec.from_params checks the keys and values and names what is wrong.
STRAGGLER_PATTERN = r"^(\s*\w+\s*=\s*[^,=\s]+\s*,){3,4}\s*\w+\s*=\s*[^,=\s]+\s*$"


def default_bucket_dir(project_dir: str | Path) -> str:
    """``[syncswitch] bucket_dir``, else ``<project>/runs``."""
    return settings.get("bucket_dir") or str(Path(project_dir).resolve() / "runs")


def _enum(value: str, choices: Any, title: str, description: str) -> Param:
    return Param(value, type="string", enum=list(choices), title=title, description=description)


def _registered(value: str, kind: str, title: str, description: str) -> Param:
    """A registered name: the form proposes every name the registry knows here (built-ins, entry
    points, and a job file's usr_dir once loaded) and accepts others, since a run's usr_dir may
    register names this process has never imported; the validate task checks them."""
    names = REGISTRY.names(kind)
    examples = names if value in names else [value, *names]
    return Param(value, type="string", minLength=1, examples=examples, title=title, description=description)


def _int(value: int, title: str, description: str, minimum: int, maximum: int | None = None) -> Param:
    bounds = {"minimum": minimum} | ({"maximum": maximum} if maximum is not None else {})
    return Param(value, type="integer", title=title, description=description, **bounds)


def _int_array(value: tuple[int, ...], title: str, description: str, minimum: int) -> Param:
    return Param(
        list(value),
        type="array",
        items={"type": "integer", "minimum": minimum},
        title=title,
        description=description,
    )


def build_params(bucket_dir: str, defaults: JobSpec | None = None) -> dict[str, Param]:
    """One Param per JobSpec field, defaulting to ``defaults`` (a recurring job's settings) or to
    JobSpec() (the embedded digits demo), with ``bucket_dir`` as the bucket folder."""
    d = defaults or JobSpec()
    params = {
        "job_name": Param(
            d.job_name,
            type="string",
            pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
            title="Job name",
            description="Names the run folder <bucket_dir>/<job_name>/<run_id>/: lowercase letters, "
            "digits and '-'.",
        ),
        "switch_order": Param(
            d.switch_order,
            type="string",
            pattern=r"^[01]+$",
            title="Switch order",
            description="One digit per segment: 1 = BSP (synchronous), 0 = ASP (asynchronous). "
            "'10' trains BSP, then switches to ASP.",
        ),
        "train_steps": _int_array(
            d.train_steps,
            "Steps per segment",
            "BSP-equivalent steps for each segment, as in the original (one per switch_order digit). "
            "Leave empty to split total_steps by bsp_fraction.",
            minimum=1,
        ),
        "total_steps": _int(
            d.total_steps,
            "Total steps",
            "The whole workload in BSP-equivalent steps (used when train_steps is empty).",
            minimum=1,
        ),
        "bsp_fraction": Param(
            d.bsp_fraction,
            type="number",
            minimum=0,
            maximum=1,
            title="BSP fraction",
            description="Share of total_steps trained with BSP (split evenly over the BSP segments).",
        ),
        "ckpt_frequency": _int_array(
            d.ckpt_frequency,
            "Checkpoint frequency",
            "Steps between checkpoints, one value for all segments or one per segment "
            "(0 = only at segment end).",
            minimum=0,
        ),
        "hparams": Param(
            list(d.hparams),
            type="array",
            items={"type": "string"},
            title="Hyper-parameter overrides",
            description="k=v,k=v overrides of hparam_set (tensor2tensor names), one string for all "
            "segments or one per segment.",
        ),
        "num_workers": _int(d.num_workers, "Workers", "Training workers in the cluster.", 1, 64),
        "num_ps": _int(d.num_ps, "Parameter servers", "Parameter servers (used by ASP segments).", 1, 16),
        "model": _registered(
            d.model,
            "model",
            "Model",
            "A registered model: cnn for digits, resnet for the CIFAR problems, or one of usr_dir's.",
        ),
        "hparam_set": _registered(
            d.hparam_set, "hparams", "Hyper-parameter set", "A registered set for the model."
        ),
        "problem": _registered(d.problem, "problem", "Problem", "A registered problem (dataset)."),
        "usr_dir": Param(
            d.usr_dir or None,
            type=["null", "string"],
            title="User code",
            description="A package folder, .py file or module name that registers models, problems "
            "and hparam sets (tensor2tensor's t2t_usr_dir); checked on one batch before provisioning. "
            "See docs/bring-your-own-model.md.",
        ),
        "data_dir": Param(
            # Optional: an empty required string would keep the Trigger form from submitting.
            d.data_dir or None,
            type=["null", "string"],
            title="Data folder",
            description="Local folder or gs:// URI with the dataset (needed by image_cifar10/100; "
            "may be a template, e.g. gs://bucket/cifar/{{ ds }}). Empty for the bundled digits.",
        ),
        "bucket_dir": Param(
            bucket_dir,
            type="string",
            minLength=1,
            title="Bucket folder",
            description="Where run folders go: a local folder, or gs://bucket/prefix for GCS.",
        ),
        "cluster_backend": _enum(
            d.cluster_backend,
            REGISTRY.names("backend"),
            "Cluster backend",
            "Where the training processes run: local (this machine), hosts (the hosts below, over SSH) "
            "or gce (Compute Engine VMs created for the run, see gce).",
        ),
        "hosts": Param(
            [h.to_text() for h in d.hosts],
            type="array",
            items={"type": "string", "minLength": 1},
            title="Hosts",
            description="cluster_backend hosts: one item per host, address=10.0.0.2,key=/path/to/ssh-key "
            "[,user=root,port=22,role=chief|worker|ps,python=/venv/bin/python,name=h1]. The key is a path on "
            "the Airflow worker; its contents never leave it. Needs a gs:// bucket_dir.",
        ),
        "gce": Param(
            d.gce.to_params() if d.gce else {},
            type="object",
            title="Compute Engine",
            description="cluster_backend gce: {project, zones (one, or one per worker), machine_types, gpus "
            "(e.g. [k80, k80, p100, v100:2] or none), ps_machine_type, spot (roles: worker, ps), network, "
            "subnetwork, image, python, ssh_user, max_run_seconds, on_revocation (replace|shrink), disk_gb}. "
            "The chief VM (worker 0) is always on-demand. Needs a gs:// bucket_dir.",
        ),
        "momentum_rule": _enum(
            d.momentum_rule,
            MOMENTUM_RULES,
            "Momentum rule",
            "Momentum after a switch to ASP: keep, zero, scaled (m/N) or ramped (m/N back up to m).",
        ),
        "momentum_ramp_steps": _int(
            d.momentum_ramp_steps, "Momentum ramp steps", "Steps of the 'ramped' rule.", 0
        ),
        "online_policy": _enum(
            d.online_policy,
            ONLINE_POLICIES,
            "Online policy",
            "Reaction to stragglers: none, greedy (ASP while one persists) or elastic (switch only "
            "when it pays off).",
        ),
        "max_online_switches": _int(
            d.max_online_switches,
            "Max online switches",
            f"Cap on switches added at run time; planned segments + this must be <= {plans.MAX_SEGMENTS}.",
            0,
            plans.MAX_SEGMENTS - 1,
        ),
        "stragglers": Param(
            [s.to_text() for s in d.stragglers],
            type="array",
            items={"type": "string", "pattern": STRAGGLER_PATTERN},
            title="Injected stragglers",
            description="One item per slow worker: worker=1,start=20,duration=60,slowdown=4 (CPU: times "
            "slower) or worker=1,start=20,duration=60,delay_ms=30 (network: ms added to every round trip "
            "of the worker's link; hosts or gce backends), optionally every=120 to repeat; seconds after "
            "the first BSP segment starts.",
        ),
        "seed": _int(d.seed, "Seed", "Random seed.", 0),
        "pin_cores": Param(
            d.pin_cores, type="boolean", title="Pin cores", description="Pin each process to one core."
        ),
        "evaluate_checkpoints": Param(
            d.evaluate_checkpoints,
            type="boolean",
            title="Evaluate every checkpoint",
            description="Test accuracy at every checkpoint: an accuracy-over-time curve, and time to a "
            "target accuracy in comparisons (its seconds are subtracted from training time).",
        ),
        "stall_seconds": Param(
            d.stall_seconds,
            type="number",
            minimum=10,
            title="Stall limit (s)",
            description="A segment whose global step does not move for this long (or for 20x its usual "
            "time between steps, if longer) is stopped and retried from its last checkpoint.",
        ),
        "timing_policy": _enum(
            d.timing_policy,
            TIMING_POLICIES,
            "Timing policy",
            "fixed: train bsp_fraction as given. search: the job's history chooses it (BSP baseline runs, "
            "then a halving search 0.5, 0.25, ... accepted while accuracy holds, then the smallest "
            "accepted fraction); needs switch_order '10'.",
        ),
        "timing_repeats": _int(d.timing_repeats, "Timing: runs per candidate", "k runs of each fraction.", 1),
        "timing_tolerance": Param(
            d.timing_tolerance,
            type="number",
            minimum=0,
            title="Timing: accuracy tolerance",
            description="A fraction is accepted while its mean accuracy >= the BSP baseline's mean - this.",
        ),
        "timing_floor": Param(
            d.timing_floor,
            type="number",
            exclusiveMinimum=0,
            maximum=0.5,
            title="Timing: smallest fraction",
            description="The search stops below this BSP fraction.",
        ),
        "timing_refine": _int(
            d.timing_refine, "Timing: refinement steps", "Bisections after the first rejection (0 = off).", 0
        ),
        "evaluate_segments": Param(
            d.evaluate_segments,
            type="boolean",
            title="Evaluate each segment",
            description="Test accuracy at the end of every segment, not only the final one.",
        ),
    }
    fields = {f.name for f in dataclasses.fields(JobSpec)}
    if set(params) != fields:  # a JobSpec field added without its Param would be unreachable
        raise RuntimeError(f"DAG params and JobSpec fields differ: {sorted(set(params) ^ fields)}")
    return params
