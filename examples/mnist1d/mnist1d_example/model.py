"""``mnist1d_cnn``: three strided Conv1D + BatchNormalization + ReLU blocks, dropout, logits.

The shape of the MNIST-1D paper's CNN (3 convolutions of width 5, stride 2), with batch norm and
dropout added so that the model carries the two kinds of extra state the runtime must hand over
between protocols: float moving statistics (averaged over BSP's replicas, saved in checkpoints) and
the dropout layer's integer seed (kept in a variable of its own).
"""

from __future__ import annotations

import keras
from keras import layers
from syncswitch.hparams import HParams
from syncswitch.registry import register_hparams, register_model

# A faster-moving average than Keras' 0.99, as the built-in models use: the moving statistics used at
# evaluation are good after a few hundred steps instead of a few thousand.
BN_MOMENTUM = 0.9


def _conv_block(x: keras.KerasTensor, filters: int, kernel_size: int, name: str) -> keras.KerasTensor:
    """Conv (stride 2, no bias: batch norm's offset replaces it) -> BN -> ReLU."""
    x = layers.Conv1D(filters, kernel_size, strides=2, padding="same", use_bias=False, name=f"{name}_conv")(x)
    x = layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x)


@register_model("mnist1d_cnn")
def mnist1d_cnn(hp: HParams, problem) -> keras.Model:  # noqa: ANN001 - the mnist1d Problem
    """The CNN for ``problem``'s signal length and classes; widths from ``hp.filters``."""
    signal = keras.Input(shape=(problem.sequence_length, 1), name="signal")
    x = signal
    for index in range(3):
        x = _conv_block(x, hp.filters, hp.kernel_size, name=f"block{index + 1}")
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dropout(hp.dropout, name="dropout")(x)
    logits = layers.Dense(problem.num_classes, name="logits")(x)
    return keras.Model(signal, logits, name="mnist1d_cnn")


@register_hparams("mnist1d_cnn")
def mnist1d_cnn_hparams() -> HParams:
    """32 signals per worker, LR 0.05 for the BSP global batch with Nesterov momentum 0.9 and cosine
    decay; the model's ``filters``, ``kernel_size`` and ``dropout`` (override with ``--hparams``)."""
    return HParams(
        model="mnist1d_cnn",
        batch_size=32,
        learning_rate=0.05,
        weight_decay=1e-4,
        optimizer_momentum_momentum=0.9,
        extra={"filters": 32, "kernel_size": 5, "dropout": 0.2},
    )
