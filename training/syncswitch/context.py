"""What a training process knows about itself: its segment, role, folders, hparams and start-up marks.
Built by syncswitch.node; the loops (syncswitch.bsp, syncswitch.asp) and what they share
(syncswitch.trainer, syncswitch.reporting) read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syncswitch.events import EventWriter
from syncswitch.hparams import HParams
from syncswitch.layout import RunLayout
from syncswitch.protocols import ALLREDUCE
from syncswitch.spec import SegmentSpec


@dataclass
class NodeContext:
    """What a training process knows about itself; built by syncswitch.node."""

    spec: SegmentSpec
    role: str
    task: int
    work_dir: str
    data_dir: str  # local folder prepared by the launcher ("" for in-memory problems)
    layout: RunLayout
    hp: HParams
    timings: dict[str, float] = field(default_factory=dict)
    user_code: str = ""  # where this process imported the job's usr_dir from (a shipped copy on hosts)
    # The distributed iterator, strategy and model of a finished loop. Freeing them would tear down
    # prefetch threads and collectives, time in every switch gap; the node exits with os._exit
    # instead, and holding them here skips that teardown.
    finished_objects: list[Any] = field(default_factory=list)

    @property
    def is_chief(self) -> bool:
        allreduce = self.spec.segment_protocol.topology == ALLREDUCE
        return (self.role, self.task) in (("chief", 0), ("worker", 0) if allreduce else ())

    def events(self) -> EventWriter:
        return EventWriter(
            self.layout.segment_events(self.spec.index, self.spec.protocol, self.role, self.task),
            run_id=self.spec.run_id,
            segment=self.spec.index,
            protocol=self.spec.protocol,
            role=self.role,
            task=self.task,
        )
