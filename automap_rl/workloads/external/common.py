"""What the external families share: random integer ids (tokens, node indices, labels)
and the cross-entropy loss they put on their models' outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training


def random_ids(key: jax.Array, shape: tuple[int, ...], vocab: int) -> jax.Array:
  """Random ids in [0, vocab) (tokens, node indices, labels), int32 ``shape``."""
  return jax.random.randint(key, shape, 0, vocab, jnp.int32)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Softmax cross-entropy of ``logits`` [..., classes] against int ``labels`` [...],
  in at least float32, per position [...]."""
  return optax.softmax_cross_entropy_with_integer_labels(training.widen(logits), labels)
