"""Static cost tables of a compressed program (numpy; built once per program and mesh)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import chex
import numpy as np

from automap_rl.ir import FactorKind, Op, Program
from automap_rl.ir.rules import conv_batch_group_factor
from automap_rl.mesh import Hardware, Mesh
from automap_rl.sharding import Owners, Signatures
from automap_rl.simulator.fusion import (
  constant_ops,
  dead_ops,
  fusion_copies,
  memory_traffic,
  unmaterialized_values,
)

_MEMORY_PROBES = 256


def op_flops(program: Program, op: Op) -> float:
  """Flops of one call of `op`: `op.flops` when the tracer set it (XLA's convention, see
  `automap_rl.ir.flops`); for hand-built ops, 2 per multiply-add for contractions (the
  full window for convolutions), else one per element."""
  if op.flops is not None:
    return op.flops
  if op.primitive == "dot_general":
    return 2.0 * math.prod(op.rule.factor_sizes)
  if op.primitive == "conv_general_dilated":
    out = program.values[op.results[0]]
    rhs = program.values[op.operands[1]]
    out_features = rhs.shape[op.rule and _conv_out_feature_dim(op, program)]
    return 2.0 * out.size * rhs.size / max(out_features, 1)
  sizes = [program.values[v].size for v in (*op.operands, *op.results)]
  return float(max(sizes, default=0))


def program_flops(program: Program, shapes: Sequence[Sequence[int]] | None = None) -> np.ndarray:
  """Flops of one call of each op as XLA's compiled CPU module does them, [num_ops]:
  `op_flops` times how often the module computes the op (`fusion.fusion_copies`: 0 once
  CSE merges it or constant folding removes it, more when fusion clones it into several
  consumers), for values of these per-device shapes (default: global)."""
  copies = fusion_copies(program, shapes)
  return np.array([op_flops(program, op) * n for op, n in zip(program.ops, copies)], np.float64)


def dense_group_factors(program: Program, hardware: Hardware) -> np.ndarray:
  """Per op, the factor whose groups a backend that computes batch-grouped convolutions
  dense (`Hardware.dense_batch_group_conv`) multiplies the op's flops by, -1 for none,
  int [num_ops]. XLA partitions first, so a device computes `G / k` times the flops of
  its share, G the factor's size and k its shards."""
  if not hardware.dense_batch_group_conv:
    return np.full(program.num_ops, -1)
  return np.array(
    [
      conv_batch_group_factor(op.rule) if op.primitive == "conv_general_dilated" else -1
      for op in program.ops
    ]
  )


def _conv_out_feature_dim(op: Op, program: Program) -> int:
  """The kernel dim that maps to the output feature factor (the rhs dim shared with the result)."""
  result_factors = {f for dim in op.rule.result_dims[0] for f in dim}
  for dim, factors in enumerate(op.rule.operand_dims[1]):
    if factors and factors[0] in result_factors:
      return dim
  return 0


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
      repeat count; flops as XLA's fused module does them, see `program_flops`), [Uo].
    op_reduction: which factors are reductions, bool [Uo, Rf].
    op_reduction_source: the op signature whose reduction axes each op's results reduce
      over: itself, or for a linear combination of pending partial sums, their source, [Uo].
    op_deferred: ops whose partial sums stay pending (a later combination reduces), [Uo].
    op_dense_factor: the batch-group factor of convolutions the backend computes dense
      (see `dense_group_factors`), whose shards divide their flop time once more; -1 for
      none, [Uo]. `op_compute_s` holds their dense flops (times the group count).
    edge_op, edge_value: the op and value signature of each edge, [E].
    edge_result: whether the edge is a result (else an operand), bool [E].
    edge_dim_factors: the op factors each value dim maps to, padded with Rf (a factor
      that is never sharded), int32 [E, Rv, F] with F the most factors of one dim.
    edge_weight: how many times the edge's collectives run per step, [E]: the repeat counts
      of its ops; for operands, each read's share of a resharding that all reads of the
      value needing the same sharding share (see `_operand_read_shares`), run as often as
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
      reaches no op that can reduce (see `_terminal_reductions`), so no two such
      collectives depend on each other (the gradients of data parallelism and FSDP, the
      loss), outside branches (with the loop if some run in one and some outside).
    reduction_loop: the combining group of the reduction's collectives, int8 [R]: 0 outside
      loops (and for reductions that do not combine); k = 1 .. K - 1 for the k-th smallest
      loop repeat count among the combining reductions (XLA combines within one loop
      body; loops of equal repeat count share a group, and any beyond the
      `MAX_LOOP_GROUPS - 1` smallest share the last).
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
    edge_unique: the class of each edge among edges that resolve alike (`_unique_edges`),
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
      as sharing one resharding, in groups of 2 to `MAX_SHARED_READS` (`_shared_reads`):
      per slot (one read of a pattern of groups), its edge, its summed runs a step and
      the share 1/n of a resharding it pays there (n its group's size), [S]. Under a plan
      where some reads of a group resolve otherwise (an op that shards another factor of
      the same named dims, or reads the value as stored), only reads resharded to the
      same sharding share: the simulator charges a slot 1/m of a resharding, m the reads
      of its group resharded as it is. Padding slots have runs 0.
    shared_pairs: every ordered pair of slots of one pattern (a slot with itself
      included), int32 [2, Q]; padding pairs are -1.
    live_bytes: global bytes of each value signature live at each probe point (`probe_rows`), [T,
    Uv].
    mask_group, mask_seconds_per_byte, mask_latency: per axis bit mask (2**num_axes), the
      group size, the inverse bottleneck bandwidth (0 for no axes) and the largest latency
      of a collective over those axes.
    hbm_bytes: memory per device.
  """

  value_bytes: np.ndarray
  value_compute_s: np.ndarray
  value_memory_s: np.ndarray
  op_compute_s: np.ndarray
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
  mask_group: np.ndarray
  mask_seconds_per_byte: np.ndarray
  mask_latency: np.ndarray
  hbm_bytes: float


def _mask_tables(mesh: Mesh) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def loop_spans(program: Program) -> list[tuple[int, int]]:
  """The op ranges `(first, last)` of the program's loops, nested ones included: for every
  depth k, maximal runs of consecutive ops at a loop depth of at least k (the `scan` and
  `while` parts of their scope), a run of a scan's `scan_stack` ops joined to its body
  across the carries out between them (`ir.trace` emits body, carries, stacks). Two loops
  one right after the other, with no op between, read as one."""
  ops = program.ops
  depth = [sum(part in ("scan", "while") for part in op.scope.split("/")) for op in ops]
  spans: list[tuple[int, int]] = []
  for k in range(1, max(depth, default=0) + 1):
    level: list[tuple[int, int]] = []
    first = None
    for i, d in enumerate([*depth, 0]):
      if d >= k and first is None:
        first = i
      elif d < k and first is not None:
        if (
          level
          and all(op.primitive == "scan_stack" for op in ops[first:i])
          and all(op.primitive == "scan_carry" for op in ops[level[-1][1] + 1 : first])
        ):
          level[-1] = (level[-1][0], i - 1)
        else:
          level.append((first, i - 1))
        first = None
    spans += level
  return spans


def live_matrix(program: Program, sigs: Signatures, loops: bool = True) -> np.ndarray:
  """Global bytes of each value signature live after each op, [num_ops, Uv].

  Value v is live from the op that makes it to its last use (a dead op's results never); arguments from the start,
  and to the end unless donated; outputs to the end. Fused intermediates (see
  `fusion.unmaterialized_values`) take no memory, but their readers recompute them, so
  what they are computed from stays live to their last reader. A loop's body is inlined once
  (`ir.trace`), but it runs every iteration: a value made before the loop and read in it
  (the stacked inputs its `scan_slice` ops read, weights, constants) stays live to the
  loop's last op, and a stacked output (`scan_stack`) is one buffer from the loop's first
  op, as XLA's while loop holds them. `loops=False`: liveness ends at the last read in
  program order (a pipelined stage's rows, whose loop's residual sets and gradient sums
  are pipeline terms of their own).
  """
  num_ops = max(program.num_ops, 1)
  num_sigs = len(sigs.value_keys)
  start = np.zeros(program.num_values, np.int64)
  end = np.zeros(program.num_values, np.int64)
  for op in program.ops:
    for v in op.results:
      start[v] = op.id
      end[v] = max(end[v], op.id)
    for v in op.operands:
      end[v] = max(end[v], op.id)
  for first, last in loop_spans(program) if loops else ():
    for op in program.ops[first : last + 1]:
      for v in op.operands:
        if start[v] < first:
          end[v] = max(end[v], last)
      if op.primitive == "scan_stack":
        start[list(op.results)] = np.minimum(start[list(op.results)], first)
  for value_id, donated in zip(program.inputs, program.donated):
    if not donated:
      end[value_id] = num_ops - 1
  end[list(program.outputs)] = num_ops - 1
  fused = unmaterialized_values(program)
  for op in reversed(program.ops):  # Readers recompute a fused value from its operands.
    if any(v in fused for v in op.results):
      last = max(end[v] for v in op.results)
      for v in op.operands:
        end[v] = max(end[v], last)
  diff = np.zeros((num_ops + 1, num_sigs), np.float64)
  nbytes = np.array([v.nbytes for v in program.values], np.float64)
  nbytes[list(fused)] = 0.0
  for op_id in dead_ops(program):  # XLA's dead-code elimination: never allocated.
    nbytes[list(program.ops[op_id].results)] = 0.0
  np.add.at(diff, (start, sigs.value_sig), nbytes)
  np.add.at(diff, (end + 1, sigs.value_sig), -nbytes)
  return np.cumsum(diff, axis=0)[:num_ops]


def probe_rows(live: np.ndarray, seed: int = 0, kinds: np.ndarray | None = None) -> np.ndarray:
  """The rows of a live-bytes matrix [num_ops, Uv] that can be a peak: those that attain
  the maximum for the replicated plan or for one of `_MEMORY_PROBES` random per-signature
  shard factors, so that `max(rows @ 1/shards)` is the peak for the plans that matter at
  a fraction of the cost, float32 [T, Uv]. With `kinds` (an int per signature, [Uv]),
  also every shard factor per kind (plans shard values of a kind alike: weights apart
  from activations)."""
  rng = np.random.default_rng(seed)
  num_sigs = live.shape[1]
  probes = np.concatenate(
    [np.ones((1, num_sigs)), 1.0 / rng.choice([1, 2, 4, 8, 16], (_MEMORY_PROBES, num_sigs))]
  )
  if kinds is not None:
    _, kinds = np.unique(kinds, return_inverse=True)
    factors = np.array(list(itertools.product([1, 8, 64], repeat=kinds.max() + 1)), np.float64)
    probes = np.concatenate([probes, 1.0 / factors[:, kinds]])
  rows = np.unique(np.argmax(live @ probes.T, axis=0))
  return live[rows].astype(np.float32)


def _read_keys(
  program: Program, sigs: Signatures, dead: AbstractSet[int]
) -> dict[tuple[int, int], tuple]:
  """(op, operand index) -> what reads that share one resharding have in common: the value
  and the classes of the factors each of its dims maps to (reads on factors of the same
  named dimensions resolve alike under every plan, up to one op's axis conflicts). Only
  ops with a signature read through edges (ops that follow their values never
  communicate), and not the `dead` ops."""
  keys: dict[tuple[int, int], tuple] = {}
  for op in program.ops:
    sig = sigs.op_sig[op.id]
    if sig < 0 or op.id in dead:
      continue
    classes = sigs.op_class[sig]
    for i, (v, dims) in enumerate(zip(op.operands, op.rule.operand_dims)):
      keys[op.id, i] = (v, tuple(tuple(int(classes[f]) for f in dim) for dim in dims))
  return keys


def _operand_read_shares(
  program: Program, keys: dict[tuple[int, int], tuple]
) -> dict[tuple[int, int], float]:
  """(op, operand index) -> the share of the operand's resharding this read pays.

  XLA reshards a value once and reuses the result for every op that needs it in that
  sharding (an FSDP parameter is all-gathered once for the forward and the backward
  matmul). Reads that need the same sharding are taken to be those with the same
  `_read_keys` key. Each of the n ops that read a value with the same such key pays
  1/n of a resharding, so the n reads together cost one (under a plan where some of them
  resolve otherwise, the simulator corrects the shares: `CostTables.shared_slot_edge`). A
  value folded from constants (the zeros a scatter-add accumulates into) costs nothing:
  XLA makes it in the sharding each reader needs.
  """
  folded = {v for op in constant_ops(program) for v in program.ops[op].results}
  counts: dict[tuple, int] = {}
  for key in keys.values():
    counts[key] = counts.get(key, 0) + 1
  return {read: 0.0 if key[0] in folded else 1.0 / counts[key] for read, key in keys.items()}


# The largest group of reads whose shared resharding the simulator checks under each plan
# (`_shared_reads`): a larger group (a mask or a table that every layer reads) keeps its
# static shares, since its pairs of reads would outnumber all the others.
MAX_SHARED_READS = 16


def _shared_reads(
  program: Program,
  sigs: Signatures,
  keys: dict[tuple[int, int], tuple],
  shares: dict[tuple[int, int], float],
  operand_edge: np.ndarray,
  edge_unique: np.ndarray,
  made: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The groups of 2 to `MAX_SHARED_READS` reads that `_operand_read_shares` prices as
  sharing one resharding, but for those whose edges all resolve alike under every plan
  (one class of `edge_unique`: they always share), by pattern (the edges of a group's
  reads, in edge order; groups of one pattern add their runs), as `(slot_edge [S],
  slot_runs [S], slot_share [S], pairs [2, Q])`: one slot per read of each pattern, its
  edge, its reads' summed runs a step (as `edge_weight` counts them) and its share 1/n of
  a group of n; every ordered pair of slots of one pattern, a slot with itself included.
  `operand_edge`: the edge of each op signature's first operand, [Uo]; `made`: how often
  each value is made a step."""
  groups: dict[tuple, list[tuple[int, int]]] = {}
  for read, key in keys.items():
    if shares[read] > 0.0:
      groups.setdefault(key, []).append(read)
  patterns: dict[tuple[int, ...], np.ndarray] = {}
  for reads in groups.values():
    if not 2 <= len(reads) <= MAX_SHARED_READS:
      continue
    edges = [int(operand_edge[sigs.op_sig[op]]) + i for op, i in reads]
    if len(set(edge_unique[edges])) == 1:
      continue
    runs = [min(program.ops[op].repeat, made[program.ops[op].operands[i]]) for op, i in reads]
    order = np.argsort(edges, kind="stable")
    pattern = tuple(edges[k] for k in order)
    patterns[pattern] = (
      patterns.get(pattern, np.zeros(len(reads))) + np.array(runs, np.float64)[order]
    )
  slot_edge, slot_runs, slot_share, pairs = [], [], [], []
  for pattern, runs in patterns.items():
    first = len(slot_edge)
    slot_edge += pattern
    slot_runs += list(runs)
    slot_share += [1.0 / len(pattern)] * len(pattern)
    pairs += [(first + a, first + b) for a in range(len(pattern)) for b in range(len(pattern))]
  return (
    np.array(slot_edge, np.int32),
    np.array(slot_runs, np.float32),
    np.array(slot_share, np.float32),
    np.array(pairs, np.int32).reshape(-1, 2).T,
  )


def _terminal_reductions(program: Program, sigs: Signatures, reduces: np.ndarray) -> np.ndarray:
  """How the collectives of each op signature's ops combine, float [Uo]: 0, not at all;
  else the repeat count of the loop iteration (1: the step) they combine within.

  XLA's combiners merge collectives of one kind and replica groups that do not depend on
  each other, within one computation: a loop body's are merged per iteration. An op that
  can reduce (its signature in `reduces`, [Uo]) and reaches no other such op through its
  results' consumers is "terminal"; no terminal op reaches another, so the collectives of
  terminal ops are mutually independent. A signature combines when all its ops are
  terminal, run the same number of times a step and none sits in a branch (`cond`).
  """
  consumers: dict[int, list[int]] = {}
  for op in program.ops:
    for v in set(op.operands):
      consumers.setdefault(v, []).append(op.id)
  can_reduce = np.array(
    [sigs.op_sig[op.id] >= 0 and reduces[sigs.op_sig[op.id]] for op in program.ops], bool
  )
  reaches = np.zeros(program.num_ops, bool)  # Reaches an op that can reduce, itself excluded.
  for op in reversed(program.ops):  # Program order is a topological order.
    reaches[op.id] = any(
      can_reduce[c] or reaches[c] for v in op.results for c in consumers.get(v, ())
    )
  repeat = np.full(len(sigs.op_keys), np.nan)
  combines = np.ones(len(sigs.op_keys), bool)
  for op in program.ops:
    sig = sigs.op_sig[op.id]
    if sig >= 0:
      combines[sig] &= not reaches[op.id] and "cond" not in op.scope.split("/")
      repeat[sig] = np.fmax(repeat[sig], op.repeat)
  return np.where(combines & ~np.isnan(repeat), repeat, 0.0).astype(np.float32)


# Combining groups of `CostTables.reduction_loop` at most: outside loops, and three loops.
MAX_LOOP_GROUPS = 4


def _loop_groups(combines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(CostTables.reduction_loop, CostTables.loop_repeats)` from `reduction_combines`
  [R]: group 0 for repeat <= 1, else the rank of the repeat count among the distinct ones
  above 1 (1-based, capped at `MAX_LOOP_GROUPS - 1`); int8 [R] and float32 [K]."""
  repeats = np.unique(combines[combines > 1])[: MAX_LOOP_GROUPS - 1]
  rank = np.minimum(np.searchsorted(repeats, combines) + 1, len(repeats))
  groups = np.where(combines > 1, rank, 0).astype(np.int8)
  return groups, np.concatenate([[1.0], repeats]).astype(np.float32)


def _factor_indices(tables: list[np.ndarray], rv: int, rf: int) -> np.ndarray:
  """Bool [Rv, Rf] dim-to-factor tables as padded index lists, int32 [E, Rv, F]."""
  width = max([int(t.sum(axis=1).max()) for t in tables] + [1])
  out = np.full((len(tables), rv, width), rf, np.int32)
  for e, table in enumerate(tables):
    for dim in range(rv):
      factors = np.flatnonzero(table[dim])
      out[e, dim, : len(factors)] = factors
  return out


def _unique_edges(
  owners: Owners,
  edge_op: np.ndarray,
  edge_value: np.ndarray,
  edge_result: np.ndarray,
  edge_dims: np.ndarray,
  reduction_source: np.ndarray,
  reduction: np.ndarray,
  deferred: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
  """Classes of edges whose masks agree under every plan, `(edge_unique [E], unique_edge
  [Eu])` (see `CostTables`).

  Signature slots that share an owner slot (`sharding.Owners`) resolve alike, so two edges
  of the same kind (operand or result) read the same masks when every value dim is the
  same owner slot (or none), the op factors each dim maps to are the same owner slots, and
  a result's op reduces over the same owner slots (a 12-layer GPT: 1,734 edges, 1,087
  classes)."""

  def slots(owner: np.ndarray, slot: np.ndarray, rows: np.ndarray, columns) -> tuple:
    return tuple(
      (int(owner[r, c]), int(slot[r, c])) for r, c in zip(rows, columns) if owner[r, c] >= 0
    )

  keys: dict[tuple, int] = {}
  unique = np.zeros(len(edge_op), np.int32)
  rf = owners.op_owner.shape[1]
  for e, (op, value, result) in enumerate(zip(edge_op, edge_value, edge_result)):
    stored = tuple(
      slots(owners.value_owner, owners.value_slot, [value], [d])
      for d in range(owners.value_owner.shape[1])
    )
    required = tuple(
      slots(owners.op_owner, owners.op_slot, [op] * len(f), [x for x in f if x < rf])
      for f in edge_dims[e]
    )
    source = reduction_source[op]
    reduced = (
      ()
      if not result or deferred[op]
      else slots(owners.op_owner, owners.op_slot, [source] * rf, np.flatnonzero(reduction[source]))
    )
    unique[e] = keys.setdefault((bool(result), stored, required, reduced), len(keys))
  first = np.zeros(len(keys), np.int32)
  first[unique[::-1]] = np.arange(len(edge_op) - 1, -1, -1, dtype=np.int32)
  return unique, first


def build_cost_tables(program: Program, sigs: Signatures, mesh: Mesh) -> CostTables:
  """Aggregates per-op costs onto signatures and lays out the edges."""
  hw = mesh.hardware
  num_ops = len(sigs.op_keys)
  compute = np.zeros(num_ops, np.float64)
  weight = np.zeros(num_ops, np.float64)
  value_compute = np.zeros(len(sigs.value_keys), np.float64)
  value_memory = np.zeros(len(sigs.value_keys), np.float64)
  buffers = np.zeros(num_ops, np.float64)
  operand_buffers: dict[int, np.ndarray] = {}
  operand_weight: dict[int, np.ndarray] = {}  # Op signature -> gather weight of each operand.
  operand_transient: dict[
    int, np.ndarray
  ] = {}  # Op signature -> reads of each operand resharded alone.
  use_memory: dict[
    int, np.ndarray
  ] = {}  # Op signature -> HBM seconds of each operand, then each result.
  for sig, (_, _, operands, results, _) in enumerate(sigs.op_keys):
    for table in (operand_weight, operand_buffers, operand_transient):
      table[sig] = np.zeros(len(operands), np.float64)
    use_memory[sig] = np.zeros(len(operands) + len(results), np.float64)
  dead = dead_ops(program)  # XLA removes them: they cost nothing.
  keys = _read_keys(program, sigs, dead)
  read_share = _operand_read_shares(program, keys)
  made = np.ones(program.num_values, np.float64)  # How often each value is made a step.
  for op in program.ops:
    made[list(op.results)] = op.repeat
  flops = program_flops(program)
  dense = dense_group_factors(program, hw)
  dense_factor = np.full(num_ops, -1, np.int32)
  traffic = memory_traffic(program, hw.multi_output_fusion, hw.minor_concatenate_fusion)
  dots = np.zeros(num_ops, bool)  # Op signatures of dots.
  for op in program.ops:
    if op.id in dead:
      continue
    sig = sigs.op_sig[op.id]
    dtype = program.values[op.results[0]].dtype if op.results else "float32"
    groups = op.rule.factor_sizes[dense[op.id]] if dense[op.id] >= 0 and sig >= 0 else 1
    flop_s = op.repeat * flops[op.id] * groups / hw.achievable_flops(op.primitive, dtype)
    if groups > 1:
      dense_factor[sig] = dense[op.id]
    reads, writes = traffic[op.id]
    memory_s = op.repeat * np.array(reads + writes, np.float64) / hw.hbm_bandwidth
    if sig < 0:  # Sharded like its values: charged to its first result.
      value_compute[sigs.value_sig[op.results[0]]] += flop_s
      value_memory[sigs.value_sig[op.results[0]]] += memory_s.sum()
      continue
    compute[sig] += flop_s
    use_memory[sig] += memory_s
    dots[sig] |= op.primitive == "dot_general"
    weight[sig] += op.repeat
    shares = np.array([read_share[op.id, i] for i in range(len(op.operands))], np.float64)
    operand_weight[sig] += np.minimum(op.repeat, made[list(op.operands)]) * shares
    operand_buffers[sig] += np.where(shares < 1.0, shares, 0.0)  # Copies several reads share.
    operand_transient[sig] += shares == 1.0  # Copies made for this read alone.
    buffers[sig] += 1.0
  rv = sigs.value_class.shape[1]
  rf = sigs.op_class.shape[1]
  edge_op, edge_value, edge_result, edge_dims = [], [], [], []
  edge_weight, edge_buffers, edge_transient = [], [], []
  edge_memory = (
    np.concatenate([use_memory[sig] for sig in range(num_ops)]) if num_ops else np.zeros(0)
  )
  operand_edge = np.zeros(num_ops, np.int64)
  for sig, (_, _, operands, results, _) in enumerate(sigs.op_keys):
    first = operand_edge[sig] = len(edge_op)
    for is_result, edges in ((False, operands), (True, results)):
      for value_sig, dims in edges:
        table = np.zeros((rv, rf), bool)
        for dim, dim_factors in enumerate(dims):
          table[dim, list(dim_factors)] = True
        edge_weight.append(
          operand_weight[sig][len(edge_op) - first] if not is_result else weight[sig]
        )
        edge_buffers.append(
          operand_buffers[sig][len(edge_op) - first] if not is_result else buffers[sig]
        )
        edge_transient.append(
          operand_transient[sig][len(edge_op) - first] if not is_result else 0.0
        )
        edge_op.append(sig)
        edge_value.append(value_sig)
        edge_result.append(is_result)
        edge_dims.append(table)
  reduction = np.zeros((num_ops, rf), bool)
  reduction_source = np.arange(num_ops, dtype=np.int32)
  deferred = np.zeros(num_ops, bool)
  partial_sums = np.ones(num_ops, np.float32)
  for sig, (_, factors, _, _, (is_deferred, source, carried_buffers)) in enumerate(sigs.op_keys):
    for f, (_, _, kind) in enumerate(factors):
      reduction[sig, f] = kind == FactorKind.REDUCTION
    deferred[sig] = is_deferred
    partial_sums[sig] = carried_buffers
    if source >= 0:
      reduction_source[sig] = source
  edge_op = np.array(edge_op, np.int32)
  reduces = reduction.any(axis=1)[reduction_source] & ~deferred  # [Uo]
  reduction_edge = np.flatnonzero(np.array(edge_result, bool) & reduces[edge_op]).astype(np.int32)
  terminal = _terminal_reductions(program, sigs, reduces)
  loop_groups, loop_repeats = _loop_groups(terminal[edge_op[reduction_edge]])
  group, seconds_per_byte, latency = _mask_tables(mesh)
  edge_dim_factors = _factor_indices(edge_dims, rv, rf)
  edge_value = np.array(edge_value, np.int32)
  edge_result = np.array(edge_result, bool)
  edge_unique, unique_edge = _unique_edges(
    Owners.from_signatures(sigs, mesh.axis_sizes),
    edge_op,
    edge_value,
    edge_result,
    edge_dim_factors,
    reduction_source,
    reduction,
    deferred,
  )
  value_bytes = np.array([math.prod(k[1]) * k[2] for k in sigs.value_keys], np.float32)
  weight32, buffers32 = np.array(edge_weight, np.float32), np.array(edge_buffers, np.float32)
  transient32 = np.array(edge_transient, np.float32)
  transient_bytes = np.zeros(len(unique_edge), np.float32)
  np.maximum.at(
    transient_bytes, edge_unique, np.where(transient32 > 0, value_bytes[edge_value], 0.0)
  )

  reduction_dot = (dots & (reduction_source == np.arange(num_ops)))[edge_op[reduction_edge]]
  op_dot_reduction = np.full(num_ops, len(reduction_edge), np.int32)
  op_dot_reduction[edge_op[reduction_edge[reduction_dot]]] = np.flatnonzero(reduction_dot)
  slot_edge, slot_runs, slot_share, pairs = _shared_reads(
    program, sigs, keys, read_share, operand_edge, edge_unique, made
  )

  def per_class(x: np.ndarray) -> np.ndarray:
    return np.bincount(edge_unique, x.astype(np.float64), len(unique_edge)).astype(np.float32)

  return CostTables(
    value_bytes=value_bytes,
    value_compute_s=value_compute.astype(np.float32),
    value_memory_s=value_memory.astype(np.float32),
    op_compute_s=compute.astype(np.float32),
    op_reduction=reduction,
    op_reduction_source=reduction_source,
    op_deferred=deferred,
    op_dense_factor=dense_factor,
    edge_op=edge_op,
    edge_value=edge_value,
    edge_result=edge_result,
    edge_dim_factors=edge_dim_factors,
    edge_weight=weight32,
    edge_buffers=buffers32,
    edge_transient=transient32,
    edge_memory_s=edge_memory.astype(np.float32),
    edge_unique=edge_unique,
    unique_edge=unique_edge,
    unique_weight=per_class(weight32),
    unique_weighted_bytes=per_class(weight32 * value_bytes[edge_value]),
    unique_buffer_bytes=per_class(np.where(edge_result, 0.0, buffers32 * value_bytes[edge_value])),
    unique_transient_bytes=transient_bytes,
    shared_slot_edge=slot_edge,
    shared_slot_runs=slot_runs,
    shared_slot_share=slot_share,
    shared_pairs=pairs,
    reduction_edge=reduction_edge,
    reduction_weight=np.array(edge_weight, np.float32)[reduction_edge],
    reduction_partial_sums=partial_sums[edge_op[reduction_edge]],
    reduction_dot=reduction_dot,
    op_dot_reduction=op_dot_reduction,
    reduction_combines=terminal[edge_op[reduction_edge]],
    reduction_loop=loop_groups,
    loop_repeats=loop_repeats,
    combine_bytes=np.array(
      [hw.combine_threshold.get(k, 0.0) for k in ("all-reduce", "reduce-scatter")], np.float32
    ),
    native_scatter=np.array(hw.reduce_scatter),
    live_bytes=probe_rows(live_matrix(program, sigs)),
    mask_group=group,
    mask_seconds_per_byte=seconds_per_byte,
    mask_latency=latency,
    hbm_bytes=float(hw.hbm_bytes),
  )
