"""What compute hides of the collectives an asynchronous runtime runs behind it, one rule
for a step (`simulator.cost`) and for a pipeline's microbatches and flush
(`simulator.pipeline`). Which collectives can hide is `simulator.tables.overlap`'s job
(`CostTables.edge_hideable`, `reduction_hideable`); whether the backend runs them
asynchronously is `CostTables.async_collectives`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from automap_rl.simulator.tables import CostTables


def unhidden(
  async_collectives: jax.Array, hideable: jax.Array, compute: jax.Array, one_run: jax.Array
) -> jax.Array:
  """Seconds of `hideable` collectives that `compute` does not hide: what exceeds the
  compute, and at least `one_run`, one run of the longest of them (the first prefetch, the
  last reduction), which has nothing to run behind; all of them where collectives are not
  asynchronous. The arrays broadcast alike."""
  return jnp.where(async_collectives, jnp.maximum(one_run, hideable - compute), hideable)


def step_hidden(
  t: CostTables, reshard: jax.Array, reduce: jax.Array, per_edge: bool, compute: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Seconds of a batch of plans' hideable collectives and of those their `compute` [B]
  does not hide, [B] each, from the seconds of the reshards of each edge (or class of
  edges, `per_edge` False) [E', B] and of each reduction [R, B]."""
  rows, weight = (
    (t.edge_hideable, t.edge_weight) if per_edge else (t.unique_hideable, t.unique_weight)
  )
  hideable_reshard = jnp.where(rows[:, None], reshard, 0.0)
  hideable_reduce = jnp.where(t.reduction_hideable[:, None], reduce, 0.0)
  hideable = jnp.sum(hideable_reshard, axis=0) + jnp.sum(hideable_reduce, axis=0)
  runs = lambda x, w: jnp.max(x / jnp.maximum(w, 1.0)[:, None], axis=0, initial=0.0)
  one_run = jnp.maximum(runs(hideable_reshard, weight), runs(hideable_reduce, t.reduction_weight))
  return hideable, unhidden(t.async_collectives, hideable, compute, one_run)
