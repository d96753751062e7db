"""Momentum SGD whose learning rate and momentum are set every step by the configuration policy.

Keras' SGD fixes momentum at construction and keys its LR schedule on ``optimizer.iterations``, which
loses increments under ASP (its ``assign_add`` is not atomic across workers). Here both values live in
optimizer variables that the training step assigns from the progress-based schedule, so the schedule
continues across protocol switches and the momentum rule (keep / zero / scaled / ramped) can change it.
"""

from __future__ import annotations

import keras
from keras import ops


class SwitchableSGD(keras.optimizers.SGD):
    def __init__(self, nesterov: bool = True, name: str = "switchable_sgd") -> None:
        # momentum must be non-zero here so that SGD.build creates the velocity slots.
        super().__init__(learning_rate=0.0, momentum=0.9, nesterov=nesterov, name=name)

    def build(self, variables: list) -> None:
        if self.built:
            return
        super().build(variables)
        # "only_first_replica": assigned in replica context under MirroredStrategy, where every
        # replica assigns the same value.
        self.step_learning_rate = self.add_variable(
            shape=(), aggregation="only_first_replica", name="step_learning_rate"
        )
        self.step_momentum = self.add_variable(
            shape=(), aggregation="only_first_replica", name="step_momentum"
        )

    def set_step_hparams(self, learning_rate, momentum) -> None:  # noqa: ANN001 - tensors
        self.step_learning_rate.assign(learning_rate)
        self.step_momentum.assign(momentum)

    def update_step(self, gradient, variable, learning_rate) -> None:  # noqa: ANN001, ARG002
        lr = ops.cast(self.step_learning_rate, variable.dtype)
        momentum = ops.cast(self.step_momentum, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        velocity = self.momentums[self._get_variable_index(variable)]
        self.assign(velocity, ops.subtract(ops.multiply(velocity, momentum), ops.multiply(gradient, lr)))
        if self.nesterov:
            self.assign_add(
                variable, ops.subtract(ops.multiply(velocity, momentum), ops.multiply(gradient, lr))
            )
        else:
            self.assign_add(variable, velocity)
