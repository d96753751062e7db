"""Segment specs for the tests of the training loops' book-keeping (no cluster, no run folder)."""

from __future__ import annotations

from syncswitch.spec import SegmentSpec


def segment_spec(protocol: str, workers: int, until_step: int, ckpt_frequency: int) -> SegmentSpec:
    """Segment 0 of a digits CNN run whose target is ``until_step``."""
    return SegmentSpec(
        run_id="r",
        run_dir="/tmp/unused",
        index=0,
        protocol=protocol,
        until_step=until_step,
        total_steps=until_step,
        model="cnn",
        hparam_set="cnn_digits",
        problem="digits",
        num_workers=workers,
        ckpt_frequency=ckpt_frequency,
    )
