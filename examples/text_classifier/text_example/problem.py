"""``synthetic_text``: token sequences whose class is told by which keywords they contain.

Generated offline with numpy from a fixed seed (nothing to download), so every node builds the same
data. Each class owns a few keyword tokens; a sequence of class c holds 1-3 of c's keywords among
filler tokens, and a distractor keyword of another class in 30% of them, so a bag-of-embeddings model
learns it but not in one step. Sequences have random lengths, padded with 0 to ``MAX_LENGTH``.
"""

from __future__ import annotations

from functools import cache
from typing import Unpack

import numpy as np
import tensorflow as tf
from syncswitch.problems import Problem, TrainStream, training_pipeline
from syncswitch.registry import register_problem

VOCAB_SIZE = 2000
MAX_LENGTH = 48
NUM_CLASSES = 4
KEYWORDS_PER_CLASS = 12
TRAIN_EXAMPLES = 4096
TEST_EXAMPLES = 1024


@cache
def make_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32 [N, MAX_LENGTH], labels int32 [N])`` of ``train`` or ``test``."""
    rng = np.random.default_rng({"train": 1, "test": 2}[split])
    count = TRAIN_EXAMPLES if split == "train" else TEST_EXAMPLES
    keywords = np.arange(1, 1 + NUM_CLASSES * KEYWORDS_PER_CLASS).reshape(NUM_CLASSES, KEYWORDS_PER_CLASS)
    labels = rng.integers(0, NUM_CLASSES, size=count).astype(np.int32)
    tokens = np.zeros((count, MAX_LENGTH), np.int32)
    for row, label in enumerate(labels):
        length = int(rng.integers(MAX_LENGTH // 3, MAX_LENGTH + 1))
        sequence = rng.integers(1 + keywords.size, VOCAB_SIZE, size=length)
        places = rng.choice(length, size=4, replace=False)
        hits = int(rng.integers(1, 4))
        sequence[places[:hits]] = rng.choice(keywords[label], size=hits)
        if rng.random() < 0.3:
            other = (label + rng.integers(1, NUM_CLASSES)) % NUM_CLASSES
            sequence[places[3]] = rng.choice(keywords[other])
        tokens[row, :length] = sequence
    return tokens, labels


@register_problem("synthetic_text")
class SyntheticText(Problem):
    """Keyword classification of padded token sequences: features are ``{"tokens": int32 [B, L]}``."""

    vocab_size = VOCAB_SIZE
    max_length = MAX_LENGTH
    num_classes = NUM_CLASSES

    def train_dataset(self, local_dir: str, **stream: Unpack[TrainStream]) -> tf.data.Dataset:
        # do_not_convert: under ParameterServerStrategy this runs in a traced dataset_fn.
        tokens, labels = tf.autograph.experimental.do_not_convert(make_split)("train")
        examples = tf.data.Dataset.from_tensor_slices(({"tokens": tokens}, labels))
        return training_pipeline(examples, shuffle_buffer=len(labels), **stream)

    def test_dataset(self, local_dir: str, *, batch_size: int) -> tf.data.Dataset:
        tokens, labels = make_split("test")
        return tf.data.Dataset.from_tensor_slices(({"tokens": tokens}, labels)).batch(batch_size)
