"""The job's field table (syncswitch.fields) against what is generated from it: every field can be set
from every entry point (the DAG's Params, REST conf, ``syncswitch run`` flags) to the same JobSpec, and
the Params' schema and JobSpec's checks accept and reject the same bounds."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from airflow.sdk.definitions.param import ParamValidationError
from syncswitch.fields import FIELDS, FIELDS_BY_NAME, Field, field_flags
from syncswitch.spec import JobSpec, SpecError
from syncswitch_airflow.dag_params import build_params, field_param
from syncswitch_airflow.tools.cli import parse

HOSTS = ["address=10.0.0.2,key=/k", "address=10.0.0.3,key=/k"]
STRAGGLERS = ["worker=1,start=2,duration=3,slowdown=4"]
# A value other than the default for every field, as conf (JSON) and as flag arguments, with the
# other fields it needs to be valid.
SAMPLES: dict[str, tuple[Any, list[str], dict[str, Any]]] = {
    "job_name": ("nightly-7", ["nightly-7"], {}),
    "switch_order": ("101", ["101"], {}),
    "train_steps": ([10, 20], ["10", "20"], {}),
    "total_steps": (900, ["900"], {}),
    "bsp_fraction": (0.5, ["0.5"], {}),
    "ckpt_frequency": ([5, 0], ["5", "0"], {"train_steps": [10, 20]}),
    "hparams": (["batch_size=8", ""], ["batch_size=8", ""], {"train_steps": [10, 20]}),
    "num_workers": (3, ["3"], {}),
    "num_ps": (2, ["2"], {}),
    "model": ("resnet", ["resnet"], {"problem": "synthetic_cifar", "hparam_set": "resnet_cifar_20"}),
    "hparam_set": ("resnet_cifar_32", ["resnet_cifar_32"], {"model": "resnet", "problem": "synthetic_cifar"}),
    "problem": ("synthetic_cifar", ["synthetic_cifar"], {"model": "resnet", "hparam_set": "resnet_cifar_20"}),
    "usr_dir": ("examples.mnist1d", ["examples.mnist1d"], {}),
    "hooks": (["notify", "copy"], ["notify", "copy"], {"usr_dir": "examples.mnist1d"}),
    "data_dir": ("gs://data/digits", ["gs://data/digits"], {}),
    "bucket_dir": ("gs://bucket/runs", ["gs://bucket/runs"], {}),
    "cluster_backend": ("hosts", ["hosts"], {"hosts": HOSTS, "bucket_dir": "gs://b/r"}),
    "hosts": (HOSTS, HOSTS, {"cluster_backend": "hosts", "bucket_dir": "gs://b/r"}),
    "hosts_per_cluster": (1, ["1"], {"cluster_backend": "hosts", "hosts": HOSTS, "bucket_dir": "gs://b/r"}),
    "gce": (
        {"project": "sync-proj-1", "zones": ["us-central1-a"]},
        ["project=sync-proj-1;zones=us-central1-a"],
        {"cluster_backend": "gce", "bucket_dir": "gs://b/r"},
    ),
    "momentum_rule": ("scaled", ["scaled"], {}),
    "momentum_ramp_steps": (7, ["7"], {}),
    "online_policy": ("greedy", ["greedy"], {}),
    "online_protocol": ("ssp:4", ["ssp:4"], {}),
    "max_online_switches": (3, ["3"], {}),
    "stragglers": (
        ["worker=1,start=2,duration=3,slowdown=4"],
        ["worker=1,start=2,duration=3,slowdown=4"],
        {},
    ),
    "seed": (11, ["11"], {}),
    "pin_cores": (True, [], {}),
    "evaluate_checkpoints": (True, [], {}),
    "stall_seconds": (45.0, ["45"], {}),
    "segment_retries": (4, ["4"], {}),
    "timing_policy": ("search", ["search"], {}),
    "timing_protocols": (["asp", "ssp:4"], ["asp", "ssp:4"], {"timing_policy": "search"}),
    "timing_repeats": (2, ["2"], {}),
    "timing_tolerance": (0.01, ["0.01"], {}),
    "timing_floor": (0.125, ["0.125"], {}),
    "timing_refine": (1, ["1"], {}),
    "evaluate_segments": (False, [], {}),
}


def test_the_table_has_every_jobspec_field_once() -> None:
    names = [field.name for field in FIELDS]
    assert len(names) == len(set(names))
    assert set(names) == {f.name for f in dataclasses.fields(JobSpec)}
    assert set(SAMPLES) == set(names)


def test_the_params_are_the_table_in_its_order() -> None:
    params = build_params("/bucket")
    assert list(params) == [field.name for field in FIELDS]
    for field in FIELDS:
        assert params[field.name].schema.get("title") == field.title
        assert params[field.name].description == field.description


def _argv(field: Field, cli_values: list[str], value: Any) -> list[str]:
    flag = field_flags(field)[0]
    if field.type == "boolean":
        return [flag if value else "--no-" + flag[2:]]
    if field.repeat_flag:
        return [arg for item in cli_values for arg in (flag, item)]
    return [flag, *cli_values]


def _companion_argv(companions: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in companions.items():
        field = FIELDS_BY_NAME[name]
        items = [str(v) for v in value] if isinstance(value, list) else [str(value)]
        argv += _argv(field, items, value)
    return argv


@pytest.mark.parametrize("name", list(SAMPLES))
def test_every_field_is_set_alike_by_conf_by_flag_and_through_its_param(name: str) -> None:
    field = FIELDS_BY_NAME[name]
    value, cli_values, companions = SAMPLES[name]
    from_conf = JobSpec.from_params({**companions, name: value})
    assert getattr(from_conf, name) != getattr(JobSpec(), name)
    # The Trigger form / REST conf: the Param's schema accepts the value as given.
    param = build_params("/bucket")[name]
    param.resolve(value)
    # syncswitch run: the field's own flag.
    spec, _options, _notes = parse([*_companion_argv(companions), *_argv(field, cli_values, value)])
    assert spec == from_conf


def _bound_cases() -> list[tuple[str, Any, bool]]:
    cases: list[tuple[str, Any, bool]] = []
    for field in FIELDS:
        step = 1 if field.type == "integer" or field.items == "integer" else 0.001
        wrap = (lambda v: [v]) if field.type == "array" else (lambda v: v)
        if field.minimum is not None:
            cases.append((field.name, wrap(field.minimum - step), False))
            cases.append((field.name, wrap(field.minimum), not field.exclusive_minimum))
        if field.maximum is not None:
            cases.append((field.name, wrap(field.maximum), True))
            cases.append((field.name, wrap(field.maximum + step), False))
        for choice in field.choices:
            cases.append((field.name, choice, True))
        if field.choices:
            cases.append((field.name, "no-such-" + field.choices[0], False))
    return cases


# What a bound value needs beside it to be a valid job (the cross-field rules are not the point here).
BOUND_COMPANIONS = {
    "train_steps": {"switch_order": "1"},
    "total_steps": {"switch_order": "1"},
    "max_online_switches": {"switch_order": "1"},
}


@pytest.mark.parametrize(("name", "value", "accepted"), _bound_cases())
def test_the_param_and_jobspec_agree_on_each_bound(name: str, value: Any, accepted: bool) -> None:
    field = FIELDS_BY_NAME[name]
    param = field_param(field, value)
    params = {**BOUND_COMPANIONS.get(name, {}), name: value}
    if accepted:
        param.resolve(value)
        JobSpec.from_params(params)
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)
        with pytest.raises(SpecError) as rejected:
            JobSpec.from_params(params)
        assert rejected.value.field == name


def test_syncswitch_train_takes_its_job_fields_by_the_tables_flags(tmp_path: Any) -> None:
    """`syncswitch train`'s flags for job fields come from the table: each field's own flags set it,
    beside the command's short spellings, and mean the same."""
    from syncswitch.cli import build_train_parser, spec_from_args
    from syncswitch.fields import TRAIN_FIELDS

    parser = build_train_parser()
    for name, spellings in TRAIN_FIELDS.items():
        for flag in [*spellings, *field_flags(FIELDS_BY_NAME[name])]:
            assert parser._option_string_actions[flag].dest == name, flag
    base = ["--run-dir", str(tmp_path), "--segment-index", "0"]
    short = spec_from_args(parser.parse_args([*base, "--workers", "3", "--ps", "2", "--eval-checkpoints"]))
    long = spec_from_args(
        parser.parse_args([*base, "--num_workers", "3", "--num-ps", "2", "--evaluate-checkpoints"])
    )
    assert short == long and (short.num_workers, short.num_ps, short.evaluate_checkpoints) == (3, 2, True)


MNIST1D = {
    "usr_dir": "examples.mnist1d",
    "model": "mnist1d_cnn",
    "problem": "mnist1d",
    "hparam_set": "mnist1d_cnn",
}
RESNET = {"model": "resnet", "problem": "synthetic_cifar", "hparam_set": "resnet_cifar_20"}


@pytest.mark.parametrize(
    ("params", "job_name"),
    [
        ({}, "digits-demo"),
        (RESNET, "resnet-synthetic-cifar"),
        (MNIST1D, "mnist1d-cnn-mnist1d"),
        ({"usr_dir": "examples.mnist1d"}, "cnn-digits"),  # user code: never the demo's folder
        ({**MNIST1D, "job_name": "nightly-7"}, "nightly-7"),
    ],
)
def test_a_job_without_a_name_is_named_alike_by_conf_form_and_flags(params: dict, job_name: str) -> None:
    """No job_name (absent, null or empty) means <model>-<problem>, the demo's name for the demo alone:
    REST conf, the Trigger form (whose job_name is empty unless a name was chosen) and `syncswitch run`
    name the run alike, so a user's runs never land in the demo's folder and history."""
    assert JobSpec.from_params(params).job_name == job_name
    for empty in (None, ""):
        if "job_name" not in params:
            assert JobSpec.from_params({**params, "job_name": empty}).job_name == job_name
    # The form: an empty job_name by default, which its schema and JobSpec accept, as REST conf's "".
    param = build_params("/bucket")["job_name"]
    assert param.value is None
    param.resolve(None)
    param.resolve("")
    # syncswitch run: no --job-name.
    argv = _companion_argv(params)
    spec, _options, _notes = parse(argv)
    assert spec.job_name == job_name


def test_the_form_shows_a_chosen_job_name_and_leaves_a_derived_one_empty() -> None:
    """A recurring job's (or a deployment's) own name is the form's default; a name that is only the
    model and problem's is left empty, so that changing the model in the form renames the run."""
    chosen = build_params("/bucket", JobSpec.from_params({**RESNET, "job_name": "res20-nightly"}))
    assert chosen["job_name"].value == "res20-nightly"
    derived = build_params("/bucket", JobSpec.from_params(RESNET))
    assert derived["job_name"].value is None
    with pytest.raises(ParamValidationError):
        derived["job_name"].resolve("Bad_Name")
