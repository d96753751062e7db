"""The configuration policy (spec.switch_config) for each optimizer, the schedule's per-step optimizer
config (the update number Adam's bias correction counts) and the optimizer hparams."""

from __future__ import annotations

import pytest
from syncswitch.errors import SpecError
from syncswitch.hparams import HParams, HParamsError, get_hparams
from syncswitch.spec import JobSpec, SegmentSpec, examples_per_update, second_moment_scale, switch_config

MOMENTUM = HParams(model="cnn", optimizer_momentum_momentum=0.9)
ADAM = HParams(model="cnn", optimizer="adam", optimizer_adam_beta1=0.8)


@pytest.mark.parametrize(
    ("rule", "momentum"),
    [("keep", 0.9), ("zero", 0.0), ("scaled", 0.9 / 4), ("ramped", 0.9 / 4 + (0.9 - 0.9 / 4) * 0.5)],
)
def test_momentum_sgd_under_asp_scales_the_lr_and_applies_the_momentum_rule(
    rule: str, momentum: float
) -> None:
    config = switch_config("asp", MOMENTUM, 4, rule, ramp_steps=10, steps_into_segment=5)
    assert config.learning_rate_scale == pytest.approx(0.25)
    assert config.momentum == pytest.approx(momentum)
    assert switch_config("bsp", MOMENTUM, 4, rule, 10, 5) == (switch_config("bsp", MOMENTUM, 4, "keep", 0, 0))


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("rule", ["keep", "zero", "scaled", "ramped"])
def test_adam_under_asp_takes_the_lr_scale_alone_and_keeps_beta1(optimizer: str, rule: str) -> None:
    """The momentum rule has no Adam counterpart: beta1 averages, it does not multiply the step."""
    hp = HParams(model="cnn", optimizer=optimizer, optimizer_adam_beta1=0.8)
    for steps_into_segment in (0, 5, 50):
        config = switch_config("asp", hp, 4, rule, ramp_steps=10, steps_into_segment=steps_into_segment)
        assert (config.learning_rate_scale, config.momentum) == (0.25, 0.8)
    bsp = switch_config("bsp", hp, 4, rule, ramp_steps=10, steps_into_segment=0)
    assert (bsp.learning_rate_scale, bsp.momentum) == (1.0, 0.8)


def test_adams_second_moment_follows_the_update_batch_across_a_switch() -> None:
    """BSP (16 x 32 per update) -> ASP (32): the second moment x16, and back /16; the same batch, a
    checkpoint without the record, or momentum SGD: unchanged."""
    assert second_moment_scale(ADAM, 512, 32) == 16.0
    assert second_moment_scale(ADAM, 32, 512) == 1 / 16
    assert second_moment_scale(ADAM.override("optimizer=adamw"), 512, 32) == 16.0
    assert second_moment_scale(ADAM, 32, 32) == second_moment_scale(ADAM, None, 32) == 1.0
    assert second_moment_scale(MOMENTUM, 512, 32) == 1.0


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adamw"])
@pytest.mark.parametrize(
    ("protocol", "lr_scale", "update_batch"),
    [("bsp", 1.0, 128), ("cbsp", 1.0, 128), ("local", 1.0, 32), ("asp", 0.25, 32), ("ssp", 0.25, 32)],
)
def test_every_protocol_has_a_policy_for_every_optimizer(
    optimizer: str, protocol: str, lr_scale: float, update_batch: int
) -> None:
    """4 workers of 32: the global-batch protocols (BSP, compressed BSP, local SGD) keep the base LR
    and first moment; the per-worker ones (ASP, SSP) divide the LR by N, with the momentum rule for
    momentum SGD alone. Adam's second moment follows the update batch: the global batch for BSP and
    compressed BSP, one worker's for ASP, SSP and a local SGD replica."""
    hp = HParams(model="cnn", optimizer=optimizer, optimizer_momentum_momentum=0.9, optimizer_adam_beta1=0.8)
    first = 0.9 if optimizer == "momentum" else 0.8
    config = switch_config(protocol, hp, 4, "zero", ramp_steps=0, steps_into_segment=0)
    per_worker = lr_scale < 1.0
    expected = 0.0 if per_worker and optimizer == "momentum" else first
    assert (config.learning_rate_scale, config.momentum) == pytest.approx((lr_scale, expected))
    assert examples_per_update(protocol, 32, 4) == update_batch
    from_bsp = second_moment_scale(hp, examples_per_update("bsp", 32, 4), update_batch)
    assert from_bsp == (1.0 if optimizer == "momentum" else 128 / update_batch)


def _schedule(protocol: str, hp: HParams, start_step: float, start_updates: int, per_step: int):  # noqa: ANN202
    from syncswitch.trainer import Schedule

    spec = SegmentSpec(
        run_id="r",
        run_dir="/tmp/unused",
        index=1,
        protocol=protocol,
        until_step=200,
        total_steps=200,
        model="cnn",
        hparam_set="cnn_digits",
        problem="digits",
        num_workers=per_step if protocol == "asp" else 2,
    )
    return Schedule(spec, hp, start_step, start_updates=start_updates, updates_per_step=per_step)


def test_each_steps_update_number_continues_the_jobs_count_across_protocols() -> None:
    """BSP after 100 steps and 60 ASP updates: its steps are updates 161, 162, ...; ASP with 4 workers
    from step 100 (100 updates done): the update at progress 100.25 is the 102nd."""
    import tensorflow as tf

    hp = ADAM.override("optimizer_adam_beta2=0.99,optimizer_adam_epsilon=1e-6")
    bsp = _schedule("bsp", hp, 100.0, 160, 1)
    config = bsp.tensors(tf.constant(101.0, tf.float64))
    assert float(config.update) == 162.0
    assert (float(config.momentum), float(config.beta2)) == pytest.approx((0.8, 0.99))
    assert float(config.epsilon) == pytest.approx(1e-6)
    asp = _schedule("asp", hp, 100.0, 100, 4)
    # An ASP worker's progress: (start samples + update * batch) / global batch, as asp.py computes it.
    for update in (0, 1, 7, 399):
        step = tf.constant((100 * 128 + update * 32) / 128, tf.float64)
        assert float(asp.tensors(step).update) == 100 + update + 1
    lr_bsp, _ = bsp.at(100.0)
    lr_asp, beta1 = asp.at(100.0)
    assert lr_asp == pytest.approx(lr_bsp / 4) and beta1 == pytest.approx(0.8)


def test_optimizer_hparams_are_checked_and_one_optimizer_serves_a_job() -> None:
    base = get_hparams("cnn_digits")
    assert base.optimizer == "momentum"
    assert base.override("optimizer=adamw").optimizer == "adamw"
    with pytest.raises(HParamsError, match=r"optimizer 'sgd' is not one of momentum, adam, adamw"):
        base.override("optimizer=sgd")
    with pytest.raises(HParamsError, match=r"optimizer_adam_beta2 must be in \[0, 1\)"):
        base.override("optimizer_adam_beta2=1.0")
    with pytest.raises(HParamsError, match=r"optimizer_adam_epsilon must be > 0"):
        base.override("optimizer_adam_epsilon=0")
    JobSpec.from_params(
        {"switch_order": "10", "hparams": ["optimizer=adam", "optimizer=adam,learning_rate=0.01"]}
    )
    with pytest.raises(
        SpecError, match=r"^hparams: optimizer must be the same in every segment .*adam, momentum"
    ):
        JobSpec.from_params({"switch_order": "10", "hparams": ["optimizer=adam", ""]})
