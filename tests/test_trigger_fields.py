"""Every trigger of the provider is rebuilt on the triggerer from what ``serialize`` gives: its own
classpath and its ``__init__`` parameters (``triggers.base.FieldsTrigger``)."""

from __future__ import annotations

import importlib
import inspect

import pytest
from syncswitch_airflow.triggers.base import FieldsTrigger
from syncswitch_airflow.triggers.capacity import ClusterCapacityTrigger
from syncswitch_airflow.triggers.segment import SegmentTrigger
from syncswitch_airflow.triggers.straggler import StragglerTrigger

TRIGGERS = [
    ClusterCapacityTrigger("hosts", hosts=["10.0.0.1"], need=2, poll_seconds=1.0),
    SegmentTrigger("/runs/r", 2, "asp", 300.0, last_try=True, event_offsets={"worker-0": 10}),
    StragglerTrigger(
        run_dir="/runs/r",
        index=1,
        protocol="bsp",
        segment_task={"dag_id": "d", "run_id": "r", "task_id": "t"},
        straggling_workers=[1],
    ),
]


@pytest.mark.parametrize("trigger", TRIGGERS, ids=lambda t: type(t).__name__)
def test_a_trigger_serializes_as_its_init_parameters_and_comes_back_the_same(trigger: FieldsTrigger) -> None:
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    assert getattr(importlib.import_module(module), name) is type(trigger)
    parameters = [p for p in inspect.signature(type(trigger).__init__).parameters if p != "self"]
    assert list(kwargs) == parameters
    assert type(trigger)(**kwargs).serialize() == (classpath, kwargs)
