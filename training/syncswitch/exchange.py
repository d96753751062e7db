"""What one optimizer step sends over the network, per protocol, and how many bytes that is.

    gradient_exchange(protocol, flat)    the exchange a segment's step function uses
    payload_bytes(tensors)               bytes of the tensors handed to the network

An exchange turns a replica's gradients into the gradients the update applies, and counts its own
payload: the bytes of every tensor this worker hands to a collective or sends to the parameter
servers in one step, taken from the tensors themselves when the step is traced (shape x dtype), so
a compression's count is what it sends, not what its ratio promises. A ring all-reduce moves about
2 (N - 1) / N times its input per worker; the figure here is the input, the same measure for every
protocol.

    DenseExchange       BSP: the optimizer's float32 SUM all-reduce; the gradients and the batch-norm
                        statistics (whose MEAN all-reduce is the variable's aggregation)
    Fp16Exchange        compressed BSP: the gradients cast to float16, summed, cast back
    TopKExchange        compressed BSP: per worker, the ``ratio`` largest entries (by magnitude) of
                        gradient + residual, their values (float32) and indices (int32) all-gathered
                        and summed into a dense gradient; the residual keeps what was not sent
                        (error feedback: Stich et al., 2018). Residuals are the worker's own and are
                        not checkpointed: each segment starts them at zero.
    ParameterServerExchange  ASP, SSP: the gradients pushed and the weights read, each step, plus
                        the statistics read and written
    LocalExchange       local SGD between averages: nothing
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from syncswitch.protocols import Protocol


def payload_bytes(tensors: list[Any]) -> int:
    """Bytes of ``tensors`` (their static shapes, as traced)."""
    return int(sum(t.shape.num_elements() * t.dtype.size for t in tensors))


class DenseExchange:
    """BSP: gradients summed by the optimizer's all-reduce (``summed`` False)."""

    summed = False

    def __init__(self, flat: Any) -> None:
        self.flat = flat

    def reduce(self, grads: list[Any]) -> tuple[list[Any], int]:
        return grads, payload_bytes(grads) + self.statistics_bytes()

    def statistics_bytes(self) -> int:
        return self.flat.stats_layout.total * 4


class Fp16Exchange(DenseExchange):
    """Compressed BSP, FP16: half the bytes of the dense all-reduce's gradients."""

    summed = True

    def reduce(self, grads: list[Any]) -> tuple[list[Any], int]:
        half = [tf.cast(g, tf.float16) for g in grads]
        summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, half)
        return [tf.cast(s, tf.float32) for s in summed], payload_bytes(half) + self.statistics_bytes()


class TopKExchange(DenseExchange):
    """Compressed BSP, top-k with error feedback. Build it outside any strategy scope: each residual
    is this worker's own variable."""

    summed = True

    def __init__(self, flat: Any, ratio: float) -> None:
        super().__init__(flat)
        self.ratio = ratio
        sizes = flat.weights_layout.group_sizes
        self.residuals = [
            tf.Variable(tf.zeros([n]), trainable=False, name=f"residual_{i}") for i, n in enumerate(sizes)
        ]

    def kept(self, size: int) -> int:
        """How many entries of a gradient of ``size`` are sent each step."""
        return max(1, min(size, round(self.ratio * size)))

    def reduce(self, grads: list[Any]) -> tuple[list[Any], int]:
        context = tf.distribute.get_replica_context()
        dense, sent = [], []
        for grad, residual in zip(grads, self.residuals, strict=True):
            size = int(grad.shape.num_elements())
            accumulated = grad + residual
            _, indices = tf.math.top_k(tf.abs(accumulated), k=self.kept(size), sorted=False)
            values = tf.gather(accumulated, indices)
            residual.assign(tf.tensor_scatter_nd_update(accumulated, indices[:, None], tf.zeros_like(values)))
            all_values = context.all_gather(values, axis=0)
            all_indices = context.all_gather(indices, axis=0)
            dense.append(tf.scatter_nd(all_indices[:, None], all_values, [size]))  # duplicates add up
            sent += [values, indices]
        return dense, payload_bytes(sent) + self.statistics_bytes()


class ParameterServerExchange(DenseExchange):
    """ASP and SSP: the update runs on the parameter servers; a step reads every weight group and
    the statistics, and sends every gradient group and the statistics."""

    summed = False  # a parameter-server worker is its own single replica: nothing to sum with

    def reduce(self, grads: list[Any]) -> tuple[list[Any], int]:
        weights = self.flat.weights_layout.total * 4
        return grads, payload_bytes(grads) + weights + 2 * self.statistics_bytes()


class LocalExchange(DenseExchange):
    """Local SGD between averages: the replica is the worker's own; the average's bytes are counted
    where it runs (syncswitch.local_sgd)."""

    summed = True

    def reduce(self, grads: list[Any]) -> tuple[list[Any], int]:
        return grads, 0


def gradient_exchange(protocol: Protocol, flat: Any) -> DenseExchange:
    """The exchange of a segment's protocol."""
    if protocol.name == "cbsp":
        return Fp16Exchange(flat) if protocol.compression == "fp16" else TopKExchange(flat, protocol.ratio)
    if protocol.name == "local":
        return LocalExchange(flat)
    if protocol.family.per_worker_updates:
        return ParameterServerExchange(flat)
    return DenseExchange(flat)
