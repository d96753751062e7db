"""``syncswitch run``: flag parsing (the original main.py flags and the new ones), bad input, progress.

Bad input must fail fast: exit 2, one line on stderr naming the field, nothing started (no Airflow
home created, no run folder); these run the real ``syncswitch`` console script in a subprocess.
Progress is read from a real run folder written with the events and state contracts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from syncswitch.events import EventWriter
from syncswitch.fields import params_from_flags
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec, StragglerSpec
from syncswitch.state import update_state
from syncswitch_airflow.tools.cli import ProgressPrinter, build_parser, dag_conf, parse

SYNCSWITCH = Path(sys.executable).parent / "syncswitch"

ORIGINAL_ARGV = [
    *("--job-name", "cifar-switch", "--num-ps", "2", "--num-worker", "4"),
    *("--bucket-dir", "gs://bucket/experiments", "--model", "resnet", "--hparam-set", "resnet_cifar_32"),
    *("--problem", "image_cifar10", "--data-dir", "gs://bucket/cifar10"),
    *("--train-steps", "1000", "3000", "--ckpt-frequency", "500", "1000"),
    *("--cluster-name", "sync-cluster", "--eval-name", "sync-eval", "--switch-order", "10"),
    *("--hparams", "learning_rate=0.4", "learning_rate=0.1,batch_size=64"),
]


def test_original_flags_map_to_conf_fields() -> None:
    conf = params_from_flags(build_parser().parse_args(ORIGINAL_ARGV))
    assert conf == {
        "job_name": "cifar-switch",
        "num_ps": "2",
        "num_workers": "4",
        "bucket_dir": "gs://bucket/experiments",
        "model": "resnet",
        "hparam_set": "resnet_cifar_32",
        "problem": "image_cifar10",
        "data_dir": "gs://bucket/cifar10",
        "train_steps": ["1000", "3000"],
        "ckpt_frequency": ["500", "1000"],
        "switch_order": "10",
        "hparams": ["learning_rate=0.4", "learning_rate=0.1,batch_size=64"],
    }


def test_underscore_spellings_of_the_original_flags_are_the_same_flags() -> None:
    underscored = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in ORIGINAL_ARGV]
    assert params_from_flags(build_parser().parse_args(underscored)) == params_from_flags(
        build_parser().parse_args(ORIGINAL_ARGV)
    )


def test_original_flags_validate_into_a_per_segment_plan() -> None:
    spec, options, notes = parse(ORIGINAL_ARGV)
    assert (spec.num_workers, spec.num_ps) == (4, 2)
    assert spec.train_steps == (1000, 3000)
    assert spec.ckpt_frequency == (500, 1000)
    plan = spec.plan("run-1", "gs://bucket/experiments/cifar-switch/run-1")
    assert [(s.protocol, s.until_step, s.ckpt_frequency, s.hparams) for s in plan] == [
        ("bsp", 1000, 500, "learning_rate=0.4"),
        ("asp", 4000, 1000, "learning_rate=0.1,batch_size=64"),
    ]
    # --cluster-name and --eval-name are accepted, and each gets a note saying it is ignored.
    assert len(notes) == 2 and "--cluster-name" in notes[0] and "--eval-name" in notes[1]
    assert not options.keep_ui and not options.json_only
    # A gs:// bucket goes to the DAG untouched.
    assert dag_conf(spec)["bucket_dir"] == "gs://bucket/experiments"


def test_new_flags_map_to_job_fields() -> None:
    spec, _options, _notes = parse(
        [
            *("--total-steps", "1000", "--bsp-fraction", "0.3", "--momentum-rule", "zero"),
            *("--online-policy", "greedy", "--max-online-switches", "3", "--cluster-backend", "local"),
            *("--seed", "7", "--straggler", "worker=1,start=20,duration=60,slowdown=4"),
            *("--straggler", "worker=0,start=90,duration=10,slowdown=2"),
        ]
    )
    assert (spec.total_steps, spec.bsp_fraction, spec.momentum_rule) == (1000, 0.3, "zero")
    assert (spec.online_policy, spec.max_online_switches, spec.seed) == ("greedy", 3, 7)
    assert spec.stragglers == (StragglerSpec(1, 20.0, 60.0, 4.0), StragglerSpec(0, 90.0, 10.0, 2.0))
    assert spec.segment_steps() == [300, 700]


def test_host_flags_select_the_hosts_backend() -> None:
    spec, _options, _notes = parse(
        [
            *("--cluster-backend", "hosts", "--bucket-dir", "gs://b/runs"),
            *("--host", "address=10.0.0.10,key=/keys/id,role=chief"),
            *("--host", "address=10.0.0.11,key=/keys/id,user=train,port=2222"),
        ]
    )
    assert spec.cluster_backend == "hosts"
    assert [(h.address, h.role, h.user, h.port) for h in spec.hosts] == [
        ("10.0.0.10", "chief", "root", 22),
        ("10.0.0.11", "any", "train", 2222),
    ]
    assert JobSpec.from_params(dag_conf(spec)) == spec  # the DAG's conf carries the hosts through


def test_the_gce_flag_carries_the_gpu_and_zone_arrays_through_the_dag_conf() -> None:
    spec, _options, _notes = parse(
        [
            *("--cluster-backend", "gce", "--bucket-dir", "gs://b/runs", "--num-worker", "4"),
            *(
                "--gce",
                "project=sync-proj-1;zones=us-central1-a us-central1-b us-west1-b us-east1-c;"
                "gpus=t4 t4 p100 v100",
            ),
        ]
    )
    assert spec.gce is not None and spec.gce.zones[3] == "us-east1-c"
    assert [g.type for g in spec.gce.gpus] == ["nvidia-tesla-t4"] * 2 + [
        "nvidia-tesla-p100",
        "nvidia-tesla-v100",
    ]
    assert JobSpec.from_params(dag_conf(spec)) == spec


def test_no_flags_is_the_default_job_with_an_absolute_local_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec, options, notes = parse([])
    assert spec == JobSpec()
    assert notes == []
    conf = dag_conf(spec)
    # Airflow's tasks run elsewhere: the default relative bucket must point where the user ran the CLI.
    assert conf["bucket_dir"] == str(tmp_path / "runs")
    assert JobSpec.from_params(conf) == JobSpec(bucket_dir=str(tmp_path / "runs"))
    assert options.airflow_home is None


def test_a_user_models_run_is_named_after_its_model_and_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--usr-dir or --model without --job-name: the run folder is runs/<model>-<problem>/, never the
    demo's runs/digits-demo/ (and its history); the conf carries the name, so the DAG agrees."""
    monkeypatch.chdir(tmp_path)
    example = Path(__file__).resolve().parents[1] / "examples" / "mnist1d" / "mnist1d_example"
    names = ["--model", "mnist1d_cnn", "--problem", "mnist1d", "--hparam-set", "mnist1d_cnn"]
    spec, _options, _notes = parse(["--usr-dir", str(example), *names])
    assert spec.job_name == "mnist1d-cnn-mnist1d"
    conf = dag_conf(spec)
    assert conf["job_name"] == "mnist1d-cnn-mnist1d" == JobSpec.from_params(conf).job_name
    resnet, _options, _notes = parse(
        ["--model", "resnet", "--problem", "synthetic_cifar", "--hparam-set", "resnet_cifar_20"]
    )
    assert resnet.job_name == "resnet-synthetic-cifar"
    named, _options, _notes = parse(["--usr-dir", str(example), *names, "--job-name", "mine"])
    assert named.job_name == "mine"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--switch-order", "12"], "switch_order"),
        (["--switch-order", "101", "--train-steps", "100", "200"], "train_steps"),
        (["--train-steps", "ten", "twenty"], "train_steps"),
        (["--model", "vgg"], "model"),
        (["--hparams", "learning_rate"], "hparams"),
        (["--hparams", "no_such_key=1"], "hparams"),
        (["--straggler", "worker=1,start=20"], "straggler"),
        (["--straggler", "worker=1,start=2,duration=5,slowdown=2,delay_ms=30"], "straggler"),
        (["--straggler", "worker=1,start=2,duration=5,delay_ms=-3"], "straggler"),
        (["--straggler", "worker=1,start=2,duration=5,delay_ms=30,every=4"], "straggler"),
        (["--straggler", "worker=1,start=2,duration=5,delay_ms=30"], "stragglers"),  # a local cluster
        (["--straggler", "worker=5,start=0,duration=10,slowdown=2"], "stragglers"),
        (["--num-worker", "0"], "num_workers"),
        (["--bsp-fraction", "1.5"], "bsp_fraction"),
        (["--job-name", "Bad_Name"], "job_name"),
        # More segments than the DAG has slots for: the DAG's limit, checked before Airflow starts.
        (["--switch-order", "101", "--max-online-switches", "4"], "max_online_switches"),
        (["--no-such-flag", "1"], "--no-such-flag"),
        (["--cluster-backend", "hosts", "--host", "address=10.0.0.2,key=/k"], "bucket_dir"),
        (["--cluster-backend", "hosts", "--host", "address=10.0.0.2,role=boss"], "hosts"),
        (
            ["--cluster-backend", "gce", "--gce", "project=sync-proj-1;zones=us-central1-a;gpus=h100"],
            "gce.gpus",
        ),
    ],
)
def test_bad_input_fails_fast_naming_the_field(args: list[str], field: str, tmp_path: Path) -> None:
    home, runs = tmp_path / "airflow-home", tmp_path / "runs"
    result = subprocess.run(
        [str(SYNCSWITCH), "run", "--airflow-home", str(home), "--bucket-dir", str(runs), *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one clear line, no traceback
    assert field in lines[0] and lines[0].startswith("syncswitch run: error:")
    assert result.stdout == ""
    # Nothing started: start() creates the Airflow home first thing, and a run creates its folder.
    assert not home.exists()
    assert not runs.exists()


def test_progress_follows_the_plan_through_the_run_folder(tmp_path: Path) -> None:
    layout = RunLayout(str(tmp_path / "run"))
    plan = [
        {"index": 0, "protocol": "bsp", "until_step": 30, "origin": "plan"},
        {"index": 1, "protocol": "asp", "until_step": 120, "origin": "plan"},
    ]
    update_state(layout, lambda s: s.update(plan=plan, segments={}))
    lines: list[str] = []
    progress = ProgressPrinter(layout, 120, lines.append, time.monotonic())
    progress.update()
    assert lines == []  # planned, nothing trained yet

    def writer(index: int, protocol: str, role: str) -> EventWriter:
        path = layout.segment_events(index, protocol, role, 0)
        return EventWriter(path, run_id="r", segment=index, protocol=protocol, role=role, task=0)

    # BSP: worker 0 is the chief. It logs every few steps, then ends exactly at its target.
    with writer(0, "bsp", "worker") as bsp:
        bsp.emit("step", global_step=20.0, loss=0.9, examples_per_sec=300.0)
        bsp.emit("segment_end", global_step=30.0, examples_per_sec=310.0, reason="reached until_step")
    update_state(layout, lambda s: s["segments"].update({"0": {"end_step": 30}}))
    with writer(1, "asp", "chief") as asp:
        asp.emit("step", global_step=45.5, loss=0.5, examples_per_sec=250.0)
        progress.update()
        asp.emit("step", global_step=50.0, loss=0.4, examples_per_sec=250.0)
        progress.update()  # within the print interval: no new line for the same segment
        assert lines == [
            lines[0].split("]")[0] + "] segment 0 BSP  ended at step 30/120  310 examples/s"
            "  (reached until_step)  last loss 0.9000 at step 20",
            lines[1].split("]")[0] + "] segment 1 ASP  step 45.5/120  loss 0.5000  250 examples/s",
        ]
        asp.emit("segment_end", global_step=120.0, examples_per_sec=260.0, reason="reached until_step")
    progress.update()  # an end is shown at once, whatever the interval
    assert lines[2].endswith(
        "segment 1 ASP  ended at step 120/120  260 examples/s  (reached until_step)"
        "  last loss 0.4000 at step 50"
    )
    progress.update()
    assert len(lines) == 3


def test_stop_ui_without_an_airflow_home_says_so_and_creates_nothing(tmp_path: Path) -> None:
    home = tmp_path / "never-started"
    result = subprocess.run(
        [str(SYNCSWITCH), "run", "--airflow-home", str(home), "--stop-ui"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "no embedded Airflow" in result.stderr and "Traceback" not in result.stderr
    assert not home.exists()


def test_syncswitch_help_lists_every_command_and_an_unknown_one_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from syncswitch import cli as runtime_cli

    assert runtime_cli.main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(["train", "check", "registry", *runtime_cli.PIPELINE_COMMANDS])
    assert runtime_cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "  train " in err
