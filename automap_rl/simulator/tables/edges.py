"""The edge sub-tables of `CostTables`: the operand and result uses of value signatures by
op signatures, how often their reshardings run and which reads share one, the classes of
edges that resolve alike under every plan, and the groups of reads whose shared resharding
the simulator checks under each plan (numpy)."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import NamedTuple

import numpy as np

from automap_rl.ir import Program
from automap_rl.sharding import Owners, Signatures
from automap_rl.simulator.fusion import constant_ops
from automap_rl.simulator.tables.ops import OpSums
from automap_rl.simulator.tables.reductions import OpReductions


class EdgeTables(NamedTuple):
  """The edges, by op signature and within it operands then results (the `CostTables`
  fields of the same names; E edges, Rv value dims, F the most factors of one dim).

  Attributes:
    edge_op, edge_value: the op and value signature of each edge, int32 [E].
    edge_result: whether the edge is a result, bool [E].
    edge_dim_factors: the op factors each value dim maps to, padded, int32 [E, Rv, F].
    edge_weight, edge_buffers, edge_transient, edge_memory_s: float32 [E] (see
      `CostTables`).
  """

  edge_op: np.ndarray
  edge_value: np.ndarray
  edge_result: np.ndarray
  edge_dim_factors: np.ndarray
  edge_weight: np.ndarray
  edge_buffers: np.ndarray
  edge_transient: np.ndarray
  edge_memory_s: np.ndarray


class UniqueEdges(NamedTuple):
  """The classes of edges that resolve alike and their summed figures (the `CostTables`
  fields of the same names): `edge_unique` int32 [E], `unique_edge` int32 [Eu], the rest
  float32 [Eu]."""

  edge_unique: np.ndarray
  unique_edge: np.ndarray
  unique_weight: np.ndarray
  unique_weighted_bytes: np.ndarray
  unique_buffer_bytes: np.ndarray
  unique_transient_bytes: np.ndarray


class SharedReads(NamedTuple):
  """The reads priced as sharing one resharding that the simulator checks under each plan
  (`shared_reads`; the `CostTables` fields of the same names): slots int32, float32,
  float32 [S] and pairs int32 [2, Q]."""

  shared_slot_edge: np.ndarray
  shared_slot_runs: np.ndarray
  shared_slot_share: np.ndarray
  shared_pairs: np.ndarray


def read_keys(
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


def operand_read_shares(
  program: Program, keys: dict[tuple[int, int], tuple]
) -> dict[tuple[int, int], float]:
  """(op, operand index) -> the share of the operand's resharding this read pays.

  XLA reshards a value once and reuses the result for every op that needs it in that
  sharding (an FSDP parameter is all-gathered once for the forward and the backward
  matmul). Reads that need the same sharding are taken to be those with the same
  `read_keys` key. Each of the n ops that read a value with the same such key pays
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
# (`shared_reads`): a larger group (a mask or a table that every layer reads) keeps its
# static shares, since its pairs of reads would outnumber all the others.
MAX_SHARED_READS = 16


def shared_reads(
  program: Program,
  sigs: Signatures,
  keys: dict[tuple[int, int], tuple],
  shares: dict[tuple[int, int], float],
  operand_edge: np.ndarray,
  edge_unique: np.ndarray,
  made: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The groups of 2 to `MAX_SHARED_READS` reads that `operand_read_shares` prices as
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


def factor_indices(tables: list[np.ndarray], rv: int, rf: int) -> np.ndarray:
  """Bool [Rv, Rf] dim-to-factor tables as padded index lists, int32 [E, Rv, F]."""
  width = max([int(t.sum(axis=1).max()) for t in tables] + [1])
  out = np.full((len(tables), rv, width), rf, np.int32)
  for e, table in enumerate(tables):
    for dim in range(rv):
      factors = np.flatnonzero(table[dim])
      out[e, dim, : len(factors)] = factors
  return out


def unique_edges(
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


def lay_out_edges(sigs: Signatures, sums: OpSums) -> tuple[EdgeTables, np.ndarray]:
  """The edges of every op signature, its operands then its results, with the weights
  `sums` gives them; and the edge of each op signature's first operand, int64 [Uo]."""
  num_ops = len(sigs.op_keys)
  rv = sigs.value_class.shape[1]
  rf = sigs.op_class.shape[1]
  edge_op, edge_value, edge_result, edge_dims = [], [], [], []
  edge_weight, edge_buffers, edge_transient = [], [], []
  edge_memory = (
    np.concatenate([sums.use_memory[sig] for sig in range(num_ops)]) if num_ops else np.zeros(0)
  )
  operand_edge = np.zeros(num_ops, np.int64)
  for sig, (_, _, operands, results, _) in enumerate(sigs.op_keys):
    first = operand_edge[sig] = len(edge_op)
    for is_result, edges in ((False, operands), (True, results)):
      for value_sig, dims in edges:
        table = np.zeros((rv, rf), bool)
        for dim, dim_factors in enumerate(dims):
          table[dim, list(dim_factors)] = True
        read = len(edge_op) - first
        edge_weight.append(sums.operand_weight[sig][read] if not is_result else sums.weight[sig])
        edge_buffers.append(sums.operand_buffers[sig][read] if not is_result else sums.buffers[sig])
        edge_transient.append(sums.operand_transient[sig][read] if not is_result else 0.0)
        edge_op.append(sig)
        edge_value.append(value_sig)
        edge_result.append(is_result)
        edge_dims.append(table)
  tables = EdgeTables(
    edge_op=np.array(edge_op, np.int32),
    edge_value=np.array(edge_value, np.int32),
    edge_result=np.array(edge_result, bool),
    edge_dim_factors=factor_indices(edge_dims, rv, rf),
    edge_weight=np.array(edge_weight, np.float32),
    edge_buffers=np.array(edge_buffers, np.float32),
    edge_transient=np.array(edge_transient, np.float32),
    edge_memory_s=edge_memory.astype(np.float32),
  )
  return tables, operand_edge


def unique_edge_tables(
  owners: Owners, edges: EdgeTables, reductions: OpReductions, value_bytes: np.ndarray
) -> UniqueEdges:
  """The classes of `edges` that resolve alike (`unique_edges`) and each class's summed
  weights and bytes (`value_bytes`: each value signature's global bytes, [Uv])."""
  edge_unique, unique_edge = unique_edges(
    owners,
    edges.edge_op,
    edges.edge_value,
    edges.edge_result,
    edges.edge_dim_factors,
    reductions.op_reduction_source,
    reductions.op_reduction,
    reductions.op_deferred,
  )
  edge_bytes = value_bytes[edges.edge_value]
  transient_bytes = np.zeros(len(unique_edge), np.float32)
  np.maximum.at(transient_bytes, edge_unique, np.where(edges.edge_transient > 0, edge_bytes, 0.0))

  def per_class(x: np.ndarray) -> np.ndarray:
    return np.bincount(edge_unique, x.astype(np.float64), len(unique_edge)).astype(np.float32)

  return UniqueEdges(
    edge_unique=edge_unique,
    unique_edge=unique_edge,
    unique_weight=per_class(edges.edge_weight),
    unique_weighted_bytes=per_class(edges.edge_weight * edge_bytes),
    unique_buffer_bytes=per_class(
      np.where(edges.edge_result, 0.0, edges.edge_buffers * edge_bytes)
    ),
    unique_transient_bytes=transient_bytes,
  )
