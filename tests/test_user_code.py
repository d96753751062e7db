"""Bring your own model: the registry, a job's usr_dir, the check before provisioning, and a user
model through the whole DAG (exact handoff, exact steps, export loadable without the project).

User code here is real files in tmp_path, imported for real; each test gives its package a name of
its own, since a process imports a package name once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
from syncswitch import storage, usercode
from syncswitch.check import check_job
from syncswitch.errors import SpecError
from syncswitch.layout import RunLayout
from syncswitch.registry import REGISTRY, RegistrationError, Registry
from syncswitch.spec import JobSpec
from syncswitch.state import read_state

REPO = Path(__file__).resolve().parents[1]
TEXT_EXAMPLE = REPO / "examples" / "text_classifier" / "text_example"
TEXT_JOB = {
    "job_name": "byo-text",
    "usr_dir": str(TEXT_EXAMPLE),
    "model": "text_embedding",
    "problem": "synthetic_text",
    "hparam_set": "text_embedding",
}

# A complete, correct user package: a dense model on 6 features, 3 classes, from numpy data.
GOOD_PROBLEM = """
import numpy as np
import tensorflow as tf
from syncswitch.problems import Problem
from syncswitch.registry import register_problem

@register_problem("{name}_problem")
class Tabular(Problem):
    features = 6

    def arrays(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, 6)).astype("float32")
        return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")

    def train_dataset(self, local_dir, *, batch_size, shard_index, num_shards, seed):
        x, y = tf.autograph.experimental.do_not_convert(self.arrays)()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(num_shards, shard_index)
        return {train_tail}

    def test_dataset(self, local_dir, *, batch_size):
        x, y = self.arrays()
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
"""
GOOD_MODEL = """
import keras
from syncswitch.hparams import HParams
from syncswitch.registry import register_hparams, register_model

@register_model("{name}_model")
def build(hp, problem):
    inputs = keras.Input(shape=({input_width},))
    hidden = keras.layers.Dense(hp.units, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))

@register_hparams("{name}_hparams")
def hparams():
    return HParams(model="{name}_model", batch_size=8, extra={{"units": 4}})
"""

# A model whose call branches in Python on a tensor's value: fine eagerly, not in a traced step.
CONTROL_FLOW_MODEL = """
import keras
from syncswitch.hparams import HParams
from syncswitch.registry import register_hparams, register_model

class Gated(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
    def call(self, x, training=None):
        if keras.ops.sum(x) > 0:
            return self.dense(x)
        return self.dense(-x)

@register_model("control_pkg_model")
def build(hp, problem):
    model = Gated()
    model(keras.ops.ones((1, 6)))
    return model

@register_hparams("control_pkg_hparams")
def hparams():
    return HParams(model="control_pkg_model", batch_size=8, extra={"units": 4})
"""


def write_package(root: Path, name: str, *, problem: str = "", model: str = "", **fields: str) -> Path:
    """A user package ``root/name`` with problem.py and model.py (defaults: the good ones)."""
    values = {
        "name": name,
        "train_tail": "ds.repeat().batch(batch_size, drop_remainder=True)",
        "input_width": "6",
    }
    values.update(fields)
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"from {name} import model, problem  # noqa: F401\n")
    (package / "problem.py").write_text(problem or GOOD_PROBLEM.format(**values))
    (package / "model.py").write_text(model or GOOD_MODEL.format(**values))
    return package


def job_of(package: Path, **changes: object) -> JobSpec:
    name = package.name
    params = {
        "usr_dir": str(package),
        "model": f"{name}_model",
        "problem": f"{name}_problem",
        "hparam_set": f"{name}_hparams",
        **changes,
    }
    return JobSpec.from_params(params)


# ---- the registry ---------------------------------------------------------------------------------


def test_built_in_names_are_listed_without_importing_tensorflow() -> None:
    code = (
        "import sys; from syncswitch.registry import REGISTRY; "
        "print(REGISTRY.names('model'), REGISTRY.names('problem'), REGISTRY.names('hparams')); "
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "'cnn', 'resnet'" in done.stdout and "'digits'" in done.stdout and "'cnn_digits'" in done.stdout


def test_installed_entry_points_register_names_like_built_ins(tmp_path: Path) -> None:
    """A real distribution's metadata (a .dist-info folder on sys.path) with entry points."""
    package = write_package(tmp_path / "site", "entrypkg")
    dist_info = tmp_path / "site" / "entrypkg-1.2.3.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: entrypkg\nVersion: 1.2.3\n")
    (dist_info / "entry_points.txt").write_text(
        "[syncswitch.models]\nentry_model = entrypkg.model:build\n"
        "[syncswitch.hparams]\nentry_hparams = entrypkg.model:hparams\n"
    )
    sys.path.insert(0, str(package.parent))
    try:
        registry = Registry()
        assert "entry_model" in registry.names("model") and "resnet" in registry.names("model")
        assert registry.sources()["model"]["entry_model"] == "entry point of entrypkg 1.2.3"
        assert registry.get("hparams", "entry_hparams").units == 4
    finally:
        sys.path.remove(str(package.parent))


def test_one_name_registered_twice_names_both_sources(tmp_path: Path) -> None:
    first = write_package(tmp_path / "a", "twice_a")
    usercode.load(str(first))
    clash = tmp_path / "clash.py"
    clash.write_text(
        "from syncswitch.registry import register_model\n"
        "@register_model('twice_a_model')\ndef other(hp, problem):\n    return None\n"
    )
    with pytest.raises(SpecError, match=r"twice_a_model.*registered twice.*model\.py.*clash\.py") as error:
        usercode.load(str(clash))
    assert isinstance(error.value.__cause__, RegistrationError)


def test_usr_dir_forms_and_digest(tmp_path: Path) -> None:
    package = write_package(tmp_path, "forms_pkg")
    assert usercode.kind_of(str(package)) == "folder"
    assert usercode.load(str(package)) == "forms_pkg"
    assert "forms_pkg_model" in REGISTRY.names("model")
    single = tmp_path / "single_file.py"
    single.write_text(
        "from syncswitch.registry import register_problem\n"
        "from syncswitch.problems import Problem\n"
        "@register_problem('single_file_problem')\nclass P(Problem):\n    pass\n"
    )
    usercode.load(str(single))
    assert REGISTRY.entry("problem", "single_file_problem").source == str(single)
    assert usercode.kind_of("json") == "module"
    with pytest.raises(SpecError, match=r"^usr_dir: 'no_such_module_x' is neither a folder"):
        usercode.kind_of("no_such_module_x")

    before = usercode.digest(str(package))
    (package / "model.py").write_text((package / "model.py").read_text() + "\n# changed\n")
    assert usercode.digest(str(package)) != before
    (package / "__pycache__").mkdir(exist_ok=True)
    (package / "__pycache__" / "x.pyc").write_bytes(b"ignored")
    assert usercode.digest(str(package)) == usercode.digest(str(package))


def test_a_shipped_copy_imports_where_the_original_is_not_on_the_path(tmp_path: Path) -> None:
    package = write_package(tmp_path / "src", "shipped_pkg")
    uri = str(tmp_path / "bucket" / "usercode.tar.gz")
    usercode.upload(str(package), uri)
    digest = usercode.digest(str(package))
    code = textwrap.dedent(
        f"""
        import sys
        from syncswitch import usercode
        from syncswitch.registry import REGISTRY
        from syncswitch.spec import SegmentSpec
        spec = SegmentSpec(run_id="r", run_dir="x", index=0, protocol="bsp", until_step=1, total_steps=1,
                           model="m", hparam_set="h", problem="p", usr_dir={str(package)!r},
                           usr_code_uri={uri!r}, usr_code_digest={digest!r})
        local = usercode.activate(spec, {str(tmp_path / "host")!r})
        assert local.startswith({str(tmp_path / "host")!r}), local
        assert REGISTRY.entry("model", "shipped_pkg_model").source.startswith(local)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_a_shipped_copy_unpacks_where_tarfile_has_no_extraction_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's venv of a Python before 3.11.4 (Debian 12's 3.11.2, a host's own python3) has no
    tarfile filters: the copy unpacks all the same, and a member that would land outside its folder
    is refused, as the "data" filter refuses it."""
    import io
    import tarfile

    package = write_package(tmp_path / "src", "old_tar_pkg")
    uri = str(tmp_path / "bucket" / "usercode.tar.gz")
    usercode.upload(str(package), uri)
    monkeypatch.delattr(tarfile, "data_filter")
    local = usercode.unpack(uri, str(package), str(tmp_path / "host"), usercode.digest(str(package)))
    assert (Path(local) / "model.py").read_text() == (package / "model.py").read_text()

    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        member = tarfile.TarInfo("../outside.py")
        tar.addfile(member, io.BytesIO(b""))
    storage.write_bytes(uri, evil.getvalue())
    with pytest.raises(SpecError, match=r"usr_dir: .*no file or folder inside it: '../outside.py'"):
        usercode.unpack(uri, str(package), str(tmp_path / "host"), "other-digest")
    assert not (tmp_path / "host" / "outside.py").exists()


# ---- the check before provisioning ----------------------------------------------------------------


def test_a_correct_user_package_passes_the_check(tmp_path: Path) -> None:
    summary = check_job(job_of(write_package(tmp_path, "good_pkg")), str(tmp_path / "cache"))
    assert summary["model"] == "good_pkg_model" and summary["parameters"] == 6 * 4 + 4 + 4 * 3 + 3
    assert summary["test_metrics"] == ["accuracy"] and np.isfinite(summary["loss"])


@pytest.mark.parametrize(
    ("case", "fields", "expected"),
    [
        (
            "syntax",
            {"model": "def build(hp, problem)\n    return None\n"},
            r"^usr_dir: '.*syntax_pkg' \(.*syntax_pkg/model\.py:1\): importing it failed: SyntaxError",
        ),
        (
            "import",
            {"model": "import not_a_module_anywhere\n"},
            r"\(.*import_pkg/model\.py:1\): importing it failed: ModuleNotFoundError",
        ),
        (
            "shape",
            {"input_width": "5"},
            r"^model: 'shape_pkg_model' \(.*shape_pkg/model\.py:6\): a forward and backward pass on one "
            r"batch failed: ValueError: .*expected axis -1 of input shape to have value 5",
        ),
        (
            # Segments trace their step without AutoGraph (trainer.timed_steps): Python control flow
            # on a tensor runs eagerly but not there, and the check traces as they do.
            "control",
            {"model": CONTROL_FLOW_MODEL},
            r"^model: 'control_pkg_model' \(.*control_pkg/model\.py:11\): a forward and backward pass on "
            r"one batch failed: OperatorNotAllowedInGraphError: Using a symbolic `tf.Tensor` as a Python "
            r"`bool` is not allowed. The training step is traced without AutoGraph: branch on a tensor "
            r"with keras.ops.cond or keras.ops.where, not a Python if or while$",
        ),
        (
            "empty",
            {"train_tail": "ds.take(0).batch(batch_size)"},
            r"^problem: 'empty_pkg_problem': train_dataset yields nothing",
        ),
    ],
)
def test_bad_user_code_is_named_with_its_file_and_line(
    tmp_path: Path, case: str, fields: dict[str, str], expected: str
) -> None:
    name = f"{case}_pkg"
    kwargs = {k: v for k, v in fields.items() if k in ("problem", "model")}
    package = write_package(tmp_path, name, **kwargs, **{k: v for k, v in fields.items() if k not in kwargs})
    with pytest.raises(SpecError, match=expected):
        job = JobSpec.from_params(
            {
                "usr_dir": str(package),
                "model": f"{name}_model",
                "problem": f"{name}_problem",
                "hparam_set": f"{name}_hparams",
            }
        )
        check_job(job, str(tmp_path / "cache"))


def test_a_missing_name_lists_what_the_usr_dir_registered(tmp_path: Path) -> None:
    package = write_package(tmp_path, "names_pkg")
    with pytest.raises(SpecError, match=r"^model: unknown 'names_pkg_modle'; accepted: .*names_pkg_model"):
        check_job(job_of(package, model="names_pkg_modle"), str(tmp_path / "cache"))


def test_the_check_command_takes_a_job_file_and_the_run_commands_flags(tmp_path: Path) -> None:
    """`syncswitch check` as a user runs it while writing a model: the flags of `syncswitch run`,
    over a job file's params where both are given; a bad name is one line and exit 2."""
    package = write_package(tmp_path, "cli_pkg")
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"usr_dir": str(package), "problem": "cli_pkg_problem"}))
    command = [sys.executable, "-m", "syncswitch.cli", "check", "--job", str(job_file)]
    names = ["--model", "cli_pkg_model", "--hparam-set", "cli_pkg_hparams"]
    done = subprocess.run([*command, *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["usr_dir"], summary["model"], summary["problem"]) == (
        str(package),
        "cli_pkg_model",
        "cli_pkg_problem",
    )
    done = subprocess.run([*command, *names, "--model", "cli_pkg_modle"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("syncswitch check: model: unknown 'cli_pkg_modle'; accepted: ")
    ), done.stderr[-2000:]
    job_file.write_text("[]")
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"syncswitch check: --job: {job_file} must hold one JSON object of job params"
    ), done.stderr[-2000:]


# ---- through the DAG ------------------------------------------------------------------------------


def _fresh_python_predictions(saved_model: str, features: np.ndarray, tmp_path: Path) -> np.ndarray:
    """Predictions of the exported SavedModel in a Python without this project or the user code:
    no site processing (so the project's editable install is not on the path), only the packages."""
    np.save(tmp_path / "tokens.npy", features)
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        assert importlib.util.find_spec("syncswitch") is None
        assert importlib.util.find_spec("text_example") is None
        import numpy as np, tensorflow as tf
        served = tf.saved_model.load({saved_model!r})
        outputs = served.serve({{"tokens": tf.constant(np.load({str(tmp_path / "tokens.npy")!r}))}})
        np.save({str(tmp_path / "served.npy")!r}, outputs.numpy())
        """
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(tmp_path / "served.npy")


@pytest.mark.airflow
@pytest.mark.cluster
def test_a_user_model_trains_101_through_the_dag_and_leaves_a_servable_model(
    dag,
    tmp_path: Path,
    work_root: Path,  # noqa: ANN001
) -> None:
    bucket = str(tmp_path / "runs")
    conf = {
        **TEXT_JOB,
        "switch_order": "101",
        "train_steps": [40, 80, 40],
        "ckpt_frequency": [40],
        "bucket_dir": bucket,
    }
    dag_run = dag.test(run_conf=conf)

    assert dag_run.state == "success"
    layout = RunLayout.for_run(bucket, "byo-text", dag_run.run_id)
    state = read_state(layout)
    assert [e["protocol"] for e in state["plan"]] == ["bsp", "asp", "bsp"]
    assert [s["end_step"] for _, s in sorted(state["segments"].items())] == [40, 120, 160]
    assert state["final"]["global_step"] == 160
    # Exact handoff: every segment restored the bit-identical state its predecessor checkpointed.
    for index, protocol in ((1, "asp"), (2, "bsp")):
        role = "chief-0" if protocol == "asp" else "worker-0"
        events = storage.read_text(f"{layout.segment_metrics(index, protocol)}/{role}.jsonl").splitlines()
        start = next(json.loads(e) for e in events if '"segment_start"' in e)
        assert start["restored_digest"] == start["checkpoint_digest"] is not None
    assert state["user_code"] == {
        "usr_dir": str(TEXT_EXAMPLE),
        "digest": usercode.digest(str(TEXT_EXAMPLE)),
        "packages": {},
    }
    assert state["final"]["test_accuracy"] > 0.4  # 4 classes: it learned

    # The export loads without the project or the user code, and predicts as the run's model does.
    export = state["final"]["export"]
    assert export["saved_model"] == layout.export_saved_model and storage.exists(layout.export_keras)
    sys.path.insert(0, str(TEXT_EXAMPLE.parent))
    import keras
    from text_example.problem import make_split

    tokens = make_split("test")[0][:64]
    restored = keras.saving.load_model(layout.export_keras)
    expected = restored({"tokens": tokens}, training=False).numpy()
    np.testing.assert_allclose(
        _fresh_python_predictions(export["saved_model"], tokens, tmp_path), expected, rtol=1e-5, atol=1e-5
    )
    summary = json.loads(storage.read_text(f"{layout.report}/summary.json"))
    assert summary["user_code"]["digest"] == state["user_code"]["digest"]
    assert summary["export"]["saved_model"] == layout.export_saved_model


@pytest.mark.airflow
def test_bad_user_code_fails_validate_and_nothing_is_provisioned(
    dag,
    tmp_path: Path,
    work_root: Path,
    capfd: pytest.CaptureFixture[str],  # noqa: ANN001
) -> None:
    package = write_package(tmp_path / "code", "dag_bad_pkg", input_width="5")
    bucket = str(tmp_path / "runs")
    dag_run = dag.test(
        run_conf={
            "job_name": "byo-bad",
            "usr_dir": str(package),
            "model": "dag_bad_pkg_model",
            "problem": "dag_bad_pkg_problem",
            "hparam_set": "dag_bad_pkg_hparams",
            "bucket_dir": bucket,
        }
    )
    assert dag_run.state == "failed"
    out = capfd.readouterr().out
    assert "invalid job params: model: 'dag_bad_pkg_model' (" in out and "dag_bad_pkg/" in out
    # No cluster and no run folder; only the failed run's history record.
    assert not work_root.exists() and not (Path(bucket) / "byo-bad").exists()


# ---- entry points of a job: job files and the CLI -------------------------------------------------


def test_a_job_files_usr_dir_is_read_beside_the_file(tmp_path: Path) -> None:
    from syncswitch_airflow.job_files import read_job_file

    write_package(tmp_path / "jobs" / "code", "jobfile_pkg")
    path = tmp_path / "jobs" / "byo-nightly.yaml"
    path.write_text(
        "schedule: '@daily'\nstart_date: 2026-01-01\nparams:\n  usr_dir: code/jobfile_pkg\n"
        "  model: jobfile_pkg_model\n  problem: jobfile_pkg_problem\n  hparam_set: jobfile_pkg_hparams\n"
    )
    job = read_job_file(path).job
    assert job.usr_dir == str(tmp_path / "jobs" / "code" / "jobfile_pkg")


def test_the_run_command_takes_usr_dir_and_makes_it_absolute(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from syncswitch_airflow.tools.cli import parse

    package = write_package(tmp_path, "cli_pkg")
    monkeypatch.chdir(tmp_path)
    job, _options, _notes = parse(
        [
            "--usr-dir",
            "cli_pkg",
            "--model",
            "cli_pkg_model",
            "--problem",
            "cli_pkg_problem",
            "--hparam-set",
            "cli_pkg_hparams",
        ]
    )
    assert job.usr_dir == str(package) and job.model == "cli_pkg_model"


# ---- checkpoints and fingerprints of user models -----------------------------------------------------


def test_a_checkpoint_of_other_variables_is_refused_naming_them() -> None:
    import keras
    from syncswitch import checkpoints

    def model(units: int) -> keras.Model:
        inputs = keras.Input(shape=(6,))
        return keras.Model(
            inputs, keras.layers.Dense(3, name="out")(keras.layers.Dense(units, name="hidden")(inputs))
        )

    manifest = {"uri": "runs/x/checkpoints/ckpt-000000000064", "signature": {"model": "mine"}}
    manifest["structure"] = checkpoints.structure(model(4).weights)
    checkpoints.check_structure(manifest, model(4).weights)  # the same builder: accepted
    with pytest.raises(checkpoints.CheckpointMismatchError) as error:
        checkpoints.check_structure(manifest, model(5).weights)
    message = str(error.value)
    assert message.startswith(
        "run_dir: the latest checkpoint runs/x/checkpoints/ckpt-000000000064 holds other"
    )
    assert "hidden/kernel [6, 4] float32" in message and "hidden/kernel [6, 5] float32" in message


def test_the_user_codes_digest_is_part_of_the_fingerprint() -> None:
    from syncswitch_airflow.history import job_fingerprint

    params = JobSpec(**{k: v for k, v in TEXT_JOB.items() if k != "job_name"}).to_params()
    assert job_fingerprint(params) == job_fingerprint(params, "")
    assert job_fingerprint(params, "0123456789abcdef") != job_fingerprint(params, "fedcba9876543210")
    assert usercode.identity({"digest": "ab", "packages": {"pkg": "1.0"}}) == "ab;pkg==1.0"


# ---- hooks ----------------------------------------------------------------------------------------

HOOKS = """
import json
import os

from syncswitch.hooks import Hooks
from syncswitch.registry import register_hooks


def _record(**fields):
    task = json.loads(os.environ.get("TF_CONFIG", "{{}}")).get("task", {{}})
    with open({log!r}, "a") as f:
        f.write(json.dumps({{**fields, "node": f"{{task.get('type')}}-{{task.get('index')}}"}}) + "\\n")


@register_hooks("{name}_record")
class Record(Hooks):
    def on_checkpoint(self, step, path):
        _record(method="on_checkpoint", step=step, path=path, written=os.path.exists(path + "/manifest.json"))

    def on_evaluate(self, step, metrics):
        _record(method="on_evaluate", step=step, metrics=metrics)


@register_hooks("{name}_broken")
class Broken:
    def on_checkpoint(self, step, path):
        raise RuntimeError(f"no network at step {{step}}")


@register_hooks("{name}_empty")
class Empty:
    pass
"""


def write_hooks(package: Path, log: Path) -> None:
    (package / "hooks.py").write_text(HOOKS.format(name=package.name, log=str(log)))
    with (package / "__init__.py").open("a") as f:
        f.write(f"from {package.name} import hooks  # noqa: F401\n")


@pytest.mark.cluster
def test_hooks_run_on_the_chief_at_each_checkpoint_and_evaluation_and_a_failing_one_does_not_stop_training(
    tmp_path: Path,
) -> None:
    """A usr_dir's hooks, named by the job: on_checkpoint(step, path) once per checkpoint, after it is
    complete, and on_evaluate(step, metrics) once per evaluated step (the segment's final evaluation
    repeats its last checkpoint's: one call), on BSP's worker 0 and ASP's coordinator alone; a hook
    that raises is a hook_error event (and a line in the chief's log), and both segments train to
    their targets."""
    package = write_package(tmp_path, "hooks_pkg")
    log = tmp_path / "hooks.jsonl"
    write_hooks(package, log)
    run_dir = tmp_path / "run"
    common = [
        *("--usr-dir", str(package), "--model", "hooks_pkg_model", "--problem", "hooks_pkg_problem"),
        *("--hparam-set", "hooks_pkg_hparams", "--run-dir", str(run_dir), "--workers", "2"),
        *("--total-steps", "40", "--ckpt-frequency", "10", "--eval-checkpoints", "--eval"),
        *("--hook", "hooks_pkg_broken", "--hook", "hooks_pkg_record"),
    ]
    for index, (protocol, until) in enumerate((("bsp", 20), ("asp", 40))):
        proc = subprocess.run(
            [sys.executable, "-m", "syncswitch.cli", "train", "--quiet", "--protocol", protocol]
            + ["--until-step", str(until), "--segment-index", str(index), *common],
            capture_output=True,
            text=True,
            timeout=420,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    checkpoints_seen = [(c["step"], c["node"]) for c in calls if c["method"] == "on_checkpoint"]
    assert checkpoints_seen == [(10, "worker-0"), (20, "worker-0"), (30, "chief-0"), (40, "chief-0")]
    assert all(
        c["written"] and c["path"].endswith(f"ckpt-{c['step'] * 16:012d}") for c in calls if "path" in c
    )
    evaluations = [c for c in calls if c["method"] == "on_evaluate"]
    assert [c["step"] for c in evaluations] == [10, 20, 30, 40]
    assert all(set(c["metrics"]) == {"test_accuracy", "test_loss"} for c in evaluations)

    layout = RunLayout(str(run_dir))
    errors = [
        json.loads(line)
        for index, protocol, node in ((0, "bsp", "worker-0"), (1, "asp", "chief-0"))
        for line in storage.read_text(f"{layout.segment_metrics(index, protocol)}/{node}.jsonl").splitlines()
        if '"hook_error"' in line
    ]
    assert [(e["hook"], e["method"], e["step"]) for e in errors] == [
        ("hooks_pkg_broken", "on_checkpoint", step) for step in (10, 20, 30, 40)
    ]
    assert errors[0]["error"] == "RuntimeError: no network at step 10"
    raising = (
        (package / "hooks.py")
        .read_text()
        .splitlines()
        .index('        raise RuntimeError(f"no network at step {step}")')
    )
    assert errors[0]["where"] == f"{package / 'hooks.py'}:{raising + 1}"


def test_the_check_refuses_unknown_hooks_and_hooks_without_a_hook_method(tmp_path: Path) -> None:
    package = write_package(tmp_path, "hookcheck_pkg")
    write_hooks(package, tmp_path / "unused.jsonl")
    summary = check_job(job_of(package, hooks=["hookcheck_pkg_record"]), str(tmp_path / "cache"))
    assert summary["model"] == "hookcheck_pkg_model"
    with pytest.raises(
        SpecError, match=r"^hooks: unknown 'hookcheck_pkg_recrod'; accepted: .*hookcheck_pkg_record"
    ):
        check_job(job_of(package, hooks="hookcheck_pkg_recrod"), str(tmp_path / "cache"))
    with pytest.raises(
        SpecError,
        match=r"^hooks: 'hookcheck_pkg_empty' \(.*hooks\.py\): Empty has neither on_checkpoint nor "
        r"on_evaluate$",
    ):
        check_job(job_of(package, hooks=["hookcheck_pkg_empty"]), str(tmp_path / "cache"))
    # Without a usr_dir, validation itself checks the names (this process has the package's imported).
    with pytest.raises(SpecError, match=r"^hooks: unknown 'notify'; accepted: hookcheck_pkg_broken, "):
        JobSpec.from_params({"hooks": ["notify"]})
