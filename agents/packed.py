"""Collectives of a whole pytree as one flat buffer, for use inside `jax.shard_map`.

Between the CPU devices of different processes (gloo) a collective costs milliseconds
whatever its size, and XLA's combined collectives (one all-reduce of a tuple) still pay
it per operand: training's iteration, which would move a dozen episode fields and a few
dozen gradient leaves, moves each kind of value in one collective instead.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree


def _words(x: jax.Array, axis: int) -> jax.Array:
  """`x` with `axis` first, flattened to 32-bit words, uint32 [x.shape[axis], k]."""
  x = jnp.moveaxis(x, axis, 0)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  elif x.dtype.itemsize == 4:
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    raise ValueError(f"cannot pack a {x.dtype} leaf into 32-bit words.")
  return words.reshape(x.shape[0], -1)


def _unwords(words: jax.Array, like: jax.Array, axis: int) -> jax.Array:
  """The inverse of `_words` for a leaf shaped like `like` whose `axis` now has
  `words.shape[0]` entries."""
  moved = jnp.moveaxis(like, axis, 0)
  words = words.reshape((words.shape[0],) + moved.shape[1:])
  x = words != 0 if like.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(words, like.dtype)
  return jnp.moveaxis(x, 0, axis)


def all_gather(tree: chex.ArrayTree, axis_name: str, axes: chex.ArrayTree) -> chex.ArrayTree:
  """Every device's `tree` concatenated along each leaf's axis `axes` (a tree of ints
  matching `tree`), in the order of the mesh axis `axis_name`: one all-gather of one uint32
  buffer [n * rows, words]. Leaves must agree in the size of their gathered axis and be
  32-bit or bool."""
  leaves, treedef = jax.tree.flatten(tree)
  leaf_axes = treedef.flatten_up_to(axes)
  parts = [_words(x, a) for x, a in zip(leaves, leaf_axes)]
  widths = [p.shape[1] for p in parts]
  gathered = jax.lax.all_gather(jnp.concatenate(parts, axis=1), axis_name, tiled=True)
  bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
  return treedef.unflatten(
    [
      _unwords(gathered[:, lo:hi], x, a)
      for x, a, lo, hi in zip(leaves, leaf_axes, bounds, bounds[1:])
    ]
  )


def all_gather_rows(tree: chex.ArrayTree, axis_name: str) -> chex.ArrayTree:
  """Every device's `tree` concatenated along each leaf's first axis (leaves [rows, ...],
  the same rows in each), in the order of the mesh axis `axis_name`: one all-gather of one
  float32 buffer [n * rows, k]. Differentiable, unlike `all_gather` (its transpose is one
  reduce-scatter); integer and bool leaves travel as float32, exact below 2**24."""
  leaves, treedef = jax.tree.flatten(tree)
  rows = leaves[0].shape[0]
  parts = [x.reshape(rows, -1).astype(jnp.float32) for x in leaves]
  widths = [p.shape[1] for p in parts]
  gathered = jax.lax.all_gather(jnp.concatenate(parts, axis=1), axis_name, tiled=True)
  bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
  return treedef.unflatten(
    [
      gathered[:, lo:hi].reshape((-1,) + x.shape[1:]).astype(x.dtype)
      for x, lo, hi in zip(leaves, bounds, bounds[1:])
    ]
  )


def pmean(tree: chex.ArrayTree, axis_name: str) -> chex.ArrayTree:
  """The mean of a float tree over the devices of `axis_name`: one all-reduce of one
  vector."""
  flat, unravel = ravel_pytree(tree)
  return unravel(jax.lax.pmean(flat, axis_name))
