"""A replay buffer as a pytree: a fixed-capacity ring of training samples, pure `add` and `sample`.

Being a plain pytree of arrays, the buffer lives inside the training state: it is jitted
with the update step and checkpointed with it, so a resumed run samples exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


@chex.dataclass(frozen=True)
class Buffer:
  """A ring of `capacity` samples (any pytree whose leaves have a leading axis [capacity, ...]).

  Attributes:
    items: the samples, leaves [capacity, ...].
    position: where the next sample goes, int32 [].
    size: how many slots hold samples, int32 [] (at most `capacity`).
  """

  items: chex.ArrayTree
  position: jax.Array
  size: jax.Array

  @property
  def capacity(self) -> int:
    return jax.tree.leaves(self.items)[0].shape[0]


def empty(example: chex.ArrayTree, capacity: int) -> Buffer:
  """A buffer of `capacity` zeroed slots shaped like `example` (one sample, no leading axis)."""
  items = jax.tree.map(
    lambda x: jnp.zeros((capacity,) + jnp.shape(x), jnp.asarray(x).dtype), example
  )
  return Buffer(items=items, position=jnp.int32(0), size=jnp.int32(0))


def add(buffer: Buffer, batch: chex.ArrayTree, valid: jax.Array) -> Buffer:
  """Writes the samples of `batch` (leaves [N, ...]) whose `valid` (bool [N]) is set, in
  order, overwriting the oldest. Pure; N (at most the capacity) and the capacity are static."""
  n = valid.shape[0]
  chex.assert_tree_shape_prefix(batch, (n,))
  capacity = buffer.capacity
  if n > capacity:
    raise ValueError(f"A batch of {n} samples does not fit a buffer of {capacity}.")
  offset = jnp.cumsum(valid) - 1  # Rank of each valid sample among the valid ones.
  slot = jnp.where(valid, (buffer.position + offset) % capacity, capacity)  # Invalid: dropped.
  items = jax.tree.map(lambda store, new: store.at[slot].set(new, mode="drop"), buffer.items, batch)
  count = valid.sum(dtype=jnp.int32)
  return Buffer(
    items=items,
    position=(buffer.position + count) % capacity,
    size=jnp.minimum(buffer.size + count, capacity),
  )


def sample(
  buffer: Buffer, key: chex.PRNGKey, n: int, start: jax.Array | int = 0, count: int | None = None
) -> chex.ArrayTree:
  """`n` samples drawn uniformly with replacement from the filled slots (leaves [n, ...]),
  or of those only the `count` from `start` on (leaves [count, ...]; a device's part of a
  minibatch: the n draws do not depend on which part is taken). The buffer must hold at
  least one sample."""
  index = jax.random.randint(key, (n,), 0, jnp.maximum(buffer.size, 1))
  if count is not None:
    index = jax.lax.dynamic_slice_in_dim(index, start, count)
  return jax.tree.map(lambda x: x[index], buffer.items)
