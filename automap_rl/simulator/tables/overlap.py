"""The overlap sub-table of `CostTables`: which collectives an asynchronous runtime can
hide behind compute (numpy; `overlap_tables`).

XLA on GPUs and TPUs runs collectives asynchronously and its latency-hiding scheduler
moves them against compute that does not depend on them. Two kinds have such compute by
the structure of a training step:

* a reshard of a value that no batch input reaches (a parameter, its cast, a layer's
  slice of a stacked weight): it can start before the op that reads it, behind the
  previous ops (an FSDP layer's weight all-gather behind the previous layer);
* a reduction whose result reaches no dot or convolution (a weight gradient, read by the
  optimizer alone): the backward pass goes on while it runs (the data-parallel gradient
  reduction behind the rest of the backward).

Everything else (an activation's all-reduce in tensor parallelism, an all-to-all of
tokens) is on the path of the ops that read it. Loop carries pass both properties to
their tied values.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from automap_rl.ir import Program, Role
from automap_rl.sharding import Signatures

_DOTS = frozenset({"dot_general", "conv_general_dilated"})


class OverlapTables(NamedTuple):
  """Which edges' reshards and which reductions can be hidden (see the module).

  Attributes:
    edge_hideable: the edge's value is one no batch input reaches, bool [E].
    unique_hideable: every edge of the class is, bool [Eu].
    reduction_hideable: the reduced value is one no batch input reaches, or reaches no
      dot or convolution, bool [R].
  """

  edge_hideable: np.ndarray
  unique_hideable: np.ndarray
  reduction_hideable: np.ndarray


def _tie_partners(program: Program) -> dict[int, list[int]]:
  partners: dict[int, list[int]] = {}
  for a, b in program.ties:
    partners.setdefault(a, []).append(b)
    partners.setdefault(b, []).append(a)
  return partners


def batch_reached(program: Program) -> np.ndarray:
  """Per value, whether a batch input (an argument of role `input`) reaches it through
  ops and loop carries, bool [num_values]."""
  reached = np.zeros(program.num_values, bool)
  reached[[v for v in program.inputs if program.values[v].role == Role.INPUT]] = True
  partners = _tie_partners(program)
  changed = True
  while changed:
    changed = False
    for op in program.ops:
      if any(reached[v] for v in op.operands) and not all(reached[v] for v in op.results):
        reached[list(op.results)] = True
        changed = True
    for v, tied in partners.items():
      if reached[v] and not all(reached[u] for u in tied):
        reached[tied] = True
        changed = True
  return reached


def reaches_dot(program: Program) -> np.ndarray:
  """Per value, whether it reaches an operand of a dot or convolution through ops and loop
  carries, bool [num_values]."""
  reaches = np.zeros(program.num_values, bool)
  partners = _tie_partners(program)
  changed = True
  while changed:
    changed = False
    for op in reversed(program.ops):
      if op.primitive in _DOTS or any(reaches[v] for v in op.results):
        new = [v for v in op.operands if not reaches[v]]
        reaches[new] = True
        changed |= bool(new)
    for v, tied in partners.items():
      if reaches[v] and not all(reaches[u] for u in tied):
        reaches[tied] = True
        changed = True
  return reaches


def overlap_tables(
  program: Program,
  sigs: Signatures,
  operand_edge: np.ndarray,
  num_edges: int,
  edge_unique: np.ndarray,
  num_unique: int,
  reduction_edge: np.ndarray,
) -> OverlapTables:
  """The hideable edges [E], classes [Eu] and reductions [R] of a program whose op
  signatures' edges start at `operand_edge` [Uo] (operands, then results:
  `edges.lay_out_edges`), in classes `edge_unique` [E], with reductions on the edges
  `reduction_edge` [R]. An edge or reduction is hideable when it is for every op of its
  signature (a parameter and its gradient share a value signature, not an edge)."""
  off_batch = ~batch_reached(program)
  off_dots = ~reaches_dot(program)
  edge_hideable = np.ones(num_edges, bool)
  edge_reducible = np.ones(num_edges, bool)  # Its values reach no batch input or no dot.
  for op in program.ops:
    sig = sigs.op_sig[op.id]
    if sig < 0:
      continue
    values = np.array([*op.operands, *op.results], np.int64)
    edges = operand_edge[sig] + np.arange(len(values))
    edge_hideable[edges] &= off_batch[values]
    edge_reducible[edges] &= off_batch[values] | off_dots[values]
  unique_hideable = np.ones(num_unique, bool)
  np.logical_and.at(unique_hideable, edge_unique, edge_hideable)
  return OverlapTables(
    edge_hideable=edge_hideable,
    unique_hideable=unique_hideable,
    reduction_hideable=edge_reducible[reduction_edge],
  )
