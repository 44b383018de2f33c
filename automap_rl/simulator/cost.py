"""The cost of a resolved plan: a pure, jittable, vmappable function of arrays.

Per op signature: compute is a roofline (the larger of flop time and HBM time) divided by
the op's shard count. Per edge (an op using or making a value):

* operand stored on axes the op does not shard: all-gather over those axes; on an axis
  the op shards on another dim: all-to-all; sharded where stored replicated: a free slice.
  The reads of one value that need the same sharding share one such collective, as XLA
  reshards a value once per sharding (`tables.edges.operand_read_shares`, and
  `_unshared_reads` where a plan resolves such reads apart).
* result with sharded reduction factors: a partial sum, reduce-scattered over the axes its
  stored sharding uses, all-reduced over the rest (a linear combination of partial sums
  reduces all their buffers in one collective, as XLA's combiner does, each as its source
  computed it); on a backend without a native reduce-scatter (`Hardware.reduce_scatter`:
  XLA on CPU), one all-reduce over all those axes and a slice, as the SPMD partitioner
  writes it; the partial sums of two sharded reduction factors (a batch on one axis and a
  sequence on another) are all-reduced one factor after the other, as the partitioner
  does; computed sharded on axes it is not stored on: all-gather. A dot that leaves mesh
  axes idle computes, reduces and sends only the share its stored split owns, where the
  idle devices can hold the shares (`_split_over_idle_axes`).

XLA's combiners merge independent reductions of one kind over the same axes (the
gradients of data parallelism) into few collectives, up to the hardware profile's
`combine_threshold` bytes each: those reductions pay latency per combined collective
(`_combined_count`), bandwidth per byte as before.

Collectives are ring algorithms in an alpha-beta model over the mesh axes they span (the
slowest link bounds the bandwidth).
Bytes follow `automap_rl.xla.hlo`'s convention: the larger, group-level buffer per device.
Peak memory is the largest live-bytes row of the program (see `tables.probe_rows`) with
every value divided by its shard count, plus the gathered copies of operands that several
reads share (once per value and sharding, as XLA reuses them), all taken to be live at the
peak, as FSDP's gathered parameters live from the forward to the backward pass, plus the
largest copy gathered for one read alone (an activation gathered for one op lives only
while that op runs). (Full-size partial sums
before a reduce-scatter are not added: on the validation suite that over-estimates FSDP
plans.) It is compared with XLA's `memory_analysis()` figure `argument + output + temp -
alias`.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import batching, packing, sharding
from automap_rl.sharding import Resolution
from automap_rl.simulator.tables import CostTables

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


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


def _axes_of(t: CostTables, masks: jax.Array) -> list[jax.Array]:
  """Whether each mesh axis is in bit masks [...], bool [...] per axis."""
  num_axes = t.mask_group.shape[-1].bit_length() - 1
  return [(masks & (1 << axis)) != 0 for axis in range(num_axes)]


def _group_size(t: CostTables, on: list[jax.Array]) -> jax.Array:
  """Devices in a group spanning the axes `on` (from `_axes_of`): a product over the (at
  most a few) axes, elementwise, so it vectorises where a look-up in a table would not.
  Selects rather than arithmetic on the bits: XLA folds a padded axis (size 1) away
  when the tables are constants."""
  n = jnp.float32(1.0)
  for axis, bit in enumerate(on):
    n = n * jnp.where(bit, t.mask_group[..., 1 << axis], 1.0)
  return n


def _collective(
  t: CostTables, rounds: float | jax.Array, axes: jax.Array, divisor: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Cost terms of ring collectives over the axes of bit masks `axes` [...] moving
  `nbytes / group(divisor)` bytes per device: each takes `nbytes * per_byte + fixed`
  seconds and moves `nbytes * fraction` bytes, in `rounds` passes (2 for an all-reduce,
  1 for an all-gather or a reduce-scatter) of `(n - 1)`
  hops of `1/n` of the buffer at the slowest link's rate plus its latency per hop.
  Three look-ups in per-mask tables [2**X]: the per-edge terms run inside the edge
  reduction, a loop XLA on CPU does not vectorise, where a look-up is one load and the
  same terms as products and maxima over the axes cost a dozen selects and two divisions
  (twice the time). Returns `(per_byte, fixed, fraction)`, each [...]."""
  n = jnp.asarray(t.mask_group)
  per_byte = rounds * (1.0 - 1.0 / n) * jnp.asarray(t.mask_seconds_per_byte)
  fixed = rounds * (n - 1.0) * jnp.asarray(t.mask_latency)
  axes, divisor = (
    axes.astype(jnp.uint8),
    divisor.astype(jnp.uint8),
  )  # Unsigned: no wrap of negative indices.
  fraction = (1.0 / n)[divisor]
  return per_byte[axes] * fraction, fixed[axes], fraction


def collective_seconds(t: CostTables, kind: str, buffer_bytes: float, axes: int) -> float:
  """Seconds of one collective of `kind` (`KINDS` or `collective-permute`) over the mesh
  axes of bit mask `axes`, moving a group-level buffer of `buffer_bytes` per device (the
  `automap_rl.xla.hlo` convention), in the model `_collective` charges plans; a
  collective-permute is one hop of the whole buffer at the slowest link of its axes. For
  costing what XLA compiled with the simulator's own alpha-beta model, in Python floats
  (a buffer of 2 GiB or more would overflow a jax int32)."""
  if kind == "collective-permute":
    return (
      float(buffer_bytes) * float(t.mask_seconds_per_byte[axes]) + float(t.mask_latency[axes])
      if axes
      else 0.0
    )
  if kind not in KINDS:
    raise ValueError(
      f"Unknown collective kind {kind!r}; expected one of {KINDS} or 'collective-permute'."
    )
  per_byte, fixed, _ = _collective(
    t, 2.0 if kind == "all-reduce" else 1.0, jnp.asarray(axes), jnp.asarray(0)
  )
  return float(buffer_bytes) * float(per_byte) + float(fixed)


class EdgeTerms(NamedTuple):
  """One collective kind on a set of edges, each [N] (with a plan batch: [N, B] inside
  the simulator, [B, N] from `terms`): seconds, bytes per device, count (collectives per
  step: the runs of the edge's own collectives, or for a reduction that XLA combines,
  its share by bytes of the combined collectives), and the per-device buffer moved per
  byte of the value (0 where none runs)."""

  seconds: jax.Array
  bytes: jax.Array
  count: jax.Array
  buffer: jax.Array


# XLA's combiners merge at most this many collectives into one (`combine_threshold_count`
# of the all-reduce, all-gather and reduce-scatter combiners in xla/service/gpu/ and of
# `CpuAllReduceCombiner` in xla/service/cpu/cpu_compiler.cc).
COMBINE_COUNT = 256.0


def _combined_count(
  t: CostTables,
  axes: jax.Array,
  moved: jax.Array,
  runs: jax.Array,
  combines: jax.Array,
  loop: jax.Array,
  threshold: jax.Array,
) -> jax.Array:
  """Collectives per step of edges whose collectives XLA's combiner merges.

  The combining edges (`combines` [N] > 0, see `CostTables.reduction_combines`, and
  `threshold` > 0: the backend combines this kind) with collectives over the same axes
  (`axes` [N, B]) in the same loop group (`loop` [N], `CostTables.reduction_loop`: one
  group outside loops and one per loop repeat count, `CostTables.loop_repeats`) form one group,
  counted per
  iteration (each edge's `moved` [N, B], bytes per device a step, and `runs` [N, B],
  collectives a step, divided by its loop's repeat count). A group of total bytes T and n
  collectives (per iteration) runs `max(ceil(T / threshold), ceil(n / COMBINE_COUNT))`
  combined collectives (per iteration), which its members share by bytes (a member's
  share times its repeat count: per step). Other edges keep their `runs`. Returns [N, B]."""
  member = (combines[:, None] > 0) & (axes != 0) & (threshold > 0)
  repeat = jnp.maximum(combines, 1.0)[:, None]
  moved_once, runs_once = moved / repeat, runs / repeat  # Per iteration (the step, outside loops).
  masks = range(1, t.mask_group.shape[-1])
  in_group = [(loop == k)[:, None] for k in range(t.loop_repeats.shape[0])]
  sums = _sum_rows(
    *[
      jnp.where(member & (axes == m) & group, x, 0.0)
      for group in in_group
      for m in masks
      for x in (moved_once, runs_once)
    ]
  )
  share = runs
  for k, group in enumerate(in_group):
    for i, m in enumerate(masks):
      total, count = sums[2 * (k * len(masks) + i) : 2 * (k * len(masks) + i) + 2]  # [B] each.
      combined = jnp.where(
        total > 0, jnp.maximum(jnp.ceil(total / threshold), jnp.ceil(count / COMBINE_COUNT)), 0.0
      )
      # Selects per (group, mask), not a look-up by the edge's axes: elementwise, they vectorise.
      share = jnp.where(
        group & (axes == m),
        combined * moved / jnp.maximum(total, jnp.finfo(jnp.float32).tiny),
        share,
      )
  return jnp.where(member, share, runs)


def _edge_terms(
  t: CostTables,
  rounds: float | jax.Array,
  axes: jax.Array,
  divisor: jax.Array,
  weight: jax.Array,
  weighted_bytes: jax.Array,
  buffer_bytes: jax.Array,
  combine: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> EdgeTerms:
  """The terms of one collective kind over the axes `axes` [N, B] of edges run `weight`
  [N, 1] or [N, B] times a step, moving values of `weighted_bytes / weight` bytes
  (`weighted_bytes` of `weight`'s shape: weight times bytes; see `_collective`):
  bandwidth per byte moved, latency per collective. Linear in `weight` and
  `weighted_bytes`, so the terms of several edges with the same axes are those of one
  edge with their sums. `buffer` is `buffer_bytes` [N] over the group. With
  `combine = (combines [N], loop [N], threshold)`, the collectives of the combining edges
  are merged as XLA's combiner does (`_combined_count`), so latency is charged per
  combined collective."""
  per_byte, fixed, fraction = _collective(t, rounds, axes, divisor)
  runs = jnp.where(axes != 0, weight, 0.0)
  runs_bytes = jnp.where(axes != 0, weighted_bytes, 0.0)
  moved = runs_bytes * fraction
  count = runs if combine is None else _combined_count(t, axes, moved, runs, *combine)
  return EdgeTerms(
    seconds=runs_bytes * per_byte + count * fixed,
    bytes=moved,
    count=count,
    buffer=buffer_bytes[:, None] * fraction,
  )


def _with_second_factor(
  t: CostTables, first: EdgeTerms, axes: jax.Array, divisor: jax.Array, weighted_bytes: jax.Array
) -> EdgeTerms:
  """`first`, the all-reduces of the reductions' first sharded factor [R, B], plus those
  of their other factors, over `axes` [R, B]: the same buffers (`weighted_bytes` [R, B]),
  combined as the first factor's are (their counts; uncombined, their runs, where the first
  factor is reduce-scattered), without a second pass of the combiner over the edges."""
  per_byte, fixed, fraction = _collective(t, 2.0, axes, divisor)
  runs_bytes = jnp.where(axes != 0, weighted_bytes, 0.0)
  count = jnp.where(
    axes != 0, jnp.where(first.count > 0, first.count, t.reduction_weight[:, None]), 0.0
  )
  return EdgeTerms(
    seconds=first.seconds + runs_bytes * per_byte + count * fixed,
    bytes=first.bytes + runs_bytes * fraction,
    count=first.count + count,
    buffer=first.buffer,
  )


# XLA:GPU tiles a column reduction in shared memory, one tile per operand (8,320 bytes
# for float32): 30 operands overrun an H100's 227 KiB and ptxas refuses the kernel.
_GPU_VARIADIC_OPERANDS = 16


def _sum_rows(*terms: jax.Array) -> list[jax.Array]:
  """Sums of each of `terms` [N, B] over N, [B] each, in one variadic reduction: XLA fuses
  the terms' elementwise producers into it (one pass over the edges), where it would
  hand single sums to a library kernel that needs every input materialised. On a GPU
  the reduction is split into groups of at most `_GPU_VARIADIC_OPERANDS` operands."""
  group = _GPU_VARIADIC_OPERANDS if jax.default_backend() == "gpu" else len(terms)
  sums = []
  for start in range(0, len(terms), group):
    chunk = terms[start : start + group]
    sums += jax.lax.reduce(
      chunk,
      tuple(jnp.zeros((), x.dtype) for x in chunk),
      lambda a, b: tuple(x + y for x, y in zip(a, b)),
      (0,),
    )
  return sums


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
  gathered_bytes: jax.Array
  transient_bytes: jax.Array
  reduced_axes: jax.Array
  value_shards: jax.Array


def _dense_shards(t: CostTables, op_mask: jax.Array) -> jax.Array:
  """Shards of each op signature's `CostTables.op_dense_factor` (1 where none), from the
  op factor masks [Uo, Rf, B]; [Uo, B]."""
  factor = jnp.maximum(t.op_dense_factor, 0)[:, None, None]
  mask = jnp.take_along_axis(op_mask, factor, axis=1)[:, 0]
  return jnp.where((t.op_dense_factor >= 0)[:, None], _group_size(t, _axes_of(t, mask)), 1.0)


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
  n_idle, n_scattered = (_group_size(t, _axes_of(t, mask)) for mask in (idle, scattered))
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
  value_shards = _group_size(t, _axes_of(t, value_mask.sum(axis=1, dtype=jnp.int8)))  # [Uv, B]
  op_axes = op_mask.sum(axis=1, dtype=jnp.int8)  # [Uo, B]
  op_shards = _group_size(t, _axes_of(t, op_axes))

  # Masks are disjoint bit sets across the dims of a value and the factors of an op, so
  # sums over dims are ORs.
  # The edges read the masks packed per value and op (one reduction each): a gather of a
  # few rows' words, where gathering every dim's mask would read them transposed when
  # the batch arrives first (the environment's states).
  num_axes = t.mask_group.shape[-1].bit_length() - 1
  edge = np.arange(t.edge_op.shape[0]) if per_edge else t.unique_edge
  edge_op = t.edge_op[edge]
  stored = packing.read(
    packing.pack(value_mask, num_axes),
    t.edge_value[edge][:, None],
    np.arange(value_mask.shape[1])[None, :],
    num_axes,
  )  # [E or Eu, Rv, B]
  required = packing.read(
    packing.pack(op_mask, num_axes), edge_op[:, None, None], t.edge_dim_factors[edge], num_axes
  ).sum(axis=2, dtype=jnp.int8)  # [E or Eu, Rv, B]; factor Rf (padding) is none.
  stored_all = stored.sum(axis=1, dtype=jnp.int8)  # [E or Eu, B]
  required_all = required.sum(axis=1, dtype=jnp.int8)
  # Each op moves each operand and result as it computes on it: its share of the value.
  edge_shards = _group_size(t, _axes_of(t, required_all))  # [E or Eu, B]
  edge_shards = edge_shards if per_edge else edge_shards[t.edge_unique]  # [E, B]
  op_memory_s = jax.ops.segment_sum(
    t.edge_memory_s[:, None] / edge_shards, t.edge_op, t.op_compute_s.shape[0]
  )  # [Uo, B]
  overlap = (stored & required).sum(axis=1, dtype=jnp.int8)
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

  operand = ~t.edge_result[edge][:, None]
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
  misplaced, placed_out = stored_all - overlap, required_all - overlap
  gather_in = stored_all & ~required_all
  # Every possible collective on every edge: its axes, and the axes dividing its bytes
  # (the per-device buffer it moves). An operand and a result edge can both all-gather or
  # all-to-all, so those share a row. Only the reduction edges [R] (results of ops that
  # reduce) can reduce-scatter or all-reduce: those run over them alone.
  gather_axes = jnp.where(operand, gather_in, required_all & ~stored_all)
  gather_divisor = jnp.where(operand, stored_all & ~gather_in, stored_all)
  to_all_axes = jnp.where(operand, misplaced & required_all, placed_out & stored_all & ~reduced)
  # Reads priced as sharing a resharding that do not share it under this plan run more.
  extra, slot_row = _unshared_reads(
    t,
    None if per_edge else t.edge_unique,
    operand & ((gather_axes | to_all_axes) != 0),
    required,
    num_axes,
  )
  extra_bytes = extra * t.value_bytes[t.edge_value[t.shared_slot_edge]][:, None]
  weight = weight[:, None] + jax.ops.segment_sum(extra, slot_row, edge.shape[0])
  weighted_bytes = weighted_bytes[:, None] + jax.ops.segment_sum(
    extra_bytes, slot_row, edge.shape[0]
  )
  gather = _edge_terms(t, 1.0, gather_axes, gather_divisor, weight, weighted_bytes, buffer_bytes)
  to_all = _edge_terms(t, 1.0, to_all_axes, stored_all, weight, weighted_bytes, buffer_bytes)

  split, op_split, crossed = _split_over_idle_axes(
    t, op_axes, r_reduced, r_stored
  )  # [R, B], [Uo, B], [R, B]
  scatter_axes = jnp.where(t.native_scatter & (split == 1.0), r_reduced & r_stored, 0).astype(
    r_reduced.dtype
  )
  # The partial sums are sharded as their op computes less the axes they are pending over:
  # a linear combination of partial sums may compute on those too, but XLA reduces the
  # buffers its sources made.
  partial_axes = r_required & ~r_reduced
  # A reduction may carry several partial sums' buffers in one collective. Partial sums of
  # several sharded reduction factors (a weight's gradient summed over the batch on `data`
  # and the sequence on `model`) XLA's partitioner all-reduces one factor at a time: the
  # first factor's axes, then the others', each moving the whole buffer.
  r_nbytes = t.value_bytes[t.edge_value[t.reduction_edge]] * t.reduction_partial_sums
  r_weighted = (t.reduction_weight * r_nbytes)[:, None] / split  # [R, B]
  # A split dot's share goes to its owner: one hop over the axes its pairs cross.
  sent = crossed.astype(jnp.uint8)
  permute_s = jnp.where(
    split > 1.0,
    r_weighted * jnp.asarray(t.mask_seconds_per_byte)[sent]
    + t.reduction_weight[:, None] * jnp.asarray(t.mask_latency)[sent],
    0.0,
  )
  all_reduce = _with_second_factor(
    t,
    _edge_terms(
      t,
      2.0,
      r_first & ~scatter_axes,
      partial_axes | scatter_axes,
      t.reduction_weight[:, None],
      r_weighted,
      r_nbytes,
      (t.reduction_combines, t.reduction_loop, t.combine_bytes[0]),
    ),
    r_reduced & ~r_first & ~scatter_axes,
    partial_axes | scatter_axes,
    r_weighted,
  )
  return CostTerms(
    value_compute_s=jnp.maximum(t.value_compute_s, t.value_memory_s)[:, None] / value_shards,
    op_compute_s=jnp.maximum(
      t.op_compute_s[:, None] / _dense_shards(t, op_mask) / op_split / op_shards, op_memory_s
    ),
    gather=gather,
    all_to_all=to_all,
    reduce_scatter=_edge_terms(
      t,
      1.0,
      scatter_axes,
      partial_axes,
      t.reduction_weight[:, None],
      r_weighted,
      r_nbytes,
      (t.reduction_combines, t.reduction_loop, t.combine_bytes[1]),
    ),
    all_reduce=all_reduce._replace(seconds=all_reduce.seconds + permute_s),
    gathered_bytes=jnp.where(operand & (gather_axes != 0), buffers[:, None], 0.0) * gather.buffer,
    transient_bytes=jnp.where(operand & (gather_axes != 0), transient[:, None], 0.0)
    * gather.buffer,
    reduced_axes=r_reduced,
    value_shards=value_shards,
  )


def _total(t: CostTables, terms: CostTerms) -> Cost:
  """The cost of a batch of plans from their terms (batch-last), each field [B, ...]."""
  compute = jnp.sum(terms.op_compute_s, axis=0) + jnp.sum(terms.value_compute_s, axis=0)
  gather, to_all = terms.gather, terms.all_to_all
  gather_time, shared_copies, gather_bytes, to_all_bytes, gather_count, to_all_count = _sum_rows(
    gather.seconds + to_all.seconds,
    terms.gathered_bytes,
    gather.bytes,
    to_all.bytes,
    gather.count,
    to_all.count,
  )
  scatter, reduce = terms.reduce_scatter, terms.all_reduce
  reduce_time, scatter_bytes, reduce_bytes, scatter_count, reduce_count = _sum_rows(
    scatter.seconds + reduce.seconds, scatter.bytes, reduce.bytes, scatter.count, reduce.count
  )

  comm_time = gather_time + reduce_time
  comm_bytes = [reduce_bytes, gather_bytes, scatter_bytes, to_all_bytes]  # In `KINDS` order.
  comm_count = [reduce_count, gather_count, scatter_count, to_all_count]
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
  return _total(t, _terms(t, masks, per_edge=False))


def _tile(t: CostTables) -> int:
  return batching.tile_for(t.edge_op.shape[0])


_simulate_one_or_many = batching.batch_last(_simulate, _tile)


def simulate(tables: CostTables, resolution: Resolution) -> Cost:
  """Costs one resolved plan (masks as `sharding.resolve` or `sharding.apply_decision`
  give them: signature slots that share an owner agree; `terms` takes any masks). Vmap
  over resolutions for a batch of plans: the batch then runs in batch-last calls of
  `batching.tile_for(edges)` plans (see `automap_rl.batching`)."""
  return _simulate_one_or_many(tables, (resolution.value_mask, resolution.op_mask))


def evaluate(
  tables: CostTables,
  owners: sharding.Owners,
  num_classes: int,
  dec_class: jax.Array,
  dec_axis: jax.Array,
) -> Cost:
  """Costs encoded decisions (see `sharding.encode`): `simulate(tables, sharding.resolve(owners,
  num_classes, dec_class, dec_axis))`. Vmapped over the decisions, each tile of the batch
  is resolved and costed in one batch-last call, so the resolved masks stay batch-last
  between the two."""
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
  communication the sum of every collective term, peak memory the largest live-bytes row
  with each value divided by its shards plus the gathered copies."""
  batch_last = jax.tree.map(lambda x: x[..., None], plan_terms)
  return jax.tree.map(lambda x: x[0], _total(tables, batch_last))
