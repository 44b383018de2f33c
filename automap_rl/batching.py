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


def batch_last(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
  """Wraps `fn(static, batch)` into `f(static, arrays)`.

  Args:
    fn: takes `static`, a pytree of unbatched arrays (tables), and `batch`, a pytree of
      arrays with a trailing batch axis [..., B]; returns a pytree whose leaves lead with
      the batch axis [B, ...].

  Returns:
    `f(static, arrays)` for one plan's arrays, returning `fn`'s outputs for that plan.
    Vmapped over `arrays` (and not over `static`) it calls `fn` once for the batch;
    vmapped over `static` too (a batch of different programs) it maps the plain call.
  """

  def plain(static, arrays):
    out = fn(static, jax.tree.map(lambda x: x[..., None], arrays))
    return jax.tree.map(lambda x: x[0], out)

  @jax.custom_batching.custom_vmap
  def wrapped(static, arrays):
    return plain(static, arrays)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, static, arrays):
    static_batched, arrays_batched = in_batched
    if any(jax.tree.leaves(static_batched)):
      axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
      out = jax.vmap(plain, in_axes=tuple(axes))(static, arrays)
    else:
      def last(x, batched):
        return jnp.moveaxis(x, 0, -1) if batched else jnp.broadcast_to(x[..., None], (*x.shape, axis_size))

      out = fn(static, jax.tree.map(last, arrays, arrays_batched))
    return out, jax.tree.map(lambda _: True, out)

  return wrapped
