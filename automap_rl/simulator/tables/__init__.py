"""Static cost tables of a compressed program (numpy; built once per program and mesh).

`build_cost_tables` fills `CostTables` from sub-tables, each built by its own module:
`ops` (flops and HBM time summed onto signatures), `edges` (operand and result uses, their
weights, classes and shared reads), `reductions` (partial sums and how their collectives
combine), `overlap` (the collectives an asynchronous runtime can hide behind compute) and
`memory` (live bytes at the candidate peaks); the collective tables per set of
mesh axes are built here.
"""

from __future__ import annotations

import math

import chex
import numpy as np

from automap_rl.ir import Program
from automap_rl.mesh import Mesh
from automap_rl.sharding import Owners, Signatures
from automap_rl.simulator.fusion import dead_ops
from automap_rl.simulator.tables.edges import (
  MAX_SHARED_READS,
  SharedReads,
  lay_out_edges,
  operand_read_shares,
  read_keys,
  shared_reads,
  unique_edge_tables,
)
from automap_rl.simulator.tables.memory import live_matrix, loop_spans, probe_rows
from automap_rl.simulator.tables.ops import (
  dense_group_factors,
  op_flops,
  program_flops,
  sum_ops,
  times_made,
)
from automap_rl.simulator.tables.overlap import overlap_tables
from automap_rl.simulator.tables.reductions import (
  MAX_LOOP_GROUPS,
  op_reductions,
  reduction_tables,
)

__all__ = [
  "MAX_LOOP_GROUPS",
  "MAX_SHARED_READS",
  "CostTables",
  "build_cost_tables",
  "dense_group_factors",
  "live_matrix",
  "loop_spans",
  "op_flops",
  "probe_rows",
  "program_flops",
]


@chex.dataclass(frozen=True)
class CostTables:
  """Everything the simulator needs besides the resolution, as arrays.

  Shapes: Uv value signatures with Rv dims, Uo op signatures with Rf factors, E edges
  (operand or result uses of a value signature by an op signature) of which R can reduce,
  T memory probe rows.

  Attributes:
    value_bytes: global bytes of a value of each signature, [Uv].
    value_compute_s, value_memory_s: flop and HBM time at peak of the ops that shard like
      their values (no op signature), by the signature of their first result, [Uv].
    op_compute_s: summed flop time at peak of all ops of each signature (times their
      repeat count; flops as XLA's fused module does them, see `ops.program_flops`), [Uo].
    value_launch_s, op_launch_s: the per-kernel overhead of the kernels the ops launch a
      step (`Hardware.kernel_overhead_s`), by value and op signature as above, [Uv], [Uo]:
      every device pays it whole, however the op is split.
    op_reduction: which factors are reductions, bool [Uo, Rf].
    op_reduction_source: the op signature whose reduction axes each op's results reduce
      over: itself, or for a linear combination of pending partial sums, their source, [Uo].
    op_deferred: ops whose partial sums stay pending (a later combination reduces), [Uo].
    op_dense_factor: the batch-group factor of convolutions the backend computes dense
      (see `ops.dense_group_factors`), whose shards divide their flop time once more; -1 for
      none, [Uo]. `op_compute_s` holds their dense flops (times the group count).
    edge_op, edge_value: the op and value signature of each edge, [E].
    edge_result: whether the edge is a result (else an operand), bool [E].
    edge_dim_factors: the op factors each value dim maps to, padded with Rf (a factor
      that is never sharded), int32 [E, Rv, F] with F the most factors of one dim.
    edge_weight: how many times the edge's collectives run per step, [E]: the repeat counts
      of its ops; for operands, each read's share of a resharding that all reads of the
      value needing the same sharding share (see `edges.operand_read_shares`), run as often as
      the value is made: a loop-invariant operand (a stacked scan input, a weight read
      inside a time-step loop) is resharded once before the loop, where XLA hoists it.
    reduction_edge: the result edges of ops that reduce (their own partial sums or, for a
      linear combination of partial sums, their sources'), [R]: only these can
      reduce-scatter or all-reduce.
    reduction_weight: their `edge_weight`, [R].
    reduction_partial_sums: how many partial sums (one buffer each) the reduction carries
      in one collective: more than 1 for a linear combination of partial sums (see
      `sharding.pending_partial_sums`), [R].
    reduction_dot: the reduction is a dot's own (not a combination of partial sums), bool
      [R]: where its value is stored split over some of the axes it sums over and the dot
      leaves mesh axes idle, XLA's partitioner computes each device's share of that split
      on the idle devices (see `simulator.cost._split_over_idle_axes`).
    op_dot_reduction: the row in [R] of the reduction of each op signature that is such
      a dot, R (past the last row) for the others, int32 [Uo].
    reduction_combines: how XLA's combiners treat the reduction's collectives, [R]: 0, not
      combined; 1, merged with those of the other combining reductions outside loops; r >
      1, merged with those of the other combining reductions of the same loop iteration,
      the loop running r times a step. A reduction combines when every op of its signature
      reaches no op that can reduce (see `reductions.terminal_reductions`), so no two such
      collectives depend on each other (the gradients of data parallelism and FSDP, the
      loss), outside branches (with the loop if some run in one and some outside).
    reduction_loop: the combining group of the reduction's collectives, int8 [R]: 0 outside
      loops (and for reductions that do not combine); k = 1 .. K - 1 for the k-th smallest
      loop repeat count among the combining reductions (XLA combines within one loop
      body; loops of equal repeat count share a group, and any beyond the
      `reductions.MAX_LOOP_GROUPS - 1` smallest share the last).
    loop_repeats: the repeat count of each combining group (1 for group 0), [K]: its
      length is how many groups the simulator sums (1 for a program without loops).
    combine_bytes: the most bytes one combined all-reduce and one combined reduce-scatter
      carry (`Hardware.combine_threshold`; 0: the backend does not combine), [2].
    native_scatter: whether the backend runs a reduce-scatter as one (else an all-reduce
      over all the reduced axes and a slice; `Hardware.reduce_scatter`), bool [].
    edge_buffers: how many distinct buffers the edge's resharding materialises that
      several reads share (its ops, not times their repeat counts; operand reads shared
      as in `edge_weight`: an FSDP parameter gathered for the forward and the backward
      pass), [E]: the simulator adds them all to the peak memory, live from the first
      read to the last.
    edge_transient: how many of the edge's reads reshard for themselves alone, [E]: such a
      gathered copy lives only while its op runs, so only the largest one of the program
      adds to the peak.
    edge_memory_s: HBM traffic time of the edge's reads (an operand) or writes (a result)
      by all ops of its signature (times their repeat counts; bytes as XLA's fused module
      moves them, `fusion.memory_traffic`), [E]: each device moves its share of the value
      as the op computes on it, so a dot that splits its batch still reads a replicated
      weight whole (a memory-bound dot of a small batch).
    edge_unique: the class of each edge among edges that resolve alike (`edges.unique_edges`),
      [E]; unique_edge: one edge of each class, [Eu]. Under a resolved plan the simulator
      computes each class's masks once, and an edge's collective terms are linear in its
      weight and bytes, so it sums the gather and all-to-all terms over the classes with
      these summed:
    unique_weight: the classes' summed `edge_weight`, [Eu];
    unique_weighted_bytes: their summed `edge_weight` times value bytes, [Eu];
    unique_buffer_bytes: their summed `edge_buffers` times value bytes (operands; 0 for
      results, whose gathers add nothing to the peak), [Eu];
    unique_transient_bytes: the largest value bytes of their edges with a transient read
      (`edge_transient`; 0 for results), [Eu].
    shared_slot_edge, shared_slot_runs, shared_slot_share: the reads `edge_weight` prices
      as sharing one resharding, in groups of 2 to `edges.MAX_SHARED_READS` (`edges.shared_reads`):
      per slot (one read of a pattern of groups), its edge, its summed runs a step and
      the share 1/n of a resharding it pays there (n its group's size), [S]. Under a plan
      where some reads of a group resolve otherwise (an op that shards another factor of
      the same named dims, or reads the value as stored), only reads resharded to the
      same sharding share: the simulator charges a slot 1/m of a resharding, m the reads
      of its group resharded as it is. Padding slots have runs 0.
    shared_pairs: every ordered pair of slots of one pattern (a slot with itself
      included), int32 [2, Q]; padding pairs are -1.
    live_bytes: global bytes of each value signature live at each probe point
      (`memory.probe_rows`), [T, Uv].
    value_dim_class: the named dimension of each value-signature dim, numbered densely over
      those of value dims (-1 for none), int32 [Uv, Rv]; with `value_count`, how many values
      share each signature, [Uv], the simulator finds the order in which the lowering lays out
      a dim's mesh axes (`sharding.specs.dim_axes`: the axis more of the class's values are
      split over first).
    mask_group, mask_seconds_per_byte, mask_latency: per axis bit mask (2**num_axes), the
      group size, the inverse bottleneck bandwidth (0 for no axes) and the largest latency
      of a collective over those axes.
    edge_hideable, unique_hideable, reduction_hideable: the reshards of each edge [E] and
      class [Eu] and the reductions [R] an asynchronous runtime can hide behind compute
      (`overlap.overlap_tables`).
    async_collectives: whether the backend runs collectives asynchronously
      (`Hardware.async_collectives`), bool [].
    hbm_bytes: memory per device.
  """

  value_bytes: np.ndarray
  value_compute_s: np.ndarray
  value_memory_s: np.ndarray
  op_compute_s: np.ndarray
  value_launch_s: np.ndarray
  op_launch_s: np.ndarray
  op_reduction: np.ndarray
  op_reduction_source: np.ndarray
  op_deferred: np.ndarray
  op_dense_factor: np.ndarray
  edge_op: np.ndarray
  edge_value: np.ndarray
  edge_result: np.ndarray
  edge_dim_factors: np.ndarray
  edge_weight: np.ndarray
  edge_buffers: np.ndarray
  edge_transient: np.ndarray
  edge_memory_s: np.ndarray
  edge_unique: np.ndarray
  unique_edge: np.ndarray
  unique_weight: np.ndarray
  unique_weighted_bytes: np.ndarray
  unique_buffer_bytes: np.ndarray
  unique_transient_bytes: np.ndarray
  shared_slot_edge: np.ndarray
  shared_slot_runs: np.ndarray
  shared_slot_share: np.ndarray
  shared_pairs: np.ndarray
  reduction_edge: np.ndarray
  reduction_weight: np.ndarray
  reduction_partial_sums: np.ndarray
  reduction_dot: np.ndarray
  op_dot_reduction: np.ndarray
  reduction_combines: np.ndarray
  reduction_loop: np.ndarray
  loop_repeats: np.ndarray
  combine_bytes: np.ndarray
  native_scatter: np.ndarray
  live_bytes: np.ndarray
  value_dim_class: np.ndarray
  value_count: np.ndarray
  mask_group: np.ndarray
  mask_seconds_per_byte: np.ndarray
  mask_latency: np.ndarray
  edge_hideable: np.ndarray
  unique_hideable: np.ndarray
  reduction_hideable: np.ndarray
  async_collectives: np.ndarray
  hbm_bytes: float


def _mask_tables(mesh: Mesh) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per set of mesh axes (a bit mask, [2**num_axes]): the group size, the inverse
  bottleneck bandwidth (0 for no axes) and the largest latency of a collective over them."""
  num = 1 << len(mesh.axis_sizes)
  group = np.ones(num, np.float32)
  bandwidth = np.full(num, np.inf, np.float64)
  latency = np.zeros(num, np.float32)
  for mask in range(num):
    for axis, (size, link) in enumerate(zip(mesh.axis_sizes, mesh.links)):
      if mask >> axis & 1:
        group[mask] *= size
        bandwidth[mask] = min(bandwidth[mask], link.bandwidth)
        latency[mask] = max(latency[mask], link.latency)
  return group, (1.0 / bandwidth).astype(np.float32), latency


def _dense_classes(value_class: np.ndarray) -> np.ndarray:
  """`value_class` [Uv, Rv] renumbered 0 .. C - 1 over the classes it holds (-1 kept),
  int32: fewer than Uv * Rv, so a per-class sum fits a table of the value dims' size."""
  held, dense = np.unique(value_class, return_inverse=True)
  dense = dense.reshape(value_class.shape) - int(held[0] < 0)
  return np.where(value_class < 0, -1, dense).astype(np.int32)


def build_cost_tables(program: Program, sigs: Signatures, mesh: Mesh) -> CostTables:
  """Aggregates per-op costs onto signatures and lays out the edges, reductions and live
  bytes (see `CostTables`)."""
  hw = mesh.hardware
  dead = dead_ops(program)  # XLA removes them: they cost nothing.
  keys = read_keys(program, sigs, dead)
  read_share = operand_read_shares(program, keys)
  made = times_made(program)
  sums = sum_ops(program, sigs, hw, dead, read_share, made)
  reductions = op_reductions(sigs)
  edges, operand_edge = lay_out_edges(sigs, sums)
  value_bytes = np.array([math.prod(k[1]) * k[2] for k in sigs.value_keys], np.float32)
  owners = Owners.from_signatures(sigs, mesh.axis_sizes)
  unique = unique_edge_tables(owners, edges, reductions, value_bytes)
  shared = SharedReads(
    *shared_reads(program, sigs, keys, read_share, operand_edge, unique.edge_unique, made)
  )
  reduced = reduction_tables(
    program, sigs, reductions, sums.dots, edges.edge_op, edges.edge_result, edges.edge_weight
  )
  group, seconds_per_byte, latency = _mask_tables(mesh)
  overlap = overlap_tables(
    program,
    sigs,
    operand_edge,
    len(edges.edge_op),
    unique.edge_unique,
    len(unique.unique_edge),
    reduced.reduction_edge,
  )
  return CostTables(
    value_bytes=value_bytes,
    value_compute_s=sums.value_compute.astype(np.float32),
    value_memory_s=sums.value_memory.astype(np.float32),
    op_compute_s=sums.compute.astype(np.float32),
    value_launch_s=sums.value_launch.astype(np.float32),
    op_launch_s=sums.launch.astype(np.float32),
    op_reduction=reductions.op_reduction,
    op_reduction_source=reductions.op_reduction_source,
    op_deferred=reductions.op_deferred,
    op_dense_factor=sums.dense_factor,
    **edges._asdict(),
    **unique._asdict(),
    **shared._asdict(),
    **reduced._asdict(),
    combine_bytes=np.array(
      [hw.combine_threshold.get(k, 0.0) for k in ("all-reduce", "reduce-scatter")], np.float32
    ),
    native_scatter=np.array(hw.reduce_scatter),
    live_bytes=probe_rows(live_matrix(program, sigs, fused_kernels=hw.fused_kernels)),
    value_dim_class=_dense_classes(sigs.value_class),
    value_count=np.bincount(sigs.value_sig, minlength=len(sigs.value_keys)).astype(np.float32),
    mask_group=group,
    mask_seconds_per_byte=seconds_per_byte,
    mask_latency=latency,
    **overlap._asdict(),
    async_collectives=np.array(hw.async_collectives),
    hbm_bytes=float(hw.hbm_bytes),
  )
