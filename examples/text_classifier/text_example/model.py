"""``text_embedding``: embeddings of the tokens, a masked max over the sequence, a hidden layer, logits.

The Embedding layer's gradient is sparse (only the rows of the batch's tokens); the training loops
make it dense for the flat weight groups (syncswitch.params), so it trains under BSP and ASP alike.
Dropout adds integer seed state, which the runtime carries in a variable of its own.
"""

from __future__ import annotations

import keras
from keras import layers
from syncswitch.hparams import HParams
from syncswitch.registry import register_hparams, register_model


@keras.saving.register_keras_serializable(package="text_example")
class MaskedMax(layers.Layer):
    """Per-dimension max over the embeddings of the non-padding tokens (token 0 is padding). A keyword
    stands out in a max; a mean dilutes it among ~30 filler tokens (it did not learn in 3 epochs)."""

    def call(self, embedded, tokens):  # noqa: ANN001, ANN201 - Keras tensors
        padding = keras.ops.cast(keras.ops.equal(tokens, 0), embedded.dtype)[..., None]
        return keras.ops.max(embedded - 1e4 * padding, axis=1)


@register_model("text_embedding")
def text_embedding(hp: HParams, problem) -> keras.Model:  # noqa: ANN001 - a syncswitch Problem
    tokens = keras.Input(shape=(problem.max_length,), dtype="int32", name="tokens")
    embedded = layers.Embedding(problem.vocab_size, hp.embedding_dim, name="embedding")(tokens)
    pooled = MaskedMax(name="masked_max")(embedded, tokens)
    hidden = layers.Dense(hp.hidden_units, activation="relu", name="hidden")(pooled)
    hidden = layers.Dropout(hp.dropout, name="dropout")(hidden)
    logits = layers.Dense(problem.num_classes, name="logits")(hidden)
    return keras.Model({"tokens": tokens}, logits, name="text_embedding")


@register_hparams("text_embedding")
def text_embedding_hparams() -> HParams:
    return HParams(
        model="text_embedding",
        batch_size=32,
        learning_rate=0.1,
        weight_decay=0.0,
        optimizer_momentum_momentum=0.9,
        extra={"embedding_dim": 16, "hidden_units": 32, "dropout": 0.1},
    )
