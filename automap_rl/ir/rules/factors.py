"""The factor form rule builders share: the factor kinds, a `Factors` builder of a
`Rule`, and the rules of ops whose dims all pass through (elementwise, pairwise) or all
need replication (the conservative rule of unknown primitives)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from automap_rl.ir.program import FactorKind, Rule

Shape = tuple[int, ...]
RuleBuilder = Callable[[Sequence[Shape], Sequence[Shape], Mapping[str, Any]], Rule]

PASS = FactorKind.PASS_THROUGH
REDUCTION = FactorKind.REDUCTION
REPLICATE = FactorKind.NEED_REPLICATION
PERMUTE = FactorKind.PERMUTATION


class Factors:
  """Accumulates factors and the dimension-to-factor maps of one rule."""

  def __init__(self, operand_shapes: Sequence[Shape], result_shapes: Sequence[Shape]):
    self.sizes: list[int] = []
    self.kinds: list[FactorKind] = []
    self.operands = [[()] * len(s) for s in operand_shapes]
    self.results = [[()] * len(s) for s in result_shapes]

  def add(self, size: int, kind: FactorKind = PASS, operands=(), results=()) -> None:
    """Adds one factor mapped to whole dims: `operands`/`results` are (index, dim) pairs.

    Size-1 factors are dropped: they never shard.
    """
    if size <= 1:
      return
    factor = len(self.sizes)
    self.sizes.append(size)
    self.kinds.append(kind)
    for index, dim in operands:
      self.operands[index][dim] = self.operands[index][dim] + (factor,)
    for index, dim in results:
      self.results[index][dim] = self.results[index][dim] + (factor,)

  def own(
    self, kind: FactorKind, operand_shapes, result_shapes, operand_dims=None, result_dims=None
  ):
    """Gives each listed dimension a factor of its own (all dims when None)."""
    for index, shape in enumerate(operand_shapes):
      for dim in range(len(shape)) if operand_dims is None else operand_dims.get(index, ()):
        self.add(shape[dim], kind, operands=[(index, dim)])
    for index, shape in enumerate(result_shapes):
      for dim in range(len(shape)) if result_dims is None else result_dims.get(index, ()):
        self.add(shape[dim], kind, results=[(index, dim)])

  def build(self) -> Rule:
    return Rule(
      factor_sizes=tuple(self.sizes),
      factor_kinds=tuple(self.kinds),
      operand_dims=tuple(tuple(d) for d in self.operands),
      result_dims=tuple(tuple(d) for d in self.results),
    )


def conservative(operand_shapes, result_shapes, params=None) -> Rule:
  """Every dimension of every operand and result needs replication."""
  f = Factors(operand_shapes, result_shapes)
  f.own(REPLICATE, operand_shapes, result_shapes)
  return f.build()


def elementwise(operand_shapes, result_shapes, params=None) -> Rule:
  """Results and same-rank operands share one factor per dimension.

  Rank-0 operands (scalars) and size-1 operand dims (implicit broadcasts) map to nothing.
  Several results (e.g. `threefry2x32`, `optimization_barrier`) must share one shape.
  """
  f = Factors(operand_shapes, result_shapes)
  out = result_shapes[0]
  for dim, size in enumerate(out):
    operands = [
      (i, dim) for i, s in enumerate(operand_shapes) if len(s) == len(out) and s[dim] == size
    ]
    results = [(i, dim) for i, s in enumerate(result_shapes) if s == out]
    f.add(size, PASS, operands, results)
  return f.build()


def pairwise(operand_shapes, result_shapes, params=None) -> Rule:
  """Operand i maps to result i, dim by dim (`device_put`, `optimization_barrier`)."""
  f = Factors(operand_shapes, result_shapes)
  for index, shape in enumerate(result_shapes):
    for dim, size in enumerate(shape):
      f.add(size, PASS, [(index, dim)], [(index, dim)])
  return f.build()
