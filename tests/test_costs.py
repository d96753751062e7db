"""The GCE price catalog (gce_prices.json), the VM checks a ``gce`` spec must pass, and the cost ledger.

Ledger numbers are worked out by hand from the file's prices (us-central1, $/h):
n1-standard-4 0.19 on-demand; n1-standard-8 0.38 / 0.08 spot; K80 0.45 / 0.135 spot; e2-standard-4 0.134.
"""

from __future__ import annotations

import copy
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from syncswitch.costs import DEFAULT_PRICES_PATH, Catalog, ledger
from syncswitch.errors import SpecError

T0 = 1_700_000_000.0  # an epoch second; every time below is T0 + offset


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.load()


@pytest.fixture(scope="module")
def price_file() -> dict[str, Any]:
    with open(DEFAULT_PRICES_PATH, encoding="utf-8") as f:
        return json.load(f)


def spec_error(call: Any, *args: Any, **kwargs: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        call(*args, **kwargs)
    return info.value


# ---- the file ------------------------------------------------------------------------------------


def test_price_file_documents_itself(price_file: dict[str, Any]) -> None:
    assert price_file["currency"] == "USD" and price_file["unit"] == "hour"
    assert price_file["as_of"] and "Compute Engine" in price_file["source"] and price_file["notes"]
    assert {"us-central1", "us-west1", "us-east1", "europe-west4", "asia-east1"} <= set(price_file["regions"])
    assert price_file["gpu_aliases"]["k80"] == "nvidia-tesla-k80"
    assert price_file["builtin_gpu_machines"]["a2-highgpu-1g"]["gpu_type"] == "nvidia-tesla-a100"
    for region, entry in price_file["regions"].items():
        for name, price in {**entry["machines"], **entry["gpus"]}.items():
            assert 0 < price["spot"] < price["on_demand"], (region, name)
    # Not every GPU everywhere: that is what the region check rejects.
    assert "nvidia-tesla-k80" not in price_file["regions"]["europe-west4"]["gpus"]
    assert "nvidia-tesla-p4" not in price_file["regions"]["us-west1"]["gpus"]


def test_hourly_reads_every_price_from_the_file(catalog: Catalog, price_file: dict[str, Any]) -> None:
    for region, entry in price_file["regions"].items():
        zone = f"{region}-b"
        for machine, price in entry["machines"].items():
            assert catalog.hourly(zone, machine, "", 0, spot=False) == pytest.approx(price["on_demand"])
            assert catalog.hourly(zone, machine, "none", 0, spot=True) == pytest.approx(price["spot"])
        for gpu, price in entry["gpus"].items():
            base = entry["machines"]["n1-standard-8"]
            assert catalog.hourly(zone, "n1-standard-8", gpu, 2, spot=False) == pytest.approx(
                base["on_demand"] + 2 * price["on_demand"]
            )
            assert catalog.hourly(zone, "n1-standard-8", gpu, 1, spot=True) == pytest.approx(
                base["spot"] + price["spot"]
            )


def test_hourly_known_values(catalog: Catalog) -> None:
    assert catalog.hourly("us-central1-a", "n1-standard-8", "k80", 1, spot=False) == pytest.approx(0.83)
    assert catalog.hourly("us-central1-a", "n1-standard-8", "k80", 1, spot=True) == pytest.approx(0.215)
    assert catalog.hourly("us-central1-f", "n1-standard-8", "v100", 4, spot=False) == pytest.approx(10.30)
    assert catalog.hourly("us-central1-c", "a2-highgpu-1g", "", 0, spot=False) == pytest.approx(3.6734)


def test_a_custom_file_is_what_gets_priced(tmp_path: Path, price_file: dict[str, Any]) -> None:
    data = copy.deepcopy(price_file)
    data["regions"]["us-central1"]["machines"]["n1-standard-8"] = {"on_demand": 1.0, "spot": 0.25}
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(data))
    custom = Catalog.load(str(path))
    assert custom.path == str(path)
    assert custom.hourly("us-central1-a", "n1-standard-8", "k80", 2, spot=True) == pytest.approx(0.25 + 0.27)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda d: d["regions"]["us-central1"]["gpus"]["nvidia-tesla-k80"].update(spot=9),
            "spot 9.0 is above",
        ),
        (
            lambda d: d["regions"]["us-west1"]["gpus"].update(
                {"nvidia-h100": d["regions"]["us-west1"]["gpus"]["nvidia-tesla-t4"]}
            ),
            "'nvidia-h100' is not in",
        ),
        (lambda d: d["gpu_aliases"].update(a10="nvidia-a10"), "'a10' -> 'nvidia-a10'"),
        (
            lambda d: d["regions"]["us-east1"]["machines"].update({"n1-standard-2": {"spot": 0.02}}),
            "KeyError",
        ),
        (lambda d: d.update(unit="month"), "unit must be 'hour'"),
        (lambda d: d["retired_gpus"].update({"nvidia-h100": "2030-01-01"}), "retired_gpus: 'nvidia-h100'"),
        (lambda d: d.update(as_of="September 2023"), "as_of must be a date, YYYY-MM-DD"),
    ],
)
def test_a_malformed_file_fails_at_load(tmp_path: Path, price_file: dict[str, Any], mutate, expected) -> None:
    data = copy.deepcopy(price_file)
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=expected) as info:
        Catalog.load(str(path))
    assert str(path) in str(info.value)


# ---- validation ----------------------------------------------------------------------------------


def test_region_of_a_zone(catalog: Catalog) -> None:
    assert catalog.region("us-central1-a") == "us-central1"
    assert catalog.region("europe-west4-c") == "europe-west4"
    assert catalog.region("northamerica-northeast1-b") == "northamerica-northeast1"
    for bad in ("us-central1", "uscentral1-a", "us-central1-ab", "", "US-CENTRAL1-A"):
        err = spec_error(catalog.region, bad)
        assert err.field == "zone" and "us-central1-a" in str(err)


def test_gpu_type_names(catalog: Catalog) -> None:
    assert catalog.gpu_type("gpu_array", "k80") == "nvidia-tesla-k80"
    assert catalog.gpu_type("gpu_array", " V100 ") == "nvidia-tesla-v100"
    assert catalog.gpu_type("gpu_array", "nvidia-tesla-p4") == "nvidia-tesla-p4"
    assert catalog.gpu_type("gpu_array", "") == "" and catalog.gpu_type("gpu_array", "none") == ""
    err = spec_error(catalog.gpu_type, "gpu_array", "h100")
    assert err.field == "gpu_array"
    assert "unknown GPU type 'h100'; accepted: p100, v100, t4, p4, nvidia-tesla-p100" in str(err)
    err = spec_error(catalog.gpu_type, "gpu_array", "a100")
    assert "built into a2-highgpu-1g" in str(err)


def test_a_retired_gpu_is_refused_naming_the_current_types_and_the_tables_age(
    catalog: Catalog, price_file: dict[str, Any]
) -> None:
    """A GPU type Compute Engine has retired (the table's ``retired_gpus``) cannot be asked for; the
    refusal says since when, how old the table is (Compute Engine may have retired more since), and
    what a VM can have instead. Its prices stay: a run recorded with it is still costed."""
    assert price_file["retired_gpus"] == {"nvidia-tesla-k80": "2024-05-01"}
    as_of = datetime.date.fromisoformat(price_file["as_of"])
    assert catalog.age_days(as_of + datetime.timedelta(days=30)) == 30
    for name in ("k80", "nvidia-tesla-k80"):
        err = spec_error(catalog.check_offered, "gce.gpus", name, as_of + datetime.timedelta(days=1000))
        assert str(err) == (
            f"gce.gpus: {name!r} is retired on Compute Engine since 2024-05-01 (price table of "
            f"{price_file['as_of']}, 1000 days old); current types: p100, v100, t4, p4 (on n1 machine "
            "types); a100 (machine type a2-highgpu-1g, with gpus none); l4 (machine type g2-standard-8, "
            "with gpus none)"
        )
    catalog.check_offered("gce.gpus", "t4")
    catalog.check_offered("gce.gpus", "none")
    assert catalog.hourly("us-central1-a", "n1-standard-8", "k80", 1, spot=False) == pytest.approx(0.83)


def test_check_vm_accepts_the_papers_cluster(catalog: Catalog) -> None:
    catalog.check_vm("ps_machine_type", "n1-standard-4", "us-central1-a")
    for gpu, zone in (("k80", "us-central1-a"), ("p100", "us-west1-b"), ("v100", "asia-east1-c")):
        catalog.check_vm("gpu_array", "n1-standard-8", zone, gpu, 1)
    catalog.check_vm("gpu_array", "n1-highmem-8", "europe-west4-a", "nvidia-tesla-v100", 8)
    catalog.check_vm("gpu_array", "g2-standard-8", "asia-east1-a")


@pytest.mark.parametrize(
    ("args", "messages"),
    [
        (
            ("n1-standard-8", "southamerica-east1-a"),
            [
                "region 'southamerica-east1'",
                "covered regions: asia-east1, europe-west4, us-central1, us-east1, us-west1",
            ],
        ),
        (("n1-standard-8", "us-central1"), ["is not a Compute Engine zone"]),
        (
            ("a2-highgpu-1g", "asia-east1-a"),
            [
                "'a2-highgpu-1g' is not priced in asia-east1",
                "priced in: europe-west4, us-central1, us-east1, us-west1",
                "accepted in asia-east1: e2-standard-4, e2-standard-8, "
                "g2-standard-8, n1-highmem-8, n1-standard-16",
            ],
        ),
        (
            ("n2-standard-4", "us-east1-b"),
            ["'n2-standard-4' is not priced in us-east1; accepted in us-east1: a2-highgpu-1g, e2-standard-4"],
        ),
        (
            ("n1-standard-8", "europe-west4-b", "k80", 1),
            [
                "nvidia-tesla-k80 is not offered in europe-west4 "
                "(zone europe-west4-b); regions that offer it: "
                "asia-east1, us-central1, us-east1, us-west1"
            ],
        ),
        (("n1-standard-8", "us-west1-a", "p4", 1), ["regions that offer it: europe-west4, us-central1"]),
        (
            ("e2-standard-4", "us-central1-a", "k80", 1),
            ["e2-standard-4 cannot take GPUs; GPUs attach to n1 machine types"],
        ),
        (
            ("a2-highgpu-1g", "us-central1-a", "t4", 1),
            ["a2-highgpu-1g has a built-in 1 x nvidia-tesla-a100 and takes no extra accelerators"],
        ),
        (("g2-standard-8", "us-central1-a", "t4", 1), ["built-in 1 x nvidia-l4"]),
        (
            ("n1-standard-8", "us-central1-a", "k80", 0),
            ["gpu_count 0 of nvidia-tesla-k80 is not possible; accepted: 1, 2, 4, 8 (at most 8 per VM)"],
        ),
        (("n1-standard-8", "us-central1-a", "t4", 8), ["accepted: 1, 2, 4 (at most 4 per VM)"]),
        (("n1-standard-8", "us-central1-a", "v100", 3), ["gpu_count 3 of nvidia-tesla-v100", "1, 2, 4, 8"]),
        (("n1-standard-8", "us-central1-a", "", 2), ["gpu_count 2 needs a GPU type; accepted: p100, v100"]),
        (("n1-standard-8", "us-central1-a", "k40", 1), ["unknown GPU type 'k40'; accepted: p100"]),
        (("n1-standard-8", "us-central1-a", "k80", "2"), ["gpu_count must be an integer"]),
    ],
)
def test_check_vm_names_the_field_and_what_is_accepted(
    catalog: Catalog, args: tuple[Any, ...], messages: list[str]
) -> None:
    err = spec_error(catalog.check_vm, "workers[2]", *args)
    assert err.field == "workers[2]"
    assert str(err).startswith("workers[2]: ")
    for message in messages:
        assert message in str(err)


def test_hourly_refuses_what_check_vm_refuses(catalog: Catalog) -> None:
    err = spec_error(catalog.hourly, "europe-west4-a", "n1-standard-8", "k80", 1, True)
    assert "not offered in europe-west4" in str(err)


def test_runtime_module_does_not_import_airflow() -> None:
    code = "import sys, syncswitch.costs; sys.exit(any(m.split('.')[0] == 'airflow' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- the ledger ----------------------------------------------------------------------------------


def vm(
    name: str,
    role: str,
    machine: str,
    start: float,
    end: float | None,
    *,
    gpu: str = "",
    n: int = 0,
    spot: bool = False,
    zone: str = "us-central1-a",
) -> dict[str, Any]:
    return {
        "name": name,
        "role": role,
        "zone": zone,
        "machine_type": machine,
        "gpu_type": gpu,
        "gpu_count": n,
        "spot": spot,
        "started_at": T0 + start,
        "ended_at": None if end is None else T0 + end,
    }


def seg(index: int, protocol: str, start: float, end: float | None) -> dict[str, Any]:
    return {
        "index": index,
        "protocol": protocol,
        "started_at": T0 + start,
        "ended_at": None if end is None else T0 + end,
    }


# Two hours: PS and chief on-demand, worker 0 spot all along, worker 1 spot preempted at 30 min.
# BSP 600..3600 s, ASP 3600..6600 s; 0..600 and 6600..7200 are provisioning and teardown.
PAPER_VMS = [
    vm("ps-0", "ps", "n1-standard-4", 0, 7200),  # 0.19 $/h x 2 h = 0.38
    vm("chief", "chief", "n1-standard-8", 0, 7200, gpu="nvidia-tesla-k80", n=1),  # 0.83 x 2 = 1.66
    vm("worker-0", "worker", "n1-standard-8", 0, 7200, gpu="nvidia-tesla-k80", n=1, spot=True),  # 0.215 x 2
    vm("worker-1", "worker", "n1-standard-8", 0, 1800, gpu="nvidia-tesla-k80", n=1, spot=True),  # 0.215 x .5
]
PAPER_SEGMENTS = [seg(0, "bsp", 600, 3600), seg(1, "asp", 3600, 6600)]


def test_ledger_per_vm_and_savings(catalog: Catalog) -> None:
    out = ledger(PAPER_VMS, PAPER_SEGMENTS, catalog, now=T0 + 99999)
    assert [(v["name"], v["active_seconds"], v["hourly"], v["cost"]) for v in out["per_vm"]] == [
        ("ps-0", 7200.0, 0.19, 0.38),
        ("chief", 7200.0, 0.83, 1.66),
        ("worker-0", 7200.0, 0.215, 0.43),
        ("worker-1", 1800.0, 0.215, 0.1075),  # preempted: charged only until ended_at
    ]
    assert out["per_vm"][1]["gpu_type"] == "nvidia-tesla-k80" and out["per_vm"][2]["spot"] is True
    assert out["currency"] == "USD"
    assert out["total"] == 2.5775
    assert out["on_demand_total"] == 4.115  # 0.38 + 1.66 + 1.66 + 0.83 x 0.5
    assert out["savings"] == 1.5375
    assert out["savings_fraction"] == 0.3736  # 1.5375 / 4.115
    assert out["price_table"] == {"as_of": catalog.as_of, "source": catalog.source}
    json.dumps(out)  # JSON-friendly


def test_ledger_per_segment_and_protocol(catalog: Catalog) -> None:
    out = ledger(PAPER_VMS, PAPER_SEGMENTS, catalog, now=T0 + 99999)
    # BSP: (0.19 + 0.83 + 0.215) x 3000/3600 + worker-1's 1200 s x 0.215/3600 = 1.0291667 + 0.0716667
    # ASP: (0.19 + 0.83 + 0.215) x 3000/3600 = 1.0291667 (worker-1 is gone)
    assert out["per_segment"] == [
        {"index": 0, "protocol": "bsp", "seconds": 3000.0, "cost": 1.1008},
        {"index": 1, "protocol": "asp", "seconds": 3000.0, "cost": 1.0292},
    ]
    assert out["per_protocol"] == {"bsp": 1.1008, "asp": 1.0292}
    # Outside both windows: 1200 s of the three long-lived VMs (1.235 $/h) + worker-1's first 600 s.
    assert out["unattributed"] == 0.4475
    assert out["total"] == pytest.approx(sum(s["cost"] for s in out["per_segment"]) + out["unattributed"])
    assert out["total"] == pytest.approx(sum(v["cost"] for v in out["per_vm"]))


def test_ledger_running_vm_and_segment_are_charged_up_to_now(catalog: Catalog) -> None:
    vms = [vm("chief", "chief", "e2-standard-4", 0, None)]  # 0.134 $/h, still running
    segments = [seg(0, "bsp", 0, 900), seg(1, "asp", 900, None)]  # ASP still running
    out = ledger(vms, segments, catalog, now=T0 + 1800)
    assert out["per_vm"][0]["active_seconds"] == 1800.0
    assert out["total"] == 0.067  # 0.134 / 2
    assert out["per_segment"][1]["seconds"] == 900.0
    assert out["per_protocol"] == {"bsp": 0.0335, "asp": 0.0335}
    assert out["unattributed"] == 0.0
    assert out["savings"] == 0.0 and out["savings_fraction"] == 0.0


def test_ledger_default_now_is_the_clock(catalog: Catalog) -> None:
    import time

    started = time.time() - 3600
    vms = [{**vm("ps", "ps", "n1-standard-4", 0, None), "started_at": started}]
    out = ledger(vms, [], catalog)
    assert out["per_vm"][0]["active_seconds"] == pytest.approx(3600, abs=30)
    assert out["total"] == pytest.approx(0.19, abs=0.002)
    assert out["unattributed"] == out["total"] and out["per_protocol"] == {"bsp": 0.0, "asp": 0.0}


def test_ledger_never_charges_a_second_to_two_segments(catalog: Catalog) -> None:
    # Segment 1's record starts 100 s before segment 0's ends (clocks of two machines): it is counted
    # from segment 0's end. 3600 s of n1-standard-4 at 0.19 $/h.
    vms = [vm("ps", "ps", "n1-standard-4", 0, 3600)]
    segments = [seg(1, "asp", 1700, 3600), seg(0, "bsp", 0, 1800)]  # out of order on purpose
    out = ledger(vms, segments, catalog, now=T0 + 3600)
    assert [(s["index"], s["seconds"]) for s in out["per_segment"]] == [(0, 1800.0), (1, 1800.0)]
    assert out["per_protocol"] == {"bsp": 0.095, "asp": 0.095}
    assert out["unattributed"] == 0.0 and out["total"] == 0.19


def test_ledger_mixed_gpus_and_regions(catalog: Catalog) -> None:
    # The original's --gpu_array k80 p100 v100 with --zone_array: three spot workers for 20 minutes.
    vms = [
        vm("w0", "worker", "n1-standard-8", 0, 1200, gpu="nvidia-tesla-k80", n=1, spot=True),
        vm(
            "w1",
            "worker",
            "n1-standard-8",
            0,
            1200,
            gpu="nvidia-tesla-p100",
            n=1,
            spot=True,
            zone="us-west1-b",
        ),
        vm(
            "w2",
            "worker",
            "n1-standard-8",
            0,
            1200,
            gpu="nvidia-tesla-v100",
            n=2,
            spot=True,
            zone="asia-east1-c",
        ),
    ]
    out = ledger(vms, [seg(0, "asp", 0, 1200)], catalog, now=T0 + 1200)
    # (0.08 + 0.135)/3 + (0.08 + 0.43)/3 + (0.0928 + 2 x 0.77)/3 = 0.0716667 + 0.17 + 0.5442667
    assert [v["cost"] for v in out["per_vm"]] == [0.0717, 0.17, 0.5443]
    assert out["total"] == 0.7859 and out["per_protocol"]["asp"] == 0.7859


@pytest.mark.parametrize(
    ("vms", "segments", "expected"),
    [
        ([{**vm("x", "leader", "n1-standard-4", 0, 10)}], [], "role must be one of chief, worker, ps"),
        ([vm("x", "ps", "n1-standard-4", 10, 5)], [], "vm x: ended_at is before started_at"),
        ([{**vm("x", "ps", "n1-standard-4", 0, 10), "spot": "yes"}], [], "spot must be true or false"),
        ([], [seg(0, "sync", 0, 10)], "protocol must be one of bsp, asp, ssp, local, cbsp"),
        ([{**vm("x", "ps", "n1-standard-4", 0, 10), "started_at": None}], [], "started_at is missing"),
    ],
)
def test_ledger_rejects_malformed_records(catalog: Catalog, vms, segments, expected) -> None:
    with pytest.raises(ValueError, match=expected):
        ledger(vms, segments, catalog, now=T0)


def test_ledger_refuses_an_unpriceable_vm_naming_it(catalog: Catalog) -> None:
    err = spec_error(ledger, [vm("w3", "worker", "e2-standard-8", 0, 10, gpu="t4", n=1)], [], catalog, now=T0)
    assert err.field == "vm w3" and "e2-standard-8 cannot take GPUs" in str(err)
