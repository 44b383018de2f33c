"""Which lookups split a table by its rows.

A gather that takes a table's rows one at a time (an embedding lookup) and the scatter that
adds into them (the lookup's gradient) can run on a table split by rows: each shard looks
up, or adds to, the rows it holds, and a gather's partial results are summed. The bytes
that move are the lookup's result, not the table: Megatron-LM's vocab-parallel embedding,
and how XLA partitions such a gather or scatter. The rules give those ops that form
(`rules.contractions.gather`, `scatter`); it is kept where the rows are a parameter's
(their named dimension holds a parameter dim: a vocabulary). Rows that are the step's data
(a graph's node features gathered per edge, whose edges outnumber them) need replication:
the table is gathered whole.
"""

from __future__ import annotations

import dataclasses

from automap_rl.ir.dims import analyze
from automap_rl.ir.program import FactorKind, Op, Program, Role


def _row_factors(op: Op) -> list[int]:
  """The factors by which `op` splits a table by rows: a gather's reductions (it has no
  other), a scatter's pass-throughs of its operand and result alone (not in its updates or
  indices)."""
  kinds = op.rule.factor_kinds
  if op.primitive == "gather":
    return [f for f, kind in enumerate(kinds) if kind == FactorKind.REDUCTION]
  if not op.primitive.startswith("scatter"):
    return []
  elsewhere = {f for dims in op.rule.operand_dims[1:] for dim in dims for f in dim}
  in_operand = {f for dim in op.rule.operand_dims[0] for f in dim}
  return [
    f
    for f, kind in enumerate(kinds)
    if kind == FactorKind.PASS_THROUGH and f in in_operand and f not in elsewhere
  ]


def keep_parameter_rows(program: Program) -> Program:
  """`program` with each lookup's rows split only where they are a parameter's: the other
  row factors need replication.

  Args:
    program: a traced program, its arguments' roles set.

  Returns:
    The program, ops changed only in the kinds of those factors.
  """
  rows = {op.id: _row_factors(op) for op in program.ops}
  if not any(rows.values()):
    return program
  named = analyze(program)
  parameter_classes = {
    int(c)
    for v in program.inputs
    if program.values[v].role == Role.PARAMETER
    for c in named.value_classes(v)
    if c >= 0
  }
  ops = list(program.ops)
  for op_id, factors in rows.items():
    classes = named.op_factor_classes(op_id)
    data = [f for f in factors if int(classes[f]) not in parameter_classes]
    if data:
      rule = ops[op_id].rule
      kinds = tuple(
        FactorKind.NEED_REPLICATION if f in data else k for f, k in enumerate(rule.factor_kinds)
      )
      ops[op_id] = dataclasses.replace(
        ops[op_id], rule=dataclasses.replace(rule, factor_kinds=kinds)
      )
  return dataclasses.replace(program, ops=tuple(ops))
