"""The microbatch program of a pipelined step: the traced program with sizes changed, not a
new trace (`automap_rl.stages`' module docstring says what it keeps and why)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from automap_rl.ir import NamedDims, Op, Program, Rule
from automap_rl.ir.flops import REDUCTIONS, primitive_flops


def resized(
  program: Program, named: NamedDims, ratios: dict[int, int], loops: np.ndarray, loop_ratio: int
) -> Program:
  """`program` with every dim and factor of class c divided by `ratios[c]` and the ops of
  `loops` ([num_ops] bool) run `repeat / loop_ratio` times (`automap_rl.stages`)."""
  if not ratios and loop_ratio == 1:
    return program

  def ratio(cls: int) -> int:
    return ratios.get(int(cls), 1)

  values = []
  for value in program.values:
    classes = named.value_classes(value.id)
    for d, (n, c) in enumerate(zip(value.shape, classes)):
      if n % ratio(c):
        raise ValueError(
          f"cannot divide the program into microbatches or stages: dim {d} of "
          f"{value.path or 'a value'} {list(value.shape)} does not divide by {ratio(c)}"
        )
    values.append(
      dataclasses.replace(value, shape=tuple(n // ratio(c) for n, c in zip(value.shape, classes)))
    )
  ops = []
  for op in program.ops:
    sizes = tuple(
      n // ratio(c) for n, c in zip(op.rule.factor_sizes, named.op_factor_classes(op.id))
    )
    _check_sizes(program, values, op, sizes)
    if op.flops is None:
      flops = None
    elif op.primitive in REDUCTIONS:
      flops = primitive_flops(
        op.primitive,
        [values[v].shape for v in op.operands],
        [values[v].shape for v in op.results],
        {},
      )
    else:
      flops = op.flops * math.prod(sizes) / max(math.prod(op.rule.factor_sizes), 1)
    ops.append(
      dataclasses.replace(
        op,
        rule=dataclasses.replace(op.rule, factor_sizes=sizes),
        flops=flops,
        repeat=op.repeat // loop_ratio if loops[op.id] else op.repeat,
      )
    )
  return dataclasses.replace(
    program, values=tuple(values), ops=tuple(ops), jaxpr=None, out_tree=None
  )


def _check_sizes(program: Program, values, op: Op, sizes: Sequence[int]) -> None:
  """Raises ValueError where a dim whose size was the product of its factors' is not
  after dividing (a batch held as a minor part of a merged dim)."""
  rule: Rule = op.rule
  for ids, dims in ((op.operands, rule.operand_dims), (op.results, rule.result_dims)):
    for v, dim_factors in zip(ids, dims):
      for d, factors in enumerate(dim_factors):
        if not factors:
          continue
        if (
          math.prod(rule.factor_sizes[f] for f in factors) == program.values[v].shape[d]
          and math.prod(sizes[f] for f in factors) != values[v].shape[d]
        ):
          raise ValueError(
            f"cannot divide the program into microbatches or stages: {op.primitive} reads or "
            f"makes dim {d} of a {list(program.values[v].shape)} value as factors of sizes "
            f"{[rule.factor_sizes[f] for f in factors]}, one of them a minor part of the batch or "
            "layers"
          )
