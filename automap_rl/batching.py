"""Batch-last implementations behind ordinary vmappable functions.

XLA on CPU vectorises along the minor-most axis. `jax.vmap` puts the batch first, so the
simulator's many small per-edge reductions and table look-ups run along axes of size 4
or 8. `batch_last(fn)` writes a function once, for arrays whose LAST axis is a batch of
plans, and returns a function with ordinary semantics: called plainly it runs a batch of
one; under `jax.vmap` (a `custom_vmap` rule) it runs the whole batch in that layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Entries of one tile's largest per-element arrays ([elements, plans]): gpt:layers=12's
# simulator (1734 edges) runs 2.5x faster per plan in tiles of 128 plans than in one
# batch of 1024, whose arrays outgrow the CPU's caches (BENCHMARKS.md).
TILE_ENTRIES = 1 << 18


def next_power_of_two(n: int, smallest: int = 1) -> int:
  """The smallest power of two at or above `n`, and at least `smallest`: a padded size
  that bounds how many shapes (and so compiles) a growing size goes through."""
  return max(smallest, 1 << max(n - 1, 0).bit_length())


def tile_for(elements: int) -> int:
  """Plans per tile for a computation over `elements` rows per plan: the power of two
  (16 to 1024) nearest below `TILE_ENTRIES / elements`."""
  return 1 << min(max((TILE_ENTRIES // max(elements, 1)).bit_length() - 1, 4), 10)


def batch_last(
  fn: Callable[[Any, Any], Any], tile: Callable[[Any], int] | None = None, any_rank: bool = False
) -> Callable[[Any, Any], Any]:
  """Wraps `fn(static, batch)` into `f(static, arrays)`.

  Args:
    fn: takes `static`, a pytree of unbatched arrays (tables), and `batch`, a pytree of
      arrays with a trailing batch axis [..., B]; returns a pytree whose leaves lead with
      the batch axis [B, ...].
    tile: plans per call of `fn` given `static` (see `tile_for`); a larger vmapped batch
      runs in a loop over tiles of this many (the last one padded by repeating a plan).
      None: one call.
    any_rank: `fn` also takes one plan's arrays without the batch axis and returns its
      outputs without it; called plainly, `f` runs it so (where a batch of one in the
      batch-last layout would be slower).

  Returns:
    `f(static, arrays)` for one plan's arrays, returning `fn`'s outputs for that plan.
    Vmapped over `arrays` (and not over `static`) it calls `fn` once per tile of the
    batch; vmapped over `static` too (a batch of different programs) it maps the plain call.
  """

  def plain(static, arrays):
    if any_rank:
      return fn(static, arrays)
    out = fn(static, jax.tree.map(lambda x: x[..., None], arrays))
    return jax.tree.map(lambda x: x[0], out)

  def last(x):
    return jnp.moveaxis(x, 0, -1)

  @jax.custom_batching.custom_vmap
  def wrapped(static, arrays):
    return plain(static, arrays)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, static, arrays):
    static_batched, arrays_batched = in_batched
    if any(jax.tree.leaves(static_batched)):
      axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
      out = jax.vmap(plain, in_axes=tuple(axes))(static, arrays)
      return out, jax.tree.map(lambda _: True, out)
    size = axis_size if tile is None else tile(static)
    if axis_size <= size:
      out = fn(
        static,
        jax.tree.map(
          lambda x, b: last(x) if b else jnp.broadcast_to(x[..., None], (*x.shape, axis_size)),
          arrays,
          arrays_batched,
        ),
      )
      return out, jax.tree.map(lambda _: True, out)
    count = -(-axis_size // size)

    def tiles(x, batched):
      x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
      x = jnp.concatenate([x, jnp.broadcast_to(x[:1], (count * size - axis_size, *x.shape[1:]))])
      return x.reshape(count, size, *x.shape[1:])

    out = jax.lax.map(
      lambda part: fn(static, jax.tree.map(last, part)), jax.tree.map(tiles, arrays, arrays_batched)
    )
    out = jax.tree.map(lambda y: y.reshape(count * size, *y.shape[2:])[:axis_size], out)
    return out, jax.tree.map(lambda _: True, out)

  return wrapped


def only_where(
  fn: Callable[[Any, Any], Any], fill: Callable[[Any], Any]
) -> Callable[[Any, Any, jax.Array], Any]:
  """Wraps `fn(static, arrays)` into `f(static, arrays, needed)`: `fn`'s result where
  `needed` (bool []), else `fill(static)` (a pytree of `fn`'s output structure).

  Called plainly it is a `lax.cond`. Vmapped over `arrays` and `needed` (not over
  `static`), where a cond would become a select that runs `fn` on every row, the rows
  that need it are gathered into the smallest of the power-of-two capacities B/16, B/8,
  ..., B that holds them, and `fn` runs vmapped on those alone (a `lax.switch` between
  the capacities, a real branch); the result is scattered back. Padding rows of a
  capacity repeat the first needed row and write back its own result. Vmapped over
  `static` too (a batch of different programs), every row runs `fn` and selects.
  """

  def plain(static, arrays, needed):
    return jax.lax.cond(needed, lambda: fn(static, arrays), lambda: fill(static))

  def select(static, arrays, needed):
    return jax.tree.map(lambda a, b: jnp.where(needed, a, b), fn(static, arrays), fill(static))

  @jax.custom_batching.custom_vmap
  def wrapped(static, arrays, needed):
    return plain(static, arrays, needed)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, static, arrays, needed):
    static_batched, arrays_batched, needed_batched = in_batched
    if any(jax.tree.leaves(static_batched)):
      axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
      out = jax.vmap(select, in_axes=tuple(axes))(static, arrays, needed)
      return out, jax.tree.map(lambda _: True, out)
    arrays = jax.tree.map(
      lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *x.shape)), arrays, arrays_batched
    )
    needed = needed if needed_batched else jnp.broadcast_to(needed, (axis_size,))
    default = jax.tree.map(lambda x: jnp.broadcast_to(x, (axis_size, *jnp.shape(x))), fill(static))
    capacities = sorted({max(axis_size >> shift, 1) for shift in range(5)})

    def run(capacity: int):
      def branch(arrays, needed):
        index = jnp.nonzero(needed, size=capacity, fill_value=jnp.argmax(needed))[0]
        part = jax.vmap(fn, in_axes=(None, 0))(static, jax.tree.map(lambda x: x[index], arrays))
        return jax.tree.map(lambda d, p: d.at[index].set(p.astype(d.dtype)), default, part)

      return branch

    count = needed.sum()
    which = jnp.where(count == 0, 0, 1 + jnp.searchsorted(jnp.array(capacities), count))
    out = jax.lax.switch(which, [lambda *_: default] + [run(c) for c in capacities], arrays, needed)
    return out, jax.tree.map(lambda _: True, out)

  return wrapped
