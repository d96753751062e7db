"""The switch order's grammar (syncswitch.protocols): every entry point takes the protocols and their
settings alike, refuses a bad one naming the segment and the accepted spellings before anything is
provisioned, and every existing spelling keeps its meaning. No cluster here: the protocols' runs are
tests/test_protocols_cluster.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from syncswitch.errors import SpecError
from syncswitch.protocols import SPELLINGS, Protocol, parse_switch_order
from syncswitch.spec import JobSpec
from syncswitch_airflow.dag_params import build_params
from syncswitch_airflow.job_files import JobFileError, read_job_file
from syncswitch_airflow.tools.cli import parse

ROOT = Path(__file__).resolve().parents[1]


def _switch_orders_in(path: Path) -> list[str]:
    """Every switch_order a job or sweep file sets."""
    data = yaml.safe_load(path.read_text()) or {}
    found = [data.get("params", {}).get("switch_order"), data.get("base", {}).get("switch_order")]
    found += [c.get("switch_order") for c in (data.get("configs") or {}).values()]
    return [str(order) for order in found if order is not None]


@pytest.mark.parametrize("path", sorted([*ROOT.glob("jobs/*.yaml"), *ROOT.glob("experiments/*.yaml")]))
def test_every_job_and_experiment_file_keeps_its_plan(path: Path) -> None:
    """Digits mean what they meant: one segment per digit, 1 BSP and 0 ASP, and the canonical text
    is the digits themselves (history records and fingerprints compare it). A file that names other
    protocols spells them canonically, and its plan holds them with their settings."""
    for order in _switch_orders_in(path) or ["10"]:
        job = JobSpec.from_params({"switch_order": order, "max_online_switches": 0})
        assert job.switch_order == order
        entries = job.plan_entries()
        if order.isdigit():
            assert [e["protocol"] for e in entries] == [{"1": "bsp", "0": "asp"}[d] for d in order]
            assert all("protocol_args" not in e for e in entries)
        else:
            planned = [Protocol.of(e["protocol"], e.get("protocol_args")) for e in entries]
            assert planned == list(parse_switch_order(order))


@pytest.mark.parametrize(
    ("spelled", "canonical", "protocols"),
    [
        ("10", "10", [Protocol("bsp"), Protocol("asp")]),
        ("1,0", "10", [Protocol("bsp"), Protocol("asp")]),
        (
            " BSP , ssp:4, 0 ",
            "bsp,ssp:4,asp",
            [Protocol("bsp"), Protocol("ssp", staleness=4), Protocol("asp")],
        ),
        ("bsp,local:8", "bsp,local:8", [Protocol("bsp"), Protocol("local", period=8)]),
        ("fp16", "fp16", [Protocol("cbsp", compression="fp16", ratio=0.5)]),
        (
            ["1", "topk:0.01"],
            "bsp,topk:0.01",
            [Protocol("bsp"), Protocol("cbsp", compression="topk", ratio=0.01)],
        ),
        ('["bsp", "ssp:0"]', "bsp,ssp:0", [Protocol("bsp"), Protocol("ssp", staleness=0)]),
    ],
)
def test_spellings_and_their_canonical_form(spelled: Any, canonical: str, protocols: list[Protocol]) -> None:
    assert list(parse_switch_order(spelled)) == protocols
    job = JobSpec.from_params({"switch_order": spelled})
    assert job.switch_order == canonical and list(job.protocols()) == protocols
    assert JobSpec.from_params(job.to_params()) == job  # the canonical text reads back the same


def test_every_entry_point_takes_the_new_spellings_alike(tmp_path: Path) -> None:
    """REST conf / job settings, the Trigger form's Param, `syncswitch run`'s flag and a job file's
    list all make the same JobSpec."""
    from_conf = JobSpec.from_params({"switch_order": "1,ssp:4,0", "max_online_switches": 1})
    build_params("/bucket")["switch_order"].resolve("1,ssp:4,0")
    from_flags, _options, _notes = parse(["--switch-order", "1,ssp:4,0", "--max-online-switches", "1"])
    job_file = tmp_path / "ssp-job.yaml"
    job_file.write_text(
        yaml.safe_dump({"params": {"switch_order": ["bsp", "ssp:4", "asp"], "max_online_switches": 1}})
    )
    from_file = read_job_file(job_file).job
    assert from_flags == from_conf
    assert from_file.switch_order == from_conf.switch_order == "bsp,ssp:4,asp"


@pytest.mark.parametrize(
    ("spelled", "segment", "why"),
    [
        ("1,ssp:x,0", "segment 1 ('ssp:x')", "staleness bound s must be an integer"),
        ("1,ssp,0", "segment 1 ('ssp')", "needs its setting"),
        ("bsp,local:0", "segment 1 ('local:0')", "averaging period H must be an integer in 1.."),
        ("topk:1.5", "segment 0 ('topk:1.5')", "in (0, 1]"),
        ("bsp:2", "segment 0 ('bsp:2')", "takes no setting"),
        ("1,sync", "segment 1 ('sync')", "unknown protocol"),
        ("1,,0", "segment 1 ('')", "unknown protocol"),
        ("12", "segment 0 ('12')", "unknown protocol"),
    ],
)
def test_a_bad_spelling_is_refused_naming_the_segment_and_the_accepted_ones(
    spelled: str, segment: str, why: str, tmp_path: Path
) -> None:
    with pytest.raises(SpecError) as refused:
        JobSpec.from_params({"switch_order": spelled})
    assert refused.value.field == "switch_order"
    assert segment in str(refused.value) and why in str(refused.value) and SPELLINGS in str(refused.value)
    # The CLI refuses it before starting anything; a job file names the file and the field.
    with pytest.raises(SpecError, match="switch_order: " + segment.split(" (")[0]):
        parse(["--switch-order", spelled])
    job_file = tmp_path / "bad.yaml"
    job_file.write_text(yaml.safe_dump({"params": {"switch_order": spelled}}))
    with pytest.raises(JobFileError, match="params.switch_order: " + segment.split(" (")[0]):
        read_job_file(job_file)


def test_the_timing_search_takes_bsp_then_any_other_protocol() -> None:
    job = JobSpec.from_params({"switch_order": "bsp,ssp:4", "timing_policy": "search"})
    assert job.with_bsp_fraction(0.25).switch_order == "bsp,ssp:4"
    assert job.with_bsp_fraction(1.0).switch_order == "1"
    assert JobSpec().with_bsp_fraction(0.5).switch_order == "10"
    for order in ("ssp:4,bsp", "1", "bsp,bsp", "1,0,1"):
        with pytest.raises(SpecError, match="timing_policy 'search' needs two segments"):
            JobSpec.from_params({"switch_order": order, "timing_policy": "search"})


def test_a_segment_spec_round_trips_its_protocol_settings() -> None:
    from syncswitch.spec import SegmentSpec

    job = JobSpec.from_params({"switch_order": "bsp,topk:0.05"})
    spec = job.segment_spec(job.plan_entries()[1], "run", "/tmp/run")
    assert spec.protocol == "cbsp" and spec.segment_protocol == Protocol(
        "cbsp", compression="topk", ratio=0.05
    )
    assert SegmentSpec.from_dict(json.loads(spec.to_json())) == spec
    with pytest.raises(ValueError, match="averaging period H"):
        Protocol.of("local", {"period": 0})
    with pytest.raises(ValueError, match="are not those of .asp."):
        Protocol.of("asp", {"period": 2})
