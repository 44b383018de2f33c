"""The reduction sub-tables of `CostTables`: which op factors reduce, the result edges whose
partial sums reduce-scatter or all-reduce, and how XLA's combiners merge their collectives
(numpy)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from automap_rl.ir import FactorKind, Program
from automap_rl.sharding import Signatures


class OpReductions(NamedTuple):
  """What each op signature reduces over (Uo op signatures, Rf factors).

  Attributes:
    op_reduction, op_reduction_source, op_deferred: the `CostTables` fields of the same
      names, bool [Uo, Rf], int32 [Uo], bool [Uo].
    partial_sums: how many partial sums the signature's results carry, float32 [Uo].
  """

  op_reduction: np.ndarray
  op_reduction_source: np.ndarray
  op_deferred: np.ndarray
  partial_sums: np.ndarray


class ReductionTables(NamedTuple):
  """The reductions, R result edges that can reduce (the `CostTables` fields of the same
  names): `reduction_edge` int32 [R], `reduction_weight`, `reduction_partial_sums`,
  `reduction_combines` float32 [R], `reduction_dot` bool [R], `op_dot_reduction` int32
  [Uo], `reduction_loop` int8 [R], `loop_repeats` float32 [K]."""

  reduction_edge: np.ndarray
  reduction_weight: np.ndarray
  reduction_partial_sums: np.ndarray
  reduction_dot: np.ndarray
  op_dot_reduction: np.ndarray
  reduction_combines: np.ndarray
  reduction_loop: np.ndarray
  loop_repeats: np.ndarray


def op_reductions(sigs: Signatures) -> OpReductions:
  """The reduction factors, reduction source, deferral and partial-sum count of each op
  signature, read from its key (`sharding.Signatures.op_keys`)."""
  num_ops = len(sigs.op_keys)
  rf = sigs.op_class.shape[1]
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
  return OpReductions(reduction, reduction_source, deferred, partial_sums)


def reduction_tables(
  program: Program,
  sigs: Signatures,
  ops: OpReductions,
  dots: np.ndarray,
  edge_op: np.ndarray,
  edge_result: np.ndarray,
  edge_weight: np.ndarray,
) -> ReductionTables:
  """The result edges that reduce (their own partial sums or their source's, not
  deferred), with their weights, partial sums, whether each is a dot's own (`dots`: the
  op signatures of dots, bool [Uo]) and how their collectives combine. `edge_op`,
  `edge_result`, `edge_weight`: the edges' (`edges.EdgeTables`), [E]."""
  num_ops = len(sigs.op_keys)
  reduces = ops.op_reduction.any(axis=1)[ops.op_reduction_source] & ~ops.op_deferred  # [Uo]
  reduction_edge = np.flatnonzero(edge_result & reduces[edge_op]).astype(np.int32)
  terminal = terminal_reductions(program, sigs, reduces)
  reduction_op = edge_op[reduction_edge]
  groups, repeats = loop_groups(terminal[reduction_op])
  reduction_dot = (dots & (ops.op_reduction_source == np.arange(num_ops)))[reduction_op]
  op_dot_reduction = np.full(num_ops, len(reduction_edge), np.int32)
  op_dot_reduction[edge_op[reduction_edge[reduction_dot]]] = np.flatnonzero(reduction_dot)
  return ReductionTables(
    reduction_edge=reduction_edge,
    reduction_weight=edge_weight[reduction_edge],
    reduction_partial_sums=ops.partial_sums[reduction_op],
    reduction_dot=reduction_dot,
    op_dot_reduction=op_dot_reduction,
    reduction_combines=terminal[reduction_op],
    reduction_loop=groups,
    loop_repeats=repeats,
  )


def terminal_reductions(program: Program, sigs: Signatures, reduces: np.ndarray) -> np.ndarray:
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


def loop_groups(combines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(CostTables.reduction_loop, CostTables.loop_repeats)` from `reduction_combines`
  [R]: group 0 for repeat <= 1, else the rank of the repeat count among the distinct ones
  above 1 (1-based, capped at `MAX_LOOP_GROUPS - 1`); int8 [R] and float32 [K]."""
  repeats = np.unique(combines[combines > 1])[: MAX_LOOP_GROUPS - 1]
  rank = np.minimum(np.searchsorted(repeats, combines) + 1, len(repeats))
  groups = np.where(combines > 1, rank, 0).astype(np.int8)
  return groups, np.concatenate([[1.0], repeats]).astype(np.float32)
