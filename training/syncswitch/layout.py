"""The run folder contract: where every artefact of one DAG run lives in the bucket.

One DAG run owns one folder, ``<bucket_dir>/<job_name>/<run_id>/``::

    state.json                          RunState: plan, completed segments, decisions (syncswitch.state)
    checkpoints/ckpt-<samples>/         one TF checkpoint; manifest.json is written last, so a folder
                                        without it is an incomplete write and is never "latest"
    metrics/seg-<ii>-<protocol>/        JSON-lines events of one segment, one file per process
        <role>-<task>.jsonl             (schema: syncswitch.events), then <role>-<task>.part0001.jsonl,
                                        ... (a stream goes on in a new part every 4 MB)
    metrics/seg-<ii>-<protocol>/result.json   SegmentResult written by the chief when the segment ends
    tensorboard/                        scalars of the whole logical run, keyed by global step
    control/stop-seg-<ii>               graceful-stop request for segment ii (any content: the reason)
    logs/seg-<ii>-<protocol>/           every node's log, <role>-<task>.log, and its launcher's,
        <role>-<task>.log               launcher-0.log: uploaded at the segment's end, at its failure
                                        and at teardown (syncswitch.nodelogs)
    report/                             summary.json, index.html, *.png
    cluster/syncswitch-runtime.whl      gce clusters: the runtime's wheel the VMs' startup script installs
    cluster/usercode-<digest>.tar.gz    hosts and gce clusters: the job's usr_dir, as every node imports it
    cluster/secrets/token               hosts and gce clusters: the fork servers' token; made once, private
    cluster/secrets/ssh_key             gce clusters: the run's SSH key (OpenSSH PEM); both gone at teardown
    export/saved_model/                 the trained model as a TensorFlow SavedModel (``model.export``)
    export/model.keras                  and as a Keras file (custom layers need the user code to load)

A recurring job's history lives beside its runs, in ``<bucket_dir>/_history/<job_name>/``
(:class:`JobHistoryLayout`)::

    runs/<run_id>.json                  one immutable record per finished run (syncswitch_airflow.history)
    claims.json                         {run_id: claim}: the BSP fraction each started run took

and a sweep's comparison report (``syncswitch sweep``) in ``<bucket_dir>/_sweeps/<name>/``
(:class:`SweepLayout`; its runs' jobs are ``<name>-<label>``)::

    comparison.html, comparison.json, *.png   the report (syncswitch_airflow.tools.compare)
    sweep-runs.json                     {runs: [{label, repeat, run_id, run_dir, state, ...}]}: its runs

Job names are lowercase letters, digits and '-', so ``_history`` and ``_sweeps`` can never be a job's
folder.

``bucket_dir`` is a local folder or a ``gs://bucket/prefix`` URI; all access goes through
``syncswitch.storage`` so the same paths work for both. Run ids become path segments through
:func:`safe_run_id`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CKPT_RE = re.compile(r"ckpt-(\d{12})$")


CLUSTER_RUNTIME = "cluster/syncswitch-runtime.whl"


def join(*parts: str) -> str:
    """Join URI or path parts with single slashes (works for gs:// and local paths)."""
    head, *rest = parts
    out = head.rstrip("/")
    for part in rest:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}"
    return out


def segment_name(index: int, protocol: str) -> str:
    return f"seg-{index:02d}-{protocol}"


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run folder. ``root`` is ``<bucket_dir>/<job_name>/<run_id>``."""

    root: str

    @classmethod
    def for_run(cls, bucket_dir: str, job_name: str, run_id: str) -> RunLayout:
        return cls(join(bucket_dir, job_name, safe_run_id(run_id)))

    @property
    def bucket_dir(self) -> str:
        """The bucket folder that holds the run's job folder."""
        return self.root.rsplit("/", 2)[0]

    @property
    def job_name(self) -> str:
        return self.root.rsplit("/", 2)[1]

    @property
    def state(self) -> str:
        return join(self.root, "state.json")

    @property
    def checkpoints(self) -> str:
        return join(self.root, "checkpoints")

    def checkpoint(self, samples: int) -> str:
        # Keyed by samples (the exact progress counter), zero-padded so names sort by progress.
        return join(self.checkpoints, f"ckpt-{samples:012d}")

    @staticmethod
    def checkpoint_samples(name: str) -> int | None:
        match = _CKPT_RE.search(name.rstrip("/"))
        return int(match.group(1)) if match else None

    @property
    def metrics(self) -> str:
        return join(self.root, "metrics")

    def segment_metrics(self, index: int, protocol: str) -> str:
        return join(self.metrics, segment_name(index, protocol))

    def segment_events(self, index: int, protocol: str, role: str, task: int) -> str:
        return join(self.segment_metrics(index, protocol), f"{role}-{task}.jsonl")

    def segment_result(self, index: int, protocol: str) -> str:
        return join(self.segment_metrics(index, protocol), "result.json")

    @property
    def logs(self) -> str:
        return join(self.root, "logs")

    def segment_logs(self, index: int, protocol: str) -> str:
        return join(self.logs, segment_name(index, protocol))

    def node_log(self, index: int, protocol: str, node: str) -> str:
        """``node`` is a node's name (``worker-1``) or ``launcher-0``."""
        return join(self.segment_logs(index, protocol), f"{node}.log")

    @property
    def tensorboard(self) -> str:
        return join(self.root, "tensorboard")

    @property
    def control(self) -> str:
        return join(self.root, "control")

    def stop_request(self, index: int) -> str:
        return join(self.control, f"stop-seg-{index:02d}")

    @property
    def report(self) -> str:
        return join(self.root, "report")

    @property
    def cluster_runtime(self) -> str:
        return join(self.root, CLUSTER_RUNTIME)

    def cluster_user_code(self, digest: str) -> str:
        return join(self.root, "cluster", f"usercode-{digest}.tar.gz")

    @property
    def cluster_secrets(self) -> str:
        """The cluster's secrets: the same for every Airflow worker, readable only by the bucket's
        readers (``storage.create_private``); never in a log, XCom or state.json."""
        return join(self.root, "cluster", "secrets")

    @property
    def export(self) -> str:
        return join(self.root, "export")

    @property
    def export_saved_model(self) -> str:
        return join(self.export, "saved_model")

    @property
    def export_keras(self) -> str:
        return join(self.export, "model.keras")

    @classmethod
    def of_cluster_runtime(cls, uri: str) -> RunLayout | None:
        """The run whose ``cluster_runtime`` is ``uri`` (how the gce reaper finds a VM's run)."""
        suffix = "/" + CLUSTER_RUNTIME
        return cls(uri.removesuffix(suffix)) if uri.endswith(suffix) else None


HISTORY_DIR = "_history"


@dataclass(frozen=True)
class JobHistoryLayout:
    """Paths of one job's history. ``root`` is ``<bucket_dir>/_history/<job_name>``."""

    root: str

    @classmethod
    def for_job(cls, bucket_dir: str, job_name: str) -> JobHistoryLayout:
        return cls(join(bucket_dir, HISTORY_DIR, job_name))

    @property
    def records(self) -> str:
        return join(self.root, "runs")

    def record(self, run_id: str) -> str:
        return join(self.records, f"{safe_run_id(run_id)}.json")

    @property
    def claims(self) -> str:
        """One document for all claims: a run decides and claims in one atomic update of it."""
        return join(self.root, "claims.json")


SWEEPS_DIR = "_sweeps"
SWEEP_PROGRESS = "sweep-runs.json"


@dataclass(frozen=True)
class SweepLayout:
    """Paths of one sweep's report. ``root`` is ``<bucket_dir>/_sweeps/<name>`` by default."""

    root: str

    @classmethod
    def for_sweep(cls, bucket_dir: str, name: str) -> SweepLayout:
        return cls(join(bucket_dir, SWEEPS_DIR, name))

    @property
    def page(self) -> str:
        return join(self.root, "comparison.html")

    @property
    def progress(self) -> str:
        """The sweep's runs as triggered and as ended: what a start that resumes it reads."""
        return join(self.root, SWEEP_PROGRESS)


def safe_run_id(run_id: str) -> str:
    """Airflow run ids contain ':' and '+'; keep them readable but safe as a path segment."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
