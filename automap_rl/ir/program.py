"""The partitioning IR: values, ops and their sharding rules in factor form.

A `Program` is a flat, topologically ordered list of ops over values, built from a jaxpr
by `automap_rl.ir.trace`. Every op carries a `Rule` in the factor form of Shardy's
OpShardingRule: the op has factors, each with a size and a kind, and every operand and
result dimension maps to a tuple of factors, major to minor.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import numpy as np


class FactorKind(enum.IntEnum):
  """How a sharded factor behaves inside its op."""

  PASS_THROUGH = 0  # Sharded in operands and results alike: no communication.
  REDUCTION = 1  # Sharded only in operands: results are partial sums.
  NEED_REPLICATION = 2  # Must be replicated for the op to run.
  PERMUTATION = 3  # Sharded operands must be permuted (e.g. `rev`).


class Role(enum.IntEnum):
  """What a value is to the training step."""

  INPUT = 0
  PARAMETER = 1
  OPTIMIZER_STATE = 2
  INTERMEDIATE = 3
  OUTPUT = 4
  CONSTANT = 5
  STATE = (
    6  # Non-trainable state the step reads and replaces: batch-norm statistics, caches, counters.
  )

  @classmethod
  def parse(cls, name: str) -> Role:
    try:
      return cls[name.upper()]
    except KeyError:
      valid = ", ".join(r.name.lower() for r in cls)
      raise ValueError(f"Unknown role {name!r}; valid roles: {valid}.") from None


DimFactors = tuple[int, ...]  # Factor ids of one dimension, major to minor.


@dataclasses.dataclass(frozen=True)
class Rule:
  """An op's sharding rule in factor form.

  Attributes:
    factor_sizes: size of each factor, shape [num_factors].
    factor_kinds: `FactorKind` of each factor.
    operand_dims: for each operand, for each of its dimensions, its factors.
    result_dims: for each result, for each of its dimensions, its factors.
  """

  factor_sizes: tuple[int, ...]
  factor_kinds: tuple[FactorKind, ...]
  operand_dims: tuple[tuple[DimFactors, ...], ...]
  result_dims: tuple[tuple[DimFactors, ...], ...]

  @property
  def num_factors(self) -> int:
    return len(self.factor_sizes)


@dataclasses.dataclass(frozen=True)
class Value:
  """An array in the program.

  Attributes:
    id: index in `Program.values`.
    shape: the array's global shape.
    dtype: numpy dtype name (`float32`, ...); keys are `key<fry>`.
    role: what the value is to the step.
    path: pytree path of an argument or output (`params/block_3/mlp/fc1/kernel`), else None.
    itemsize: bytes per element.
  """

  id: int
  shape: tuple[int, ...]
  dtype: str
  role: Role
  path: str | None
  itemsize: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self.itemsize


@dataclasses.dataclass(frozen=True)
class Op:
  """One primitive application.

  Attributes:
    id: index in `Program.ops`.
    primitive: the jaxpr primitive name.
    operands: value ids (literals are dropped, and so are their dimensions in `rule`).
    results: value ids.
    rule: the sharding rule.
    repeat: how many times the op runs per step (a loop body's trip count).
    scope: where the op came from, e.g. `scan/cond` for loop and branch bodies, else ''.
    origin: the equation it came from, as indices through inlined calls and `scan` bodies:
      `(5, 2)` is eqn 2 of the body of eqn 5 of the top-level jaxpr; a `scan_stack` op has
      its scan's; () for the IR's other ops and for ops inside `while` and `cond` bodies.
    flops: flops of one call, in XLA's `cost_analysis()` convention (see
      `automap_rl.ir.flops`), set by `trace`; None for hand-built ops (the simulator then
      falls back to `simulator.tables.op_flops`).
    kernel: the fused kernel the op belongs to (`automap_rl.ir.kernels`), '' for none.
    same_as: the id of an earlier op that computes the same results (the same primitive,
      operands, literals and parameters in the same loop body), which XLA's common
      subexpression elimination leaves in its place; -1 for none.
  """

  id: int
  primitive: str
  operands: tuple[int, ...]
  results: tuple[int, ...]
  rule: Rule
  repeat: int = 1
  scope: str = ""
  origin: tuple[int, ...] = ()
  flops: float | None = None
  kernel: str = ""
  same_as: int = -1


@dataclasses.dataclass(frozen=True)
class Program:
  """A traced training step.

  Attributes:
    values: every value, arguments first.
    ops: every op in program order.
    inputs: the value ids of the flattened arguments.
    outputs: the value ids of the flattened outputs.
    donated: per input, whether the caller donates its buffer.
    donate_argnums: the positional arguments donated (those `donated` inputs belong to).
    ties: pairs of values that must share sharding (loop carries in and out).
    unknown_primitives: primitives that got the conservative rule.
    jaxpr: the closed jaxpr it was traced from, and `out_tree` the treedef of the
      function's outputs: `automap_rl.xla.lower` interprets them instead of tracing the
      function again (None for hand-built programs). Not compared.
  """

  values: tuple[Value, ...]
  ops: tuple[Op, ...]
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  donated: tuple[bool, ...]
  ties: tuple[tuple[int, int], ...]
  unknown_primitives: tuple[str, ...]
  jaxpr: Any = dataclasses.field(default=None, compare=False, repr=False)
  out_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
  donate_argnums: tuple[int, ...] = ()

  @property
  def num_ops(self) -> int:
    return len(self.ops)

  @property
  def num_values(self) -> int:
    return len(self.values)

  @property
  def batch_inputs(self) -> tuple[int, ...]:
    """The value ids of the batched arguments (role `input`, not scalars), in order:
    their dim 0 is the batch."""
    return tuple(
      v for v in self.inputs if self.values[v].role == Role.INPUT and self.values[v].shape
    )

  def input_by_path(self, path: str) -> Value:
    """Returns the argument value at `path`; a KeyError lists close matches."""
    for value_id in self.inputs:
      if self.values[value_id].path == path:
        return self.values[value_id]
    close = [self.values[v].path for v in self.inputs if path.split("/")[-1] in self.values[v].path]
    raise KeyError(f"No argument at path {path!r}; similar paths: {close[:5]}.")


def itemsize_of(dtype: str) -> int:
  """Bytes per element of a dtype name; PRNG keys count as two uint32 words."""
  if dtype.startswith("key"):
    return 8
  return np.dtype(dtype).itemsize
