"""Momentum SGD whose update runs where each variable lives, with LR and momentum given per step.

    optimizer = MomentumSGD(variables, nesterov=True, weight_decay=1e-4, decay_masks=[1.0, mask, 0.0])
    optimizer.apply(grads, variables, learning_rate, momentum)   # inside strategy.run

Why not Keras' SGD:
- LR and momentum come from the progress-based schedule (configuration policy + LR schedule) at every
  step, as tensors. Keras fixes momentum at construction and keys its LR on ``optimizer.iterations``,
  which loses increments under ASP (its ``assign_add`` is not atomic across workers); setting them
  through optimizer variables cost two parameter-server writes per step and a read per variable.
- Each variable's update is one fused kernel (``ResourceApplyKerasMomentum``, Keras' own SGD math)
  placed with the variable by ``strategy.extended.update``: under ParameterServerStrategy it runs on the
  parameter server, so only the gradient crosses the network, not the variable and its velocity.
- Weight decay (L2, as t2t's ``weight_decay * l2_loss``) is added to the gradient there too, from the
  variable the update reads anyway: no second read of every kernel on the worker for an L2 loss term.
  ``decay_masks`` says, per variable, which elements decay (1) and which do not (0): the flat weight
  groups of syncswitch.params hold kernels, batch-norm scales and biases side by side.
  The same code runs under both strategies, so BSP and ASP apply identical numerics and a checkpoint
  restores bit-identically in either.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf


class MomentumSGD(tf.Module):
    """Velocity slots (checkpointed) and the update. Build it under the strategy's scope."""

    def __init__(
        self,
        variables: list[Any],
        *,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        decay_masks: list[Any] | None = None,
        name: str = "momentum_sgd",
    ) -> None:
        super().__init__(name=name)
        self.nesterov = nesterov
        self.weight_decay = float(weight_decay)
        strategy = tf.distribute.get_strategy()
        self.velocities = []
        for variable in variables:
            # Each slot lives with its variable (the same parameter server), so the update is local.
            with strategy.extended.colocate_vars_with(_tf_variable(variable)):
                self.velocities.append(
                    tf.Variable(
                        tf.zeros(variable.shape, variable.dtype),
                        trainable=False,
                        name=f"velocity_{_short_name(variable)}",
                    )
                )
        # Positions, not variables, as values: a dict of trackables would be checkpointed as such.
        self._position = {_key(v): i for i, v in enumerate(variables)}
        masks = decay_masks if decay_masks is not None else [0.0] * len(variables)
        self._masks = [np.asarray(m, dtype=np.float32) for m in masks]

    def apply(
        self,
        grads: list[Any],
        variables: list[Any],
        learning_rate: Any,
        momentum: Any,
        *,
        summed: bool = False,
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
            self._update_all, tf.distribute.get_strategy(), pairs, learning_rate, momentum
        )

    def _update_all(
        self, strategy: Any, pairs: list[tuple[Any, Any]], learning_rate: Any, momentum: Any
    ) -> list[Any]:
        return [
            strategy.extended.update(
                _tf_variable(variable),
                self._update_one,
                args=(grad, *self._slot_and_mask(variable), learning_rate, momentum),
                group=False,
            )
            for grad, variable in pairs
        ]

    def _slot_and_mask(self, variable: Any) -> tuple[Any, np.ndarray]:
        position = self._position[_key(variable)]
        return self.velocities[position], self._masks[position]

    def _update_one(
        self, variable: Any, grad: Any, velocity: Any, mask: np.ndarray, learning_rate: Any, momentum: Any
    ) -> Any:
        if self.weight_decay and mask.any():
            decay = tf.constant(self.weight_decay * mask, variable.dtype)  # built here: on its device
            grad = grad + decay * variable.read_value()
        if isinstance(velocity, tf.distribute.DistributedValues):  # the replica's own copy
            velocity = velocity._get_on_device_or_primary()  # noqa: SLF001 - as Keras' slots do
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle,
            accum=velocity.handle,
            lr=tf.cast(learning_rate, variable.dtype),
            grad=tf.cast(grad, variable.dtype),
            momentum=tf.cast(momentum, variable.dtype),
            use_nesterov=self.nesterov,
        )


def _tf_variable(variable: Any) -> Any:
    """The tf.Variable behind a Keras 3 variable."""
    return getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable


def _key(variable: Any) -> Any:
    return _tf_variable(variable).ref()


def _short_name(variable: Any) -> str:
    return getattr(variable, "path", getattr(variable, "name", "var")).replace("/", "_").replace(":", "_")
