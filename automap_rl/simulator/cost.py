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
program (see `tables._live_bytes`) with every value divided by its shard count, plus the
gathered copies of operands (once per value and sharding, as XLA reuses them), all taken
to be live at the peak, as FSDP's gathered parameters live from the forward to the
backward pass. (Full-size partial sums before a reduce-scatter are not added: on the
validation suite that over-estimates FSDP plans.) It is compared with XLA's
`memory_analysis()` figure `argument + output + temp - alias`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from automap_rl import batching
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


def _group_size(t: CostTables, masks: jax.Array) -> jax.Array:
  """Devices in a group spanning the axes of bit masks [...]: a product over the (at most a
  few) axes, elementwise, so it vectorises where a look-up in a table would not."""
  n = jnp.ones(masks.shape, jnp.float32)
  for axis in range(t.mask_group.shape[0].bit_length() - 1):
    n = n * jnp.where((jnp.right_shift(masks, axis) & 1) == 1, t.mask_group[1 << axis], 1.0)
  return n


def _collective_terms(t: CostTables) -> jax.Array:
  """Cost terms of a ring collective, by [all-reduce?, axes mask, divisor mask, term].

  A collective over `axes` moving a buffer of `nbytes / group(divisor)` per device takes
  `nbytes * terms[..., 0] + terms[..., 1]` seconds and moves `nbytes * terms[..., 2]` bytes:
  `steps = (n - 1)` (twice that for all-reduce) hops of `1/n` of the buffer at the slowest
  link's rate, plus a latency per hop. One small table, gathered once per edge.
  """
  n = t.mask_group[:, None]
  fraction = 1.0 / t.mask_group[None, :]
  per_hop = fraction / n * t.mask_seconds_per_byte[:, None]
  terms = [jnp.stack(jnp.broadcast_arrays(factor * (n - 1) * per_hop, factor * (n - 1) * t.mask_latency[:, None],
                                          fraction), axis=-1) for factor in (1.0, 2.0)]
  return jnp.stack(terms)


def _simulate(t: CostTables, masks: tuple[jax.Array, jax.Array]) -> Cost:
  """`simulate` for a batch of plans laid out batch-last (see `automap_rl.batching`).

  Args:
    t: the cost tables.
    masks: value-signature dim masks [Uv, Rv, B] and op-signature factor masks [Uo, Rf, B].

  Returns:
    The costs, each field leading with the batch [B, ...].
  """
  value_mask, op_mask = masks
  value_shards = _group_size(t, value_mask.sum(axis=1))  # [Uv, B]
  op_shards = _group_size(t, op_mask.sum(axis=1))  # [Uo, B]
  compute = (jnp.sum(jnp.maximum(t.op_compute_s, t.op_memory_s)[:, None] / op_shards, axis=0)
             + jnp.sum(jnp.maximum(t.value_compute_s, t.value_memory_s)[:, None] / value_shards, axis=0))

  # Masks are disjoint bit sets across the dims of a value and the factors of an op, so
  # sums over dims are ORs.
  stored = value_mask[t.edge_value]  # [E, Rv, B]
  padded = jnp.concatenate([op_mask, jnp.zeros_like(op_mask[:, :1])], axis=1)  # Factor -1: none.
  required = padded[t.edge_op[:, None, None], t.edge_dim_factors].sum(axis=2)  # [E, Rv, B]
  stored_all, required_all = stored.sum(axis=1), required.sum(axis=1)  # [E, B]
  overlap = (stored & required).sum(axis=1)
  misplaced, placed_out = stored_all - overlap, required_all - overlap
  op_reduced = jnp.where(t.op_reduction[:, :, None], op_mask, 0).sum(axis=1)[t.op_reduction_source]
  reduced = jnp.where(t.op_deferred[:, None], 0, op_reduced)[t.edge_op]  # [E, B]

  # Materialise the per-edge masks once: XLA would otherwise fuse their gathers into
  # every consumer and recompute them for each collective.
  stored_all, required_all, reduced, misplaced, placed_out = jax.lax.optimization_barrier(
      (stored_all, required_all, reduced, misplaced, placed_out))
  operand = ~t.edge_result[:, None]
  gather_in = stored_all & ~required_all
  result_scatter = reduced & stored_all
  # Every possible collective on every edge: its kind, its axes, and the axes dividing its
  # bytes (the per-device buffer it moves). An operand and a result edge can both
  # all-gather or all-to-all, so those share a row.
  collectives = (
      (_ALL_GATHER, jnp.where(operand, gather_in, required_all & ~stored_all),
       jnp.where(operand, stored_all & ~gather_in, stored_all)),
      (_ALL_TO_ALL, jnp.where(operand, misplaced & required_all, placed_out & stored_all & ~reduced), stored_all),
      (_REDUCE_SCATTER, jnp.where(operand, 0, result_scatter), required_all),
      (_ALL_REDUCE, jnp.where(operand, 0, reduced & ~stored_all), required_all | result_scatter),
  )
  nbytes = t.value_bytes[t.edge_value][:, None]
  edge_weight = t.edge_weight[:, None]
  terms = _collective_terms(t)
  transient = 0.0  # Bytes of gathered operands, [B].
  comm_time = 0.0
  comm_bytes = [0.0] * len(KINDS)
  comm_count = [0.0] * len(KINDS)
  for kind, axes, divisor in collectives:
    # Seconds per byte, seconds, and the bytes fraction of this kind over these axes.
    per_byte, fixed, fraction = jnp.moveaxis(terms[int(kind == _ALL_REDUCE), axes, divisor], -1, 0)
    weight = jnp.where(axes != 0, edge_weight, 0.0)
    comm_time = comm_time + jnp.sum(weight * (nbytes * per_byte + fixed), axis=0)
    comm_bytes[kind] = comm_bytes[kind] + jnp.sum(weight * nbytes * fraction, axis=0)
    comm_count[kind] = comm_count[kind] + jnp.sum(weight, axis=0)
    if kind == _ALL_GATHER:  # Gathered operands add to the peak.
      gathered = operand & (axes != 0)
      transient = transient + jnp.sum(jnp.where(gathered, t.edge_buffers[:, None], 0.0) * nbytes * fraction, axis=0)

  peak = jnp.max(t.live_bytes @ (1.0 / value_shards), axis=0) + transient
  return Cost(
      step_time=compute + comm_time,
      compute_time=compute,
      comm_time=comm_time,
      peak_memory=peak,
      fits=peak <= t.hbm_bytes,
      comm_bytes=jnp.stack(comm_bytes, axis=-1),
      comm_count=jnp.stack(comm_count, axis=-1),
  )


_simulate_one_or_many = batching.batch_last(_simulate)


def simulate(tables: CostTables, resolution: Resolution) -> Cost:
  """Costs one resolved plan. Vmap over resolutions for a batch of plans: the batch then
  runs in one batch-last call (see `automap_rl.batching`)."""
  return _simulate_one_or_many(tables, (resolution.value_mask, resolution.op_mask))
