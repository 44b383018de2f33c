"""Axis bit masks packed as X-bit fields of int32 words (X mesh axes).

Slot s of a row is field `s % slots_per_word(X)` of word `s // slots_per_word(X)`. Both
resolution (which computes the masks packed, one word per owner and plan) and the
simulator (whose edges read a few rows' words instead of every dim's mask) use this layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def slots_per_word(num_axes: int) -> int:
  """How many X-bit fields one int32 word holds (the sign bit unused)."""
  return max(1, 31 // max(num_axes, 1))


def pack(masks: jax.Array, num_axes: int) -> jax.Array:
  """Axis bit masks [N, R, B] as words [W, N, B], one reduction per word."""
  per_word = slots_per_word(num_axes)
  words = []
  for start in range(0, masks.shape[1], per_word):
    part = masks[:, start : start + per_word].astype(jnp.int32)
    shifts = num_axes * jnp.arange(part.shape[1], dtype=jnp.int32)[None, :, None]
    words.append(jnp.sum(part << shifts, axis=1))  # Disjoint fields: a sum is an OR.
  return jnp.stack(words)


def read(words: jax.Array, rows: jax.Array, slots: jax.Array, num_axes: int) -> jax.Array:
  """The masks of slots `slots` in rows `rows` of `words` [W, N, B], int8 [..., B].

  `rows` and `slots` broadcast to one shape; a slot outside [0, W * slots_per_word) reads 0.
  """
  per_word = slots_per_word(num_axes)
  gathered = words[:, rows]  # [W, *rows.shape, B]
  index = slots[..., None]
  word = gathered[0]
  for w in range(1, words.shape[0]):
    word = jnp.where(index // per_word == w, gathered[w], word)
  field = (word >> (num_axes * (index % per_word))) & ((1 << num_axes) - 1)
  in_range = (index >= 0) & (index < words.shape[0] * per_word)
  return jnp.where(in_range, field, 0).astype(jnp.int8)
