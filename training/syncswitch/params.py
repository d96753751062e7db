"""The model's weights as a few flat variables: what both training loops read and update every step.

Under ParameterServerStrategy every variable is a separate remote tensor: a ResNet-20 step read about
60 weights and 38 batch-norm statistics from the parameter servers, sent 60 gradients back and wrote
the statistics, about 220 transfers per optimizer step, each with a fixed cost on both ends. Here the
trainable weights are one flat vector per parameter-server group and the batch-norm statistics one
more: a step reads ``groups + 1`` tensors and writes ``groups + 1``. The Keras model computes on
slices of them through ``stateless_call``; its own variables are a local *template* that holds the
canonical form for checkpoints and evaluation. Under MultiWorkerMirroredStrategy the same layout
means one gradient all-reduce per step instead of one per variable.

Every protocol's loop uses this same code, so they apply identical numerics, and checkpoints stay in the
per-variable form (``tf.train.Checkpoint(model=template, optimizer=<slots per variable>)``): a
checkpoint written under any protocol restores bit-identically under any other, and evaluation reads
it into a plain model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from syncswitch.optim import StepConfig, build_optimizer


@dataclass(frozen=True)
class FlatLayout:
    """Where each variable lives in a flat vector, and how the vector splits into groups (at
    variable boundaries, balanced by size)."""

    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    group_sizes: tuple[int, ...]

    @classmethod
    def of(cls, variables: list[Any], groups: int) -> FlatLayout:
        shapes = tuple(tuple(int(d) for d in v.shape) for v in variables)
        sizes = tuple(int(np.prod(s)) for s in shapes)
        return cls(shapes, sizes, _balanced_groups(sizes, groups))

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def flatten(self, tensors: list[Any]) -> Any:
        return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0) if tensors else tf.zeros([0])

    def unflatten(self, flat: Any) -> list[Any]:
        if not self.sizes:  # a model without batch-norm statistics, say
            return []
        return [tf.reshape(p, s) for p, s in zip(tf.split(flat, self.sizes), self.shapes, strict=True)]

    def split_groups(self, flat: Any) -> list[Any]:
        return tf.split(flat, self.group_sizes) if len(self.group_sizes) > 1 else [flat]


def _balanced_groups(sizes: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """Contiguous groups of whole variables, about total/groups elements each."""
    groups = max(1, min(groups, len(sizes)))
    target = sum(sizes) / groups
    bounds, current = [], 0
    for size in sizes:
        current += size
        if current >= target * (len(bounds) + 1) and len(bounds) < groups - 1:
            bounds.append(current)
    edges = [0, *bounds, sum(sizes)]
    return tuple(b - a for a, b in zip(edges, edges[1:], strict=False) if b > a)


class FlatModel(tf.Module):
    """Flat weights, their optimizer's slots and the batch-norm statistics, placed by the strategy in
    scope.

    ``template`` is the Keras model built outside any strategy (local variables): its structure is
    the checkpoint's, its initial values start the flat variables. ``hp`` chooses the optimizer
    (syncswitch.optim.build_optimizer).
    """

    def __init__(self, template: Any, *, groups: int, hp: Any, decayed: list[Any]):
        super().__init__(name="flat_model")
        self._template = template
        trainable, non_trainable = template.trainable_variables, template.non_trainable_variables
        odd = [f"{v.path} ({v.dtype})" for v in trainable if v.dtype != "float32"]
        if odd:
            raise TypeError(
                f"model {template.name!r}: trainable weights must be float32 (mixed precision keeps its "
                f"variables in float32); got {', '.join(odd[:3])}"
            )
        # Float non-trainable state (batch-norm statistics) is one flat vector; other state (integer
        # seed generators of dropout layers, counters) stays in variables of its own.
        self._is_statistic = [v.dtype == "float32" for v in non_trainable]
        statistics = [v for v, flat in zip(non_trainable, self._is_statistic, strict=True) if flat]
        self.weights_layout = FlatLayout.of(trainable, groups)
        self.stats_layout = FlatLayout.of(statistics, 1)
        initial = self.weights_layout.split_groups(self.weights_layout.flatten([v.value for v in trainable]))
        self.params = [tf.Variable(chunk, name=f"weights_{i}") for i, chunk in enumerate(initial)]
        # Batch-norm moving statistics: averaged over the replicas of a synchronous step (each
        # replica saw its own batch), simply overwritten by an asynchronous worker's step.
        self.stats = tf.Variable(
            self.stats_layout.flatten([v.value for v in statistics]),
            trainable=False,
            name="batch_norm_statistics",
            aggregation=tf.VariableAggregation.MEAN,
        )
        self.other_state = [
            tf.Variable(
                v.value,
                trainable=False,
                name=f"state_{i}",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            for i, (v, flat) in enumerate(zip(non_trainable, self._is_statistic, strict=True))
            if not flat
        ]
        decayed_refs = {v.value.ref() for v in decayed}
        mask = self.weights_layout.flatten(
            [tf.fill(v.shape, 1.0 if v.value.ref() in decayed_refs else 0.0) for v in trainable]
        )
        masks = [m.numpy() for m in self.weights_layout.split_groups(mask)]
        self.optimizer = build_optimizer(hp, self.params, masks)

    def _non_trainable(self, statistics: list[Any], others: list[Any]) -> list[Any]:
        """The model's non-trainable values in its own order, from the flat statistics and the rest."""
        statistics, others = list(statistics), list(others)
        return [statistics.pop(0) if flat else others.pop(0) for flat in self._is_statistic]

    def _split_non_trainable(self, values: list[Any]) -> tuple[list[Any], list[Any]]:
        statistics = [v for v, flat in zip(values, self._is_statistic, strict=True) if flat]
        others = [v for v, flat in zip(values, self._is_statistic, strict=True) if not flat]
        return statistics, others

    # ---- one step (call inside strategy.run) ----------------------------------------------------

    def loss_and_gradients(self, x: Any, y: Any, loss_of: Any) -> tuple[Any, list[Any], Any]:
        """(loss, gradient per weight group, new non-trainable state) of one batch. Reads every
        weight group and the statistics once. ``loss_of(outputs, labels)`` is the scalar loss.

        An embedding's gradient arrives as IndexedSlices and is made dense here: the momentum update
        touches every row anyway (as Keras' SGD with momentum does), and one flat vector per group
        keeps ASP at ``groups + 1`` transfers a step. Weights the loss does not reach get zeros."""
        weights = self.weights_layout.unflatten(tf.concat([p.read_value() for p in self.params], 0))
        statistics = self.stats_layout.unflatten(self.stats.read_value())
        non_trainable = self._non_trainable(statistics, [v.read_value() for v in self.other_state])
        with tf.GradientTape() as tape:
            tape.watch(weights)
            outputs, new_non_trainable = self._template.stateless_call(
                weights, non_trainable, x, training=True
            )
            loss = loss_of(outputs, y)
        gradients = tape.gradient(loss, weights, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        dense = [tf.convert_to_tensor(g) for g in gradients]
        grads = self.weights_layout.split_groups(self.weights_layout.flatten(dense))
        if len(new_non_trainable) != len(self._is_statistic):
            raise ValueError(
                f"model {self._template.name!r} created variables when it was called: its builder must "
                "return it fully built (functional, or call it once on a batch, e.g. "
                "model(keras.ops.zeros((1, ...))), or implement build())"
            )
        new_statistics, new_others = self._split_non_trainable(list(new_non_trainable))
        return loss, grads, (self.stats_layout.flatten(new_statistics), new_others)

    def apply(
        self, grads: list[Any], new_state: Any, config: StepConfig, *, summed: bool = False
    ) -> list[Any]:
        """The update (``summed`` as SlotOptimizer.apply's) and the new non-trainable state; returns
        the ops that write them."""
        updates = self.optimizer.apply(grads, self.params, config, summed=summed)
        new_statistics, new_others = new_state
        writes = [self.stats.assign(new_statistics)]
        for variable, value in zip(self.other_state, new_others, strict=True):
            writes.append(variable.assign(value))
        return [op for op in [*tf.nest.flatten(updates), *writes] if op is not None]

    def _slot_variables(self) -> list[Any]:
        """Every slot's weight groups, slot by slot in the optimizer's order (SLOTS)."""
        return [v for slot in self.optimizer.SLOTS for v in self.optimizer.slots[slot]]

    def state_vector(self) -> Any:
        """Weights, every optimizer slot (a velocity, or Adam's two moments) and batch-norm statistics
        as one vector (what local SGD averages): a replica's slots are part of its state, so the
        average leaves every replica with the same optimizer too."""
        parts = [p.read_value() for p in self.params] + [v.read_value() for v in self._slot_variables()]
        return tf.concat([*parts, self.stats.read_value()], 0)

    def assign_state_vector(self, vector: Any) -> Any:
        """Write a vector of :meth:`state_vector`'s layout back; returns the op."""
        groups = self.weights_layout.group_sizes
        sizes = [*groups * (1 + len(self.optimizer.SLOTS)), self.stats_layout.total]
        parts = tf.split(vector, sizes)
        targets = [*self.params, *self._slot_variables(), self.stats]
        return tf.group(*[t.assign(v) for t, v in zip(targets, parts, strict=True)])

    # ---- the canonical (per-variable) form, for checkpoints ---------------------------------------

    def slot_templates(self) -> dict[str, list[Any]]:
        """Local per-variable slot variables (a velocity, or Adam's two moments), as a Keras
        optimizer's slots would be, by slot name in the optimizer's order."""
        if not hasattr(self, "_slot_templates"):
            self._slot_templates = {
                slot: [tf.Variable(tf.zeros(s), trainable=False) for s in self.weights_layout.shapes]
                for slot in self.optimizer.SLOTS
            }
        return self._slot_templates

    def scale_slot(self, slot: str, factor: float) -> None:
        """Multiply one slot of every weight group by ``factor`` (the configuration policy's, at a
        switch)."""
        for variable in self.optimizer.slots[slot]:
            variable.assign(variable.read_value() * factor)

    def to_template(self) -> None:
        """Copy the flat state into the template model and per-variable slots."""
        weights = self.weights_layout.unflatten(tf.concat([p.read_value() for p in self.params], 0))
        for variable, value in zip(self._template.trainable_variables, weights, strict=True):
            variable.assign(value)
        non_trainable = self._non_trainable(
            self.stats_layout.unflatten(self.stats.read_value()), [v.read_value() for v in self.other_state]
        )
        for variable, value in zip(self._template.non_trainable_variables, non_trainable, strict=True):
            variable.assign(value)
        for slot, templates in self.slot_templates().items():
            values = self.weights_layout.unflatten(
                tf.concat([v.read_value() for v in self.optimizer.slots[slot]], 0)
            )
            for variable, value in zip(templates, values, strict=True):
                variable.assign(value)

    def from_template(self) -> None:
        """Copy the template model and per-variable slots (just restored) into the flat state."""
        weights = self.weights_layout.flatten([v.value for v in self._template.trainable_variables])
        for param, chunk in zip(self.params, self.weights_layout.split_groups(weights), strict=True):
            param.assign(chunk)
        for slot, templates in self.slot_templates().items():
            chunks = self.weights_layout.split_groups(self.weights_layout.flatten(templates))
            for variable, chunk in zip(self.optimizer.slots[slot], chunks, strict=True):
                variable.assign(chunk)
        statistics, others = self._split_non_trainable(
            [v.value for v in self._template.non_trainable_variables]
        )
        self.stats.assign(self.stats_layout.flatten(statistics))
        for variable, value in zip(self.other_state, others, strict=True):
            variable.assign(value)
