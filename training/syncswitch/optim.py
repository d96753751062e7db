"""The optimizers, whose updates run where each variable lives, with their hyper-parameters given per step.

    optimizer = build_optimizer(hp, variables, decay_masks)        # under the strategy's scope
    optimizer.apply(grads, variables, StepConfig(lr, momentum, beta2, epsilon, update))  # in strategy.run

The hparams' ``optimizer`` chooses one (``syncswitch.hparams.OPTIMIZERS``):

- ``momentum`` (the default, the paper's): Nesterov or heavy-ball momentum SGD, Keras' SGD math
  (``ResourceApplyKerasMomentum``); one slot per variable, its velocity. ``weight_decay`` is t2t's L2
  term: ``weight_decay * variable`` added to the gradient.
- ``adam``: Keras' Adam math (``ResourceApplyAdam``: bias-corrected first and second moments, epsilon
  outside the square root); two slots per variable. ``weight_decay`` is the same L2 term as for
  momentum, added to the gradient before the moments see it.
- ``adamw``: Adam with decoupled weight decay (Loshchilov & Hutter), Keras' AdamW math: each update
  first shrinks the variable by ``learning_rate * weight_decay``, then applies Adam to the gradient
  alone.

Why not Keras' optimizers:
- The hyper-parameters come from the progress-based schedule (configuration policy + LR schedule) at
  every step, as tensors (``StepConfig``). Keras fixes momentum and the betas at construction and keys
  its LR and Adam's bias correction on ``optimizer.iterations``, which loses increments under ASP (its
  ``assign_add`` is not atomic across workers); setting them through optimizer variables cost two
  parameter-server writes per step and a read per variable.
- Adam's bias correction counts ``StepConfig.update``: the update's number in the job, which the loop
  hands out (BSP's step; the update ASP's coordinator assigns to a closure's step) and the checkpoint
  carries (``updates``). It is exact and deterministic whatever order workers apply their updates in,
  a closure rescheduled after a lost worker keeps its numbers, and it costs no parameter-server
  variable: a counter on the parameter server would add a read-modify-write to every step and still
  race between workers.
- Each variable's update is one fused kernel placed with the variable by ``strategy.extended.update``:
  under ParameterServerStrategy it runs on the parameter server, so only the gradient and one packed
  vector of the step's hyper-parameters cross the network, not the variable and its slots.
- Weight decay is applied there too, from the variable the update reads anyway: no second read of
  every kernel on the worker for an L2 loss term. ``decay_masks`` says, per variable, which elements
  decay (1) and which do not (0): the flat weight groups of syncswitch.params hold kernels, batch-norm
  scales and biases side by side.

The same code runs under every protocol (both strategies, and a local SGD replica's own variables), so
they apply identical numerics, and the slots are checkpointed with the weights (syncswitch.params'
per-variable templates): a checkpoint restores bit-identically in any protocol. ``apply`` returns the
update ops, for what must follow them (SSP's clock, local SGD's average), and takes ``summed`` where
the caller did the all-reduce (compressed BSP) or has none to do (a local SGD replica).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import numpy as np
import tensorflow as tf


class StepConfig(NamedTuple):
    """One optimizer step's hyper-parameters, as scalar tensors computed in the step graph by
    syncswitch.trainer.Schedule (plain numbers in tests). Each optimizer reads the ones it needs."""

    learning_rate: Any
    momentum: Any  # momentum SGD's momentum; Adam's beta1
    beta2: Any = 0.999
    epsilon: Any = 1e-7
    update: Any = 1  # this update's number in the job, from 1 (Adam's bias correction)


class SlotOptimizer(tf.Module):
    """Slots per variable (checkpointed through syncswitch.params), colocated with their variables, and
    the update, placed with each variable. Build it under the strategy's scope.

    A subclass names its slots (``SLOTS``), packs the step's hyper-parameters into one vector
    (``_pack``, on the worker) and updates one variable from it (``_update_one``, beside the
    variable)."""

    SLOTS: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        variables: list[Any],
        *,
        weight_decay: float = 0.0,
        decay_masks: list[Any] | None = None,
        name: str = "optimizer",
    ) -> None:
        super().__init__(name=name)
        self.weight_decay = float(weight_decay)
        strategy = tf.distribute.get_strategy()
        self.slots: dict[str, list[Any]] = {slot: [] for slot in self.SLOTS}
        for variable in variables:
            # Each slot lives with its variable (the same parameter server), so the update is local.
            with strategy.extended.colocate_vars_with(_tf_variable(variable)):
                for slot, values in self.slots.items():
                    values.append(
                        tf.Variable(
                            tf.zeros(variable.shape, variable.dtype),
                            trainable=False,
                            name=f"{slot}_{_short_name(variable)}",
                        )
                    )
        # Positions, not variables, as values: a dict of trackables would be checkpointed as such.
        self._position = {_key(v): i for i, v in enumerate(variables)}
        masks = decay_masks if decay_masks is not None else [0.0] * len(variables)
        self._masks = [np.asarray(m, dtype=np.float32) for m in masks]

    def apply(
        self, grads: list[Any], variables: list[Any], config: StepConfig, *, summed: bool = False
    ) -> list[Any]:
        """One update of every variable; returns the update ops (to order work after them). Call in
        a replica context (inside ``strategy.run``): gradients are summed across replicas first
        (MultiWorkerMirroredStrategy's all-reduce; a no-op for the single replica of a
        parameter-server worker), unless ``summed`` says the caller did (a compressed all-reduce) or
        that there is nothing to sum with (a local SGD replica)."""
        context = tf.distribute.get_replica_context()
        if context is not None and not summed:
            grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        pairs = list(zip(grads, variables, strict=True))
        return tf.__internal__.distribute.interim.maybe_merge_call(
            self._update_all, tf.distribute.get_strategy(), pairs, config
        )

    def _update_all(self, strategy: Any, pairs: list[tuple[Any, Any]], config: StepConfig) -> list[Any]:
        # Packed once on the worker: one transfer to each parameter server instead of one per scalar.
        packed = self._pack(StepConfig(*(tf.cast(value, tf.float32) for value in config)))
        updates = []
        for grad, variable in pairs:
            position = self._position[_key(variable)]
            slots = [self.slots[slot][position] for slot in self.SLOTS]
            updates.append(
                strategy.extended.update(
                    _tf_variable(variable),
                    self._update_one,
                    args=(grad, slots, self._masks[position], packed),
                    group=False,
                )
            )
        return updates

    def _decayed_gradient(self, variable: Any, grad: Any, mask: np.ndarray) -> Any:
        """The gradient of the loss plus t2t's L2 term, ``weight_decay * variable`` where it decays."""
        grad = tf.cast(grad, variable.dtype)
        if self.weight_decay and mask.any():
            decay = tf.constant(self.weight_decay * mask, variable.dtype)  # built here: on its device
            grad = grad + decay * variable.read_value()
        return grad

    def _pack(self, config: StepConfig) -> Any:
        raise NotImplementedError

    def _update_one(self, variable: Any, grad: Any, slots: list[Any], mask: np.ndarray, packed: Any) -> Any:
        raise NotImplementedError


class MomentumSGD(SlotOptimizer):
    """Keras' SGD with momentum (Nesterov by default): one velocity per variable."""

    SLOTS = ("velocities",)

    def __init__(self, variables: list[Any], *, nesterov: bool = True, **kwargs: Any) -> None:
        super().__init__(variables, name=kwargs.pop("name", "momentum_sgd"), **kwargs)
        self.nesterov = nesterov

    @property
    def velocities(self) -> list[Any]:
        return self.slots["velocities"]

    def _pack(self, config: StepConfig) -> Any:
        return tf.stack([config.learning_rate, config.momentum])

    def _update_one(self, variable: Any, grad: Any, slots: list[Any], mask: np.ndarray, packed: Any) -> Any:
        (velocity,) = map(_local, slots)
        packed = tf.cast(packed, variable.dtype)
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle,
            accum=velocity.handle,
            lr=packed[0],
            grad=self._decayed_gradient(variable, grad, mask),
            momentum=packed[1],
            use_nesterov=self.nesterov,
        )


class Adam(SlotOptimizer):
    """Keras' Adam (``decoupled=False``, with ``weight_decay`` as an L2 term on the gradient) or AdamW
    (``decoupled=True``): first and second moments per variable."""

    SLOTS = ("first_moments", "second_moments")

    def __init__(self, variables: list[Any], *, decoupled: bool = False, **kwargs: Any) -> None:
        super().__init__(variables, name=kwargs.pop("name", "adamw" if decoupled else "adam"), **kwargs)
        self.decoupled = decoupled

    def _pack(self, config: StepConfig) -> Any:
        # The bias corrections' powers, once per step on the worker: beta ** (the update's number).
        update = tf.cast(config.update, tf.float32)
        return tf.stack(
            [
                config.learning_rate,
                config.momentum,
                config.beta2,
                config.epsilon,
                tf.pow(config.momentum, update),
                tf.pow(config.beta2, update),
            ]
        )

    def _update_one(self, variable: Any, grad: Any, slots: list[Any], mask: np.ndarray, packed: Any) -> Any:
        first, second = map(_local, slots)
        packed = tf.cast(packed, variable.dtype)
        learning_rate, beta1, beta2, epsilon, beta1_power, beta2_power = tf.unstack(packed)
        if self.decoupled:
            if self.weight_decay and mask.any():
                decay = tf.constant(self.weight_decay * mask, variable.dtype)
                variable.assign_sub(variable.read_value() * decay * learning_rate)
            grad = tf.cast(grad, variable.dtype)
        else:
            grad = self._decayed_gradient(variable, grad, mask)
        return tf.raw_ops.ResourceApplyAdam(
            var=variable.handle,
            m=first.handle,
            v=second.handle,
            beta1_power=beta1_power,
            beta2_power=beta2_power,
            lr=learning_rate,
            beta1=beta1,
            beta2=beta2,
            epsilon=epsilon,
            grad=grad,
        )


def build_optimizer(hp: Any, variables: list[Any], decay_masks: list[Any] | None = None) -> SlotOptimizer:
    """The optimizer ``hp.optimizer`` names (syncswitch.hparams.OPTIMIZERS) over ``variables``; build it
    under the strategy's scope."""
    common = {"weight_decay": hp.weight_decay, "decay_masks": decay_masks}
    if hp.optimizer == "momentum":
        return MomentumSGD(variables, nesterov=hp.optimizer_momentum_nesterov, **common)
    if hp.optimizer in ("adam", "adamw"):
        return Adam(variables, decoupled=hp.optimizer == "adamw", **common)
    raise ValueError(f"hparams: optimizer {hp.optimizer!r} is not one of momentum, adam, adamw")


def slot_names(optimizer: str) -> tuple[str, ...]:
    """The slots an optimizer keeps per variable, in checkpoint and digest order."""
    return Adam.SLOTS if optimizer in ("adam", "adamw") else MomentumSGD.SLOTS


def _local(slot: Any) -> Any:
    """The copy of a slot on this update's device (a MirroredVariable's under BSP)."""
    if isinstance(slot, tf.distribute.DistributedValues):
        return slot._get_on_device_or_primary()  # noqa: SLF001 - as Keras' slots do
    return slot


def _tf_variable(variable: Any) -> Any:
    """The tf.Variable behind a Keras 3 variable."""
    return getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable


def _key(variable: Any) -> Any:
    return _tf_variable(variable).ref()


def _short_name(variable: Any) -> str:
    return getattr(variable, "path", getattr(variable, "name", "var")).replace("/", "_").replace(":", "_")
