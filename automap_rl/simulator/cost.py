"""The cost of a resolved plan: a pure, jittable, vmappable function of arrays.

Per op signature: compute is a roofline (the larger of flop time and HBM time) divided by
the op's shard count, plus the overhead of the kernels it launches, which every device pays
whole (`Hardware.kernel_overhead_s`). Per edge (an op using or making a value):

* operand stored on axes the op does not shard: all-gather over those axes; on an axis the
  op shards on another dim, or on a minor factor of the same dim (a reshape's merged dim is
  stored split major factor first): all-to-all; sharded where stored replicated: a free
  slice. The reads of one value that need the same sharding share one such collective, as
  XLA reshards a value once per sharding (`tables.edges.operand_read_shares`, and
  `_unshared_reads` where a plan resolves such reads apart).
* result with sharded reduction factors: a partial sum, reduce-scattered over the axes its
  stored sharding uses, all-reduced over the rest (a linear combination of partial sums
  reduces all their buffers in one collective, as XLA's combiner does, each as its source
  computed it); on a backend without a native reduce-scatter (`Hardware.reduce_scatter`: XLA
  on CPU), a dot's partial sums are all-reduced whole over the axes the result is stored
  on and sliced, then all-reduced over the rest (other partial sums: one all-reduce over
  all those axes and a slice), as the SPMD partitioner writes it; the partial sums of two
  sharded reduction factors (a batch on one axis and a sequence on another) are
  all-reduced one factor after the other, as the partitioner does; computed sharded on
  axes it is not stored on: all-gather. A dot that leaves mesh axes idle
  computes, reduces and sends only the share its stored split owns, where the idle devices
  can hold the shares (`_split_over_idle_axes`).

XLA's combiners merge independent reductions of one kind over the same axes (the gradients
of data parallelism) into few collectives, up to the hardware profile's `combine_threshold`
bytes each: those reductions pay latency per combined collective
(`collectives.combined_count`), bandwidth per byte as before.

Collectives are ring algorithms in an alpha-beta model over the mesh axes they span (the
slowest link bounds the bandwidth). Where the backend runs collectives asynchronously,
weight reshards and weight-gradient reductions run behind compute (`tables.overlap`,
`overlap.step_hidden`). Bytes follow `automap_rl.xla.hlo`'s convention: the larger,
group-level buffer per device. Peak memory is the largest live-bytes row of the program (see
`tables.probe_rows`) with every value divided by its shard count, plus the gathered copies
of operands that several reads share (once per value and sharding, as XLA reuses them), all
taken to be live at the peak, as FSDP's gathered parameters live from the forward to the
backward pass, plus the largest copy gathered for one read alone (an activation gathered for
one op lives only while that op runs). (Full-size partial sums before a reduce-scatter are
not added: on the validation suite that over-estimates FSDP plans.) It is compared with
XLA's `memory_analysis()` figure `argument + output + temp - alias`."""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import batching, packing, sharding
from automap_rl.sharding import Resolution
from automap_rl.simulator.collectives import (
  COMM_KINDS,
  KINDS,
  EdgeTerms,
  axes_of,
  axis_count,
  edge_terms,
  group_size,
  sum_rows,
  with_second_factor,
)
from automap_rl.simulator.overlap import step_hidden
from automap_rl.simulator.permutes import (
  axis_precedence,
  permute_sums,
  permute_terms,
  reshard_permutes,
  swapped_axes,
)
from automap_rl.simulator.tables import CostTables

__all__ = [
  "COMM_KINDS",
  "KINDS",
  "Cost",
  "CostTerms",
  "evaluate",
  "replicated_reshards",
  "simulate",
  "terms",
  "total",
]


@chex.dataclass(frozen=True)
class Cost:
  """What a plan costs per training step, per device.

  Attributes:
    step_time: compute plus communication time, seconds.
    compute_time: seconds of compute.
    comm_time: seconds of collectives the compute does not hide (`overlap.step_hidden`).
    peak_memory: bytes per device at the peak.
    fits: whether `peak_memory` fits in the device's memory.
    comm_bytes: bytes per device by kind, in `COMM_KINDS` order (`KINDS`, then
      collective-permutes), [5].
    comm_count: collectives per step by kind, [5].
  """

  step_time: jax.Array
  compute_time: jax.Array
  comm_time: jax.Array
  peak_memory: jax.Array
  fits: jax.Array
  comm_bytes: jax.Array
  comm_count: jax.Array


@chex.dataclass(frozen=True)
class CostTerms:
  """The named terms whose sum is a plan's cost (see `total`), each with the plan batch
  laid out LAST inside the simulator and FIRST in what `terms` returns.

  Shapes (one plan): Uv value signatures, Uo op signatures, E edges (an op signature
  using or making a value signature: `CostTables.edge_op`, `edge_value`, `edge_result`),
  R reduction edges (`CostTables.reduction_edge`).

  Attributes:
    value_compute_s: seconds of the ops that shard like their values, charged to the
      signature of their first result, [Uv].
    op_compute_s: seconds of compute of all ops of each op signature, [Uo].
    gather: all-gathers on each edge: an operand stored on axes its op does not shard
      (resharding of that operand), or a result computed sharded on axes it is not stored
      on, [E] each of seconds, bytes per device and count.
    all_to_all: all-to-alls on each edge: an operand (result) stored on an axis its op
      shards on another dim, [E].
    reduce_scatter, all_reduce: the reduction of each result whose op's reduction factors
      are sharded: reduce-scattered over the axes its stored sharding uses, all-reduced
      over the rest, [R].
    permute: collective-permutes on each edge: a resharding that leaves shards on the wrong
      devices (`permutes.reshard_permutes`), [E].
    dot_permute: collective-permutes of each reduction: a split dot's shares sent to their
      owners (`_split_over_idle_axes`), [R].
    gathered_bytes: bytes per device of gathered operand copies each edge adds to the
      peak: those several reads share, [E].
    transient_bytes: bytes per device of the largest gathered operand copy each edge makes
      for one read alone, [E]; the largest of the program adds to the peak.
    reduced_axes: the mesh axes (bit mask) each reduction sums over, 0 where none, int8 [R].
    value_shards: how many shards each value signature is split into, [Uv].
  """

  value_compute_s: jax.Array
  op_compute_s: jax.Array
  gather: EdgeTerms
  all_to_all: EdgeTerms
  reduce_scatter: EdgeTerms
  all_reduce: EdgeTerms
  permute: EdgeTerms
  dot_permute: EdgeTerms
  gathered_bytes: jax.Array
  transient_bytes: jax.Array
  reduced_axes: jax.Array
  value_shards: jax.Array


def _dense_shards(t: CostTables, op_mask: jax.Array) -> jax.Array:
  """Shards of each op signature's `CostTables.op_dense_factor` (1 where none), from the
  op factor masks [Uo, Rf, B]; [Uo, B]."""
  factor = jnp.maximum(t.op_dense_factor, 0)[:, None, None]
  mask = jnp.take_along_axis(op_mask, factor, axis=1)[:, 0]
  return jnp.where((t.op_dense_factor >= 0)[:, None], group_size(t, axes_of(t, mask)), 1.0)


def _unshared_reads(
  t: CostTables, row_of_edge: jax.Array | None, moves: jax.Array, required: jax.Array, num_axes: int
) -> tuple[jax.Array, jax.Array]:
  """The runs of resharding a step, [S, B], that reads `edge_weight` prices as sharing one
  resharding add where they do not share it under the plan, and the row of each, [S].

  A read of a group of n (`CostTables.shared_slot_edge`) pays 1/n of a resharding in
  `edge_weight`. XLA (and the lowering) share one resharded copy among the reads that
  need the same sharding; a read that reshards where m reads of its group (itself
  included) reshard to the sharding it needs pays 1/m. Rows are edges (`row_of_edge`
  None) or classes of edges (`row_of_edge` [E], `CostTables.edge_unique`); `moves`
  [rows, B]: the row is an operand resharded (gathered or moved by all-to-all);
  `required` [rows, Rv, B]: the axes its op computes each dim on. Padding pairs (-1)
  count for no slot."""
  slot_row = t.shared_slot_edge if row_of_edge is None else row_of_edge[t.shared_slot_edge]  # [S]
  words = packing.pack(required[slot_row], num_axes)  # [W, S, B]
  slot_moves = moves[slot_row]  # [S, B]
  first, second = t.shared_pairs  # [Q] each.
  same = slot_moves[second] & jnp.all(words[:, first] == words[:, second], axis=0)  # [Q, B]
  sharers = jax.ops.segment_sum(
    same.astype(jnp.float32), first, slot_row.shape[0]
  )  # Drops padding (-1).
  share = jnp.where(
    slot_moves, 1.0 / jnp.maximum(sharers, 1.0) - t.shared_slot_share[:, None], 0.0
  )  # [S, B]
  return share * t.shared_slot_runs[:, None], slot_row


def _split_over_idle_axes(
  t: CostTables, op_axes: jax.Array, reduced: jax.Array, stored: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """How many ways XLA's partitioner splits each dot whose partial sums it reduces over
  devices its plan leaves idle, per reduction [R, B] and per op signature [Uo, B] (1 where
  it does not split), and the axes a split dot's shares cross to their owners [R, B].

  A dot's partial sums (`CostTables.reduction_dot`) summed over axes `reduced` [R, B] and
  stored split over axes S of those (`stored` [R, B]: the value's axes) are reduce-scattered,
  on a backend without a native reduce-scatter all-reduced whole and sliced. Where the dot
  leaves axes I of the mesh idle (`op_axes` [Uo, B]: the axes its factors use), its
  devices along I compute alike, and with |I| a multiple of |S| XLA has them compute a
  1/|S| share each instead: the share along S owned by the devices of their position
  along I, all-reduced over `reduced` and sent to its owner by a collective-permute (FSDP
  with the model axis idle: a quarter of each weight gradient on a 4 x 8 mesh, as XLA:CPU
  compiles it)."""
  every = t.mask_group.shape[-1] - 1  # The mask of every axis.
  op = t.edge_op[t.reduction_edge]
  idle = every & ~op_axes[op]
  scattered = reduced & stored
  n_idle, n_scattered = (group_size(t, axes_of(t, mask)) for mask in (idle, scattered))
  split = t.reduction_dot[:, None] & (scattered != 0) & (jnp.mod(n_idle, n_scattered) == 0)
  shards = jnp.where(split, n_scattered, 1.0)
  return (
    shards,
    jnp.take(shards, t.op_dot_reduction, axis=0, mode="fill", fill_value=1.0),
    scattered | idle,
  )


def _terms(t: CostTables, masks: tuple[jax.Array, jax.Array], per_edge: bool) -> CostTerms:
  """The cost terms of a batch of plans laid out batch-last (see `automap_rl.batching`).

  Args:
    t: the cost tables.
    masks: value-signature dim masks [Uv, Rv, B] and op-signature factor masks [Uo, Rf, B].
    per_edge: the gather and all-to-all terms and gathered bytes of every edge [E, B],
      for any masks; else of every class of edges that resolve alike
      (`CostTables.edge_unique`) [Eu, B], each from its first edge's masks with the
      class's summed weights and bytes (`CostTables.unique_weight`, ...): the same sums
      in fewer terms, for masks where signature slots that share an owner agree (those of
      `sharding.resolve` and `sharding.apply_decision`).

  Returns:
    The terms, each field [..., B].
  """
  # Masks are small bit sets: int8 keeps the per-edge arrays [E, B] at a byte an entry,
  # which keeps the whole computation's scratch memory small (see BENCHMARKS.md).
  value_mask, op_mask = (m.astype(jnp.int8) for m in masks)
  m = _edge_masks(t, value_mask, op_mask, per_edge)
  edges = _edge_collectives(t, m, per_edge, axis_precedence(t, value_mask))
  reduce_scatter, all_reduce, dot_permute, op_split = _reductions(t, m)
  gathered = m.operand & (edges.gather_axes != 0)
  return CostTerms(
    value_compute_s=jnp.maximum(t.value_compute_s, t.value_memory_s)[:, None] / m.value_shards
    + t.value_launch_s[:, None],
    op_compute_s=jnp.maximum(
      t.op_compute_s[:, None] / _dense_shards(t, op_mask) / op_split / m.op_shards,
      m.op_memory_s,
    )
    + t.op_launch_s[:, None],
    gather=edges.gather,
    all_to_all=edges.all_to_all,
    reduce_scatter=reduce_scatter,
    all_reduce=all_reduce,
    permute=edges.permute,
    dot_permute=dot_permute,
    gathered_bytes=jnp.where(gathered, edges.buffers[:, None], 0.0) * edges.gather.buffer,
    transient_bytes=jnp.where(gathered, edges.transient[:, None], 0.0) * edges.gather.buffer,
    reduced_axes=m.r_reduced,
    value_shards=m.value_shards,
  )


class _EdgeMasks(NamedTuple):
  """What a batch of plans' masks give the edges (`_edge_masks`), batch last: E' edges
  (every edge, or one per class of `CostTables.edge_unique`), R reductions.

  Attributes:
    value_shards: shards of each value signature, [Uv, B].
    op_axes, op_shards: the axes (bit mask) of each op signature's factors and its shard
      count, [Uo, B].
    op_memory_s: each op signature's HBM time, its edges' shares of their values, [Uo, B].
    edge: the edges the rows stand for, [E'].
    operand: the row is an operand, bool [E', 1].
    stored, required: the axes of each value dim as stored and as its op computes it,
      int8 [E', Rv, B].
    stored_all, required_all, overlap: their unions over dims and the axes on which
      stored and required agree (on a dim of several factors, the major factor's), [E', B].
    reduced: the axes the edge's op reduces over where it is a pending partial sum's
      reduction (0 for deferred ones), [E', B].
    r_stored, r_required, r_reduced, r_first: `stored_all`, `required_all`, `reduced` and
      the axes of the first sharded reduction factor, of the reductions, [R, B].
  """

  value_shards: jax.Array
  op_axes: jax.Array
  op_shards: jax.Array
  op_memory_s: jax.Array
  edge: np.ndarray
  operand: np.ndarray
  stored: jax.Array
  required: jax.Array
  stored_all: jax.Array
  required_all: jax.Array
  overlap: jax.Array
  reduced: jax.Array
  r_stored: jax.Array
  r_required: jax.Array
  r_reduced: jax.Array
  r_first: jax.Array


def _edge_masks(
  t: CostTables, value_mask: jax.Array, op_mask: jax.Array, per_edge: bool
) -> _EdgeMasks:
  """The masks of the edges and reductions of plans with value dim masks [Uv, Rv, B] and
  op factor masks [Uo, Rf, B] (int8), and the shards and HBM times they give; per edge
  or per class of edges (`_terms`)."""
  value_shards = group_size(t, axes_of(t, value_mask.sum(axis=1, dtype=jnp.int8)))  # [Uv, B]
  op_axes = op_mask.sum(axis=1, dtype=jnp.int8)  # [Uo, B]
  op_shards = group_size(t, axes_of(t, op_axes))

  # Masks are disjoint bit sets across the dims of a value and the factors of an op, so sums
  # over dims are ORs. The edges read the masks packed per value and op (one reduction each):
  # a gather of a few rows' words, where gathering every dim's mask would read them
  # transposed when the batch arrives first (the environment's states).
  num_axes = axis_count(t)
  edge = np.arange(t.edge_op.shape[0]) if per_edge else t.unique_edge
  edge_op = t.edge_op[edge]
  value_dims = np.arange(value_mask.shape[1])[None, :]
  stored = packing.read(
    packing.pack(value_mask, num_axes), t.edge_value[edge][:, None], value_dims, num_axes
  )  # [E or Eu, Rv, B]
  by_factor = packing.read(
    packing.pack(op_mask, num_axes), edge_op[:, None, None], t.edge_dim_factors[edge], num_axes
  )  # [E or Eu, Rv, F, B]; factor Rf (padding) is none.
  required = by_factor.sum(axis=2, dtype=jnp.int8)  # [E or Eu, Rv, B]
  stored_all = stored.sum(axis=1, dtype=jnp.int8)  # [E or Eu, B]
  required_all = required.sum(axis=1, dtype=jnp.int8)
  # Each op moves each operand and result as it computes on it: its share of the value.
  edge_shards = group_size(t, axes_of(t, required_all))  # [E or Eu, B]
  edge_shards = edge_shards if per_edge else edge_shards[t.edge_unique]  # [E, B]
  op_memory_s = jax.ops.segment_sum(
    t.edge_memory_s[:, None] / edge_shards, t.edge_op, t.op_compute_s.shape[0]
  )  # [Uo, B]
  # A dim of several factors (a reshape's merged dim) is stored in contiguous blocks, its
  # major factor first: axes on a minor factor do not match it (XLA runs an all-to-all).
  overlap = (stored & by_factor[:, :, 0]).sum(axis=1, dtype=jnp.int8)
  factor_reduced = jnp.where(t.op_reduction[:, :, None], op_mask, 0)  # [Uo, Rf, B]
  op_reduced = factor_reduced.sum(axis=1, dtype=jnp.int8)
  op_first = jnp.zeros_like(op_reduced)  # The axes of each op's first sharded reduction factor.
  for k in reversed(range(factor_reduced.shape[1])):
    op_first = jnp.where(factor_reduced[:, k] != 0, factor_reduced[:, k], op_first)
  reduced, first = (
    jnp.where(t.op_deferred[:, None], 0, x[t.op_reduction_source])[edge_op]  # [E or Eu, B]
    for x in (op_reduced, op_first)
  )
  reduction = t.reduction_edge if per_edge else t.edge_unique[t.reduction_edge]
  r_stored, r_required, r_reduced, r_first = (
    x[reduction]  # [R, B] each.
    for x in (stored_all, required_all, reduced, first)
  )
  return _EdgeMasks(
    value_shards=value_shards,
    op_axes=op_axes,
    op_shards=op_shards,
    op_memory_s=op_memory_s,
    edge=edge,
    operand=~t.edge_result[edge][:, None],
    stored=stored,
    required=required,
    stored_all=stored_all,
    required_all=required_all,
    overlap=overlap,
    reduced=reduced,
    r_stored=r_stored,
    r_required=r_required,
    r_reduced=r_reduced,
    r_first=r_first,
  )


class _EdgeCollectives(NamedTuple):
  """The all-gathers and all-to-alls of the edges (`_edge_collectives`), with what the
  gathered copies add to the peak: `gather_axes` [E', B], `buffers` (copies several reads
  share, or for classes their bytes) and `transient` (reads resharded alone, or for
  classes the largest bytes) [E']."""

  gather: EdgeTerms
  all_to_all: EdgeTerms
  permute: EdgeTerms
  gather_axes: jax.Array
  buffers: jax.Array
  transient: jax.Array


def _edge_collectives(
  t: CostTables, m: _EdgeMasks, per_edge: bool, precedence: jax.Array
) -> _EdgeCollectives:
  """Every all-gather, all-to-all and collective-permute of the edges (or classes of
  edges) under the masks `m` (`precedence`: `permutes.axis_precedence`), with the runs
  that reads priced as sharing a resharding add where the plan resolves them apart
  (`_unshared_reads`)."""
  operand = m.operand
  if per_edge:
    nbytes = t.value_bytes[t.edge_value]
    weight, weighted_bytes, buffers, buffer_bytes = (
      t.edge_weight,
      t.edge_weight * nbytes,
      t.edge_buffers,
      nbytes,
    )
    transient = (t.edge_transient > 0).astype(jnp.float32)
  else:
    weight, weighted_bytes, buffers = (
      t.unique_weight,
      t.unique_weighted_bytes,
      t.unique_buffer_bytes,
    )
    buffer_bytes, transient = jnp.ones_like(buffers), t.unique_transient_bytes
  misplaced, placed_out = m.stored_all - m.overlap, m.required_all - m.overlap
  gather_in = m.stored_all & ~m.required_all
  # Every possible collective on every edge: its axes, and the axes dividing its bytes
  # (the per-device buffer it moves). An operand and a result edge can both all-gather or
  # all-to-all, so those share a row. Only the reduction edges [R] (results of ops that
  # reduce) can reduce-scatter or all-reduce: those run over them alone (`_reductions`).
  # A result's reduced axes are its reduction's (`_reductions`), not a resharding's.
  source = jnp.where(operand[:, :, None], m.stored, m.required)
  target = jnp.where(operand[:, :, None], m.required, m.stored & ~m.reduced[:, None])
  replicated = replicated_reshards(source, target)  # [E', B]
  gather_axes = jnp.where(operand, gather_in, m.required_all & ~m.stored_all)
  gather_divisor = jnp.where(operand, m.stored_all & ~gather_in, m.stored_all)
  to_all_axes = jnp.where(
    operand, misplaced & m.required_all, placed_out & m.stored_all & ~m.reduced
  )
  # A resharding XLA replicates: one all-gather of the whole value over every axis it is
  # sharded on, and slices; no all-to-all, no collective-permute.
  gather_axes = jnp.where(replicated, source.sum(axis=1, dtype=jnp.int8), gather_axes)
  gather_divisor = jnp.where(replicated, 0, gather_divisor).astype(gather_divisor.dtype)
  to_all_axes = jnp.where(replicated, 0, to_all_axes).astype(to_all_axes.dtype)
  target = jnp.where(replicated[:, None, :], source, target)
  # A dim that trades axes it gathers for as many devices' worth it slices in: a permute.
  swapped = jnp.where(replicated, 0, swapped_axes(t, source, target)).astype(gather_axes.dtype)
  gather_axes = gather_axes & ~swapped
  gather_divisor = jnp.where(
    operand & (swapped != 0), m.stored_all & ~gather_axes, gather_divisor
  ).astype(gather_divisor.dtype)
  # Reads priced as sharing a resharding that do not share it under this plan run more.
  extra, slot_row = _unshared_reads(
    t,
    None if per_edge else t.edge_unique,
    operand & ((gather_axes | to_all_axes) != 0),
    m.required,
    axis_count(t),
  )
  extra_bytes = extra * t.value_bytes[t.edge_value[t.shared_slot_edge]][:, None]
  weight = weight[:, None] + jax.ops.segment_sum(extra, slot_row, m.edge.shape[0])
  weighted_bytes = weighted_bytes[:, None] + jax.ops.segment_sum(
    extra_bytes, slot_row, m.edge.shape[0]
  )
  gather = edge_terms(t, 1.0, gather_axes, gather_divisor, weight, weighted_bytes, buffer_bytes)
  to_all = edge_terms(t, 1.0, to_all_axes, m.stored_all, weight, weighted_bytes, buffer_bytes)
  permute = reshard_permutes(
    t,
    precedence[t.edge_value[m.edge]],
    source,
    target,
    swapped,
    weight,
    weighted_bytes,
    buffer_bytes,
  )
  return _EdgeCollectives(gather, to_all, permute, gather_axes, buffers, transient)


def replicated_reshards(source: jax.Array, target: jax.Array) -> jax.Array:
  """Whether XLA's SPMD partitioner replicates a value to reshard it, bool [E', B], from
  the axes of each dim as the value is (`source`) and as it is wanted (`target`), int8
  [E', Rv, B]. It moves axes between dims with all-to-alls one source dim and one target
  dim at a time; where the axes leaving one dim go to several dims, or several dims'
  axes go to one, it falls back to "involuntary full rematerialization": it all-gathers
  the whole value and slices it (a logits tensor with the vocabulary over `data` and
  `model`, read with the batch over `model` and the sequence over `data`)."""
  leaving = source & ~target & target.sum(axis=1, dtype=jnp.int8)[:, None]  # [E', Rv, B]
  moves = (leaving[:, :, None] & target[:, None, :]) != 0  # [E', from Rv, to Rv, B]
  split = jnp.any(moves.sum(axis=2) > 1, axis=1)
  merged = jnp.any(moves.sum(axis=1) > 1, axis=1)
  return split | merged


def _reductions(t: CostTables, m: _EdgeMasks) -> tuple[EdgeTerms, EdgeTerms, EdgeTerms, jax.Array]:
  """The reduce-scatters, all-reduces and collective-permutes of split dots' shares of the
  reductions [R, B] under the masks `m`, and how many ways each op signature's dot is split
  over idle axes, [Uo, B] (`_split_over_idle_axes`)."""
  r_reduced = m.r_reduced
  split, op_split, crossed = _split_over_idle_axes(
    t, m.op_axes, r_reduced, m.r_stored
  )  # [R, B], [Uo, B], [R, B]
  scatter_axes = jnp.where(t.native_scatter & (split == 1.0), r_reduced & m.r_stored, 0).astype(
    r_reduced.dtype
  )
  # Without a native reduce-scatter, XLA's partitioner still reduces a dot's partial sums
  # over the axes its result is stored on first, whole (an all-reduce and a slice), and
  # the shard over the rest: a reduce-scatter's place taken by an all-reduce.
  decomposed = jnp.where(
    ~t.native_scatter & t.reduction_dot[:, None] & (split == 1.0), r_reduced & m.r_stored, 0
  ).astype(r_reduced.dtype)
  scattered = scatter_axes | decomposed
  # The partial sums are sharded as their op computes less the axes they are pending over:
  # a linear combination of partial sums may compute on those too, but XLA reduces the
  # buffers its sources made.
  partial_axes = m.r_required & ~r_reduced
  # A reduction may carry several partial sums' buffers in one collective. Partial sums of
  # several sharded reduction factors (a weight's gradient summed over the batch on `data`
  # and the sequence on `model`) XLA's partitioner all-reduces one factor at a time: the
  # first factor's axes, then the others', each moving the whole buffer.
  r_nbytes = t.value_bytes[t.edge_value[t.reduction_edge]] * t.reduction_partial_sums
  r_weighted = (t.reduction_weight * r_nbytes)[:, None] / split  # [R, B]
  # A split dot's share goes to its owner: one hop over the axes its pairs cross.
  dot_permute = permute_terms(
    t,
    jnp.where(split > 1.0, crossed, 0),
    1.0 / split,
    jnp.broadcast_to(t.reduction_weight[:, None], split.shape),
    r_weighted * split,
    r_nbytes,
  )
  combine = (t.reduction_combines, t.reduction_loop, t.combine_bytes[0])
  all_reduces = lambda axes, divisor: edge_terms(
    t, 2.0, axes, divisor, t.reduction_weight[:, None], r_weighted, r_nbytes, combine
  )
  all_reduce = with_second_factor(
    t,
    all_reduces(m.r_first & ~scattered, partial_axes | scattered),
    r_reduced & ~m.r_first & ~scattered,
    partial_axes | scattered,
    r_weighted,
  )
  whole = all_reduces(decomposed, partial_axes)
  all_reduce = jax.tree.map(jnp.add, all_reduce, whole)
  reduce_scatter = edge_terms(
    t,
    1.0,
    scatter_axes,
    partial_axes,
    t.reduction_weight[:, None],
    r_weighted,
    r_nbytes,
    (t.reduction_combines, t.reduction_loop, t.combine_bytes[1]),
  )
  return reduce_scatter, all_reduce, dot_permute, op_split


def _total(t: CostTables, terms: CostTerms, per_edge: bool) -> Cost:
  """The cost of a batch of plans from their terms (batch-last), each field [B, ...]; the
  terms are per edge or per class of edges (`_terms`)."""
  compute = jnp.sum(terms.op_compute_s, axis=0) + jnp.sum(terms.value_compute_s, axis=0)
  gather, to_all = terms.gather, terms.all_to_all
  gather_time, shared_copies, gather_bytes, to_all_bytes, gather_count, to_all_count = sum_rows(
    gather.seconds + to_all.seconds,
    terms.gathered_bytes,
    gather.bytes,
    to_all.bytes,
    gather.count,
    to_all.count,
  )
  scatter, reduce = terms.reduce_scatter, terms.all_reduce
  reduce_time, scatter_bytes, reduce_bytes, scatter_count, reduce_count = sum_rows(
    scatter.seconds + reduce.seconds, scatter.bytes, reduce.bytes, scatter.count, reduce.count
  )
  permute_time, permute_bytes, permute_count = permute_sums(terms.permute, terms.dot_permute)

  hideable, unhidden = step_hidden(
    t,
    gather.seconds + to_all.seconds + terms.permute.seconds,
    scatter.seconds + reduce.seconds + terms.dot_permute.seconds,
    per_edge,
    compute,
  )
  comm_time = gather_time + reduce_time + permute_time - hideable + unhidden
  comm_bytes = [reduce_bytes, gather_bytes, scatter_bytes, to_all_bytes, permute_bytes]
  comm_count = [reduce_count, gather_count, scatter_count, to_all_count, permute_count]
  copies = shared_copies + jnp.max(terms.transient_bytes, axis=0, initial=0.0)
  peak = jnp.max(t.live_bytes @ (1.0 / terms.value_shards), axis=0) + copies
  return Cost(
    step_time=compute + comm_time,
    compute_time=compute,
    comm_time=comm_time,
    peak_memory=peak,
    fits=peak <= t.hbm_bytes,
    comm_bytes=jnp.stack(comm_bytes, axis=-1),
    comm_count=jnp.stack(comm_count, axis=-1),
  )


def _simulate(t: CostTables, masks: tuple[jax.Array, jax.Array]) -> Cost:
  """`simulate` for a batch of plans laid out batch-last: the sum of `_terms`."""
  return _total(t, _terms(t, masks, per_edge=False), per_edge=False)


def _tile(t: CostTables) -> int:
  return batching.tile_for(t.edge_op.shape[0])


_simulate_one_or_many = batching.batch_last(_simulate, _tile)


def simulate(tables: CostTables, resolution: Resolution) -> Cost:
  """Costs one resolved plan (masks as `sharding.resolve` or `sharding.apply_decision` give
  them: signature slots that share an owner agree; `terms` takes any masks). Vmap over
  resolutions: a batch runs in batch-last calls of `batching.tile_for(edges)` plans."""
  return _simulate_one_or_many(tables, (resolution.value_mask, resolution.op_mask))


def evaluate(
  tables: CostTables,
  owners: sharding.Owners,
  num_classes: int,
  dec_class: jax.Array,
  dec_axis: jax.Array,
) -> Cost:
  """Costs encoded decisions (see `sharding.encode`): `simulate(tables, sharding.resolve(owners,
  num_classes, dec_class, dec_axis))`. Vmapped, each tile of the batch is resolved and
  costed in one batch-last call, so the resolved masks stay batch-last between the two."""
  run = batching.batch_last(
    lambda t, decisions: _simulate(t, sharding.resolve_batch_last(owners, num_classes, decisions)),
    lambda t: min(_tile(t), sharding.resolve_tile(owners)),
  )
  return run(tables, (jnp.asarray(dec_class, jnp.int32), jnp.asarray(dec_axis, jnp.int32)))


_terms_one_or_many = batching.batch_last(
  lambda t, masks: jax.tree.map(lambda x: jnp.moveaxis(x, -1, 0), _terms(t, masks, per_edge=True)),
  _tile,
)


def terms(tables: CostTables, resolution: Resolution) -> CostTerms:
  """The named per-op and per-edge terms of one resolved plan's cost (`CostTerms`, one
  plan's shapes); `total(tables, terms(tables, r))` is `simulate(tables, r)`. Vmaps like
  `simulate`."""
  return _terms_one_or_many(tables, (resolution.value_mask, resolution.op_mask))


def total(tables: CostTables, plan_terms: CostTerms) -> Cost:
  """The cost of one plan from its terms: compute is the sum of the compute terms,
  communication the sum of every collective term less what compute hides, peak memory
  the largest live-bytes row with each value divided by its shards plus the gathered
  copies."""
  batch_last = jax.tree.map(lambda x: x[..., None], plan_terms)
  return jax.tree.map(lambda x: x[0], _total(tables, batch_last, per_edge=True))
