"""The cost of a resolved plan: a pure, jittable, vmappable function of arrays.

Per op signature: compute is a roofline (the larger of flop time and HBM time) divided by
the op's shard count. Per edge (an op using or making a value):

* operand stored on axes the op does not shard: all-gather over those axes; on an axis
  the op shards on another dim: all-to-all; sharded where stored replicated: a free slice.
* result with sharded reduction factors: a partial sum, reduce-scattered over the axes its
  stored sharding uses, all-reduced over the rest; computed sharded on axes it is not
  stored on: all-gather.

Collectives are ring algorithms in an alpha-beta model over the mesh axes they span (the
slowest link bounds the bandwidth). Bytes follow `automap_rl.xla.hlo`'s convention: the
larger, group-level buffer per device. Peak memory is the largest live-bytes row of the
program (see `tables._live_bytes`) with every value divided by its shard count.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from automap_rl.sharding import Resolution
from automap_rl.simulator.tables import CostTables

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _ALL_TO_ALL = range(len(KINDS))


@chex.dataclass(frozen=True)
class Cost:
  """What a plan costs per training step, per device.

  Attributes:
    step_time: compute plus communication time, seconds (no overlap assumed).
    compute_time: seconds of compute.
    comm_time: seconds of collectives.
    peak_memory: bytes per device at the peak.
    fits: whether `peak_memory` fits in the device's memory.
    comm_bytes: bytes per device by kind, in `KINDS` order, [4].
    comm_count: collectives per step by kind, [4].
  """

  step_time: jax.Array
  compute_time: jax.Array
  comm_time: jax.Array
  peak_memory: jax.Array
  fits: jax.Array
  comm_bytes: jax.Array
  comm_count: jax.Array


def _bits_or(masks: jax.Array, axis: int) -> jax.Array:
  """OR of axis bit masks that are disjoint along `axis` (a sum, which XLA fuses)."""
  return masks.sum(axis=axis)


def simulate(tables: CostTables, resolution: Resolution) -> Cost:
  """Costs one resolved plan. Vmap over resolutions for a batch of plans."""
  t = tables
  group = jnp.asarray(t.mask_group)
  value_mask, op_mask = resolution.value_mask, resolution.op_mask

  value_shards = group[_bits_or(value_mask, 1)]  # [Uv]
  op_shards = group[_bits_or(op_mask, 1)]  # [Uo]
  compute = (jnp.sum(jnp.maximum(t.op_compute_s, t.op_memory_s) / op_shards)
             + jnp.sum(jnp.maximum(t.value_compute_s, t.value_memory_s) / value_shards))

  stored = value_mask[t.edge_value]  # [E, Rv]
  factor_masks = op_mask[t.edge_op]  # [E, Rf]
  # Each dim's factors (at most two, -1 padded) index a zero-padded row of factor masks.
  padded = jnp.pad(factor_masks, ((0, 0), (0, 1)))
  required = jnp.take_along_axis(padded[:, None, :], t.edge_dim_factors, axis=2).sum(axis=2)
  stored_all, required_all = _bits_or(stored, 1), _bits_or(required, 1)
  op_reduced = jnp.sum(jnp.where(t.op_reduction, op_mask, 0), axis=1)[t.op_reduction_source]
  reduced = jnp.where(t.op_deferred, 0, op_reduced)[t.edge_op]  # [E]
  nbytes = t.value_bytes[t.edge_value]
  misplaced = jax.lax.reduce(stored & ~required, 0, jax.lax.bitwise_or, (1,))  # Axes stored elsewhere.
  moved_in = misplaced & required_all
  placed_out = jax.lax.reduce(required & ~stored, 0, jax.lax.bitwise_or, (1,))

  operand = ~t.edge_result
  gather_in = stored_all & ~required_all
  kept_in = stored_all & ~gather_in
  result_all_reduce = reduced & ~stored_all
  result_scatter = reduced & stored_all
  gather_out = required_all & ~stored_all
  moved_out = placed_out & stored_all & ~reduced

  # (kind, axes mask, bytes) of every possible collective on every edge.
  partial = nbytes / group[required_all]
  collectives = (
      (_ALL_GATHER, jnp.where(operand, gather_in, 0), nbytes / group[kept_in]),
      (_ALL_TO_ALL, jnp.where(operand, moved_in, 0), nbytes / group[stored_all]),
      (_REDUCE_SCATTER, jnp.where(operand, 0, result_scatter), partial),
      (_ALL_REDUCE, jnp.where(operand, 0, result_all_reduce), partial / group[result_scatter]),
      (_ALL_GATHER, jnp.where(operand, 0, gather_out), nbytes / group[stored_all]),
      (_ALL_TO_ALL, jnp.where(operand, 0, moved_out), nbytes / group[stored_all]),
  )
  comm_bytes = jnp.zeros(len(KINDS))
  comm_count = jnp.zeros(len(KINDS))
  comm_time = 0.0
  for kind, axes, size in collectives:
    n = group[axes]
    active = axes != 0
    weight = jnp.where(active, t.edge_weight, 0.0)
    steps = 2.0 * (n - 1) if kind == _ALL_REDUCE else n - 1
    seconds = steps / n * size / jnp.asarray(t.mask_bandwidth)[axes] + steps * jnp.asarray(t.mask_latency)[axes]
    comm_time = comm_time + jnp.sum(weight * seconds)
    comm_bytes = comm_bytes.at[kind].add(jnp.sum(weight * size))
    comm_count = comm_count.at[kind].add(jnp.sum(weight))

  peak = jnp.max(jnp.asarray(t.live_bytes) @ (1.0 / value_shards))
  return Cost(
      step_time=compute + comm_time,
      compute_time=compute,
      comm_time=comm_time,
      peak_memory=peak,
      fits=peak <= t.hbm_bytes,
      comm_bytes=comm_bytes,
      comm_count=comm_count,
  )
