"""What `lower` pins in a planned step: the values each equation's results are
constrained as, the ops whose operands and results are pinned to the shardings their rule
computes on, and the `(before, constrain)` hooks for `interpret` that apply them (see
`automap_rl.xla.lower`'s docstring)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.ir.program import Program
from automap_rl.mesh import spec_axes
from automap_rl.problem import Problem
from automap_rl.simulator.fusion import constant_ops
from automap_rl.xla.realized import scope_name

__all__ = ["OPERAND_PINNED", "PINNED_PRIMITIVES", "result_pins", "staged_spec"]


def _constrained(problem: Problem) -> dict[tuple[int, ...], tuple[int | None, ...]]:
  """Origin -> the value id each result of its op is constrained as (None for scalars and
  for values folded from constants); a scan's origin -> its stacked results (its
  `scan_stack` ops', in order).

  A value folded from constants (the zeros a scatter-add accumulates into) is left to
  XLA, which makes it in the sharding each reader needs, as the simulator prices it:
  constrained to its own sharding first, it is a real array that XLA moves to the
  reader's (a scatter-add's zeros stored split over the nodes, gathered whole for it)."""
  folded = constant_ops(problem.program)
  out: dict[tuple[int, ...], tuple[int | None, ...]] = {}
  for op in problem.program.ops:
    if op.origin:
      out[op.origin] = out.get(op.origin, ()) + tuple(
        v if problem.program.values[v].shape and op.id not in folded else None for v in op.results
      )
  return {origin: chosen for origin, chosen in out.items() if any(v is not None for v in chosen)}


# Ops XLA would partition otherwise than their rule if it saw their operands sharded as
# they are stored: along a window (halo exchanges), or, for gathers and scatter-adds by
# index (a GNN's messages), over devices of no mesh axis (whole operands all-reduced and
# permuted), or, for a split, along the split dim (an LSTM's gates; a GNN's edge features
# split where their pieces are stored over the feature dim), where XLA moves the operand
# to the results' sharding and exchanges each piece's unaligned edges by collective-permute
# between device pairs, while the rule splits the operand where it is and moves the pieces
# by one all-to-all each; or, for a concatenate whose result is stored split along the
# concatenated dim (an LSTM's gate gradients), where XLA concatenates the operands split
# over another dim and moves the result onto the concatenated dim by an all-to-all, while
# the rule concatenates them whole and keeps each device's slice. `lower` pins their
# operands and results to the shardings their rule computes on.
PINNED_PRIMITIVES = frozenset(
  {
    "conv_general_dilated",
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window_min",
    "reduce_window",
    "select_and_scatter_add",
    "select_and_gather_add",
    "gather",
    "scatter-add",
    "split",
    "concatenate",
  }
)


# Ops whose operands (not results, see `result_pins`) `lower` pins to the shardings their
# rule computes on: a dot (below).
OPERAND_PINNED = frozenset({"dot_general"})


def _splits_further(computed: PartitionSpec, stored: PartitionSpec, rank: int) -> bool:
  """`stored` splits a dim that `computed` splits over more axes, the computed ones major."""
  return any(
    c and s[: len(c)] == c and len(s) > len(c)
    for c, s in zip(spec_axes(computed, rank), spec_axes(stored, rank))
  )


def result_pins(
  program: Program, op: int, computed: Sequence[PartitionSpec], values: Mapping[int, PartitionSpec]
) -> tuple[PartitionSpec, ...]:
  """The shardings the results of a pinned op (`_pinned`) are constrained to before their
  values' own (`values`), given those it computes them on (`computed`).

  An op of `PINNED_PRIMITIVES`: the computed ones. A dot: its values' (a dot computed with
  a sharded contraction leaves partial sums, which its value's sharding reduces), except
  a result whose value splits a dim the dot computes split over more axes (a batch over
  `model` summed over `data`, stored over (`model`, `data`)): that one first as computed.
  XLA then reduces the partial sums and keeps each device's part of the dim, a local
  slice, as the simulator prices it; asked for the value's sharding at once, it gathered
  the dim over the axes it was computed on and sliced it."""
  results = program.ops[op].results
  if program.ops[op].primitive not in OPERAND_PINNED:
    return tuple(computed)
  stored = [values.get(v, PartitionSpec()) for v in results]
  return tuple(
    c if _splits_further(c, s, len(program.values[v].shape)) else s
    for v, c, s in zip(results, computed, stored)
  )


def _pinned(problem: Problem) -> dict[tuple[int, ...], int]:
  """Origin -> op id of every program op in `PINNED_PRIMITIVES` or `OPERAND_PINNED`."""
  return {
    op.origin: op.id
    for op in problem.program.ops
    if op.origin and (op.primitive in PINNED_PRIMITIVES or op.primitive in OPERAND_PINNED)
  }


def _stacks(problem: Problem) -> dict[tuple[int, ...], tuple[int, ...]]:
  """A scan's origin -> its `scan_stack` ops, in the order of its stacked outputs.

  Each stacks an iteration's value into the scan's result. Where the value is split over
  an axis the stacked layer dim takes, the op computes on the value gathered over that
  axis (the simulator's price: each iteration's value all-gathered, each device keeping
  its layers' slices). Left to itself XLA stacks the values as computed and reshards the
  stacked array after the loop, where its first reader (AdamW's square of a stacked
  gradient) computes before the reshard; `lower` pins each iteration's value to the
  sharding its `scan_stack` op reads it on, and the stacked results to their own."""
  stacks: dict[tuple[int, ...], tuple[int, ...]] = {}
  for op in problem.program.ops:
    if op.primitive == "scan_stack" and op.origin:
      stacks[op.origin] = stacks.get(op.origin, ()) + (op.id,)
  return stacks


def staged_spec(stored: PartitionSpec, required: PartitionSpec, rank: int) -> PartitionSpec | None:
  """The sharding between `stored` and `required` through which an operand that both moves
  axes between dims and gathers others is resharded: every required axis already on its
  dim, the axes to be gathered kept (minor) where they are stored; None where the operand
  only moves or only gathers.

  The simulator prices such an operand as an all-to-all of the moved axes and an
  all-gather of the rest. XLA's partitioner, asked for `required` at once, finds no such
  path where a dim is split over several axes (`(data, model)` on the rows to `model` on
  the columns): it gathers the whole array over every axis and slices it
  ("involuntary full rematerialization"). Through this sharding it does one all-to-all,
  then one all-gather, as priced."""
  have, want = spec_axes(stored, rank), spec_axes(required, rank)
  wanted = {a for axes in want for a in axes}
  gathered = {a for axes in have for a in axes} - wanted
  moved = any(a in wanted and a not in want[d] for d, axes in enumerate(have) for a in axes)
  if not gathered or not moved:
    return None
  return PartitionSpec(
    *(tuple(w) + tuple(a for a in h if a in gathered) or None for h, w in zip(have, want))
  )


def _constrainer(
  constrained: Mapping[tuple[int, ...], Sequence[int | None]],
  specs: Mapping[int, PartitionSpec],
  pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  mesh: jax.sharding.Mesh | None,
  differentiated: bool = False,
):
  """`(before, constrain)` for `interpret`: each pinned op's operands and results are
  constrained to the shardings it computes on (`pinned`: origin -> (operand specs, result
  specs)); then each array result of a program op is constrained to its value's spec,
  inside the named scope `realized` finds it by. `mesh` None: the trace's mesh (inside
  `shard_map`, with its manual axes).

  An operand already constrained to the spec its op computes on is passed as it is: a
  second constraint would make a second array, and where the function is differentiated
  afterwards (a pipelined loss) the op and the operand's other readers would each save
  theirs for the backward pass. For the same reason, with `differentiated`, a result is
  left unconstrained where an operand of its shape is constrained to its spec (an
  elementwise op's result is sharded as its operand): constrained, an `exp` or `tanh`
  whose derivative reads its own output would have it saved twice, as computed and as
  constrained (the names `realized` reads are then missing, so only for steps whose
  shardings are not compared)."""
  hooks = _Constrainer(constrained, specs, pinned, mesh, differentiated)
  return hooks.before, hooks.constrain


class _Constrainer:
  """`_constrainer`'s hooks and what they remember of the arrays they constrained."""

  def __init__(
    self,
    constrained: Mapping[tuple[int, ...], Sequence[int | None]],
    specs: Mapping[int, PartitionSpec],
    pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
    mesh: jax.sharding.Mesh | None,
    differentiated: bool,
  ):
    self.constrained, self.specs, self.pinned = constrained, specs, pinned
    self.mesh, self.differentiated = mesh, differentiated
    # id(array) -> (the array, its constraint's spec).
    self.pinned_as: dict[int, tuple[Any, PartitionSpec]] = {}
    # (id(x), spec) -> (x, x resharded).
    self.resharded: dict[tuple[int, PartitionSpec], tuple[Any, Any]] = {}
    # The last equation's constrained operands.
    self.operand_specs: list[tuple[tuple[int, ...], PartitionSpec]] = []

  def to(self, x: Any, spec: PartitionSpec) -> Any:
    """`x` constrained to `spec`, remembered so."""
    mesh = jax.sharding.get_abstract_mesh() if self.mesh is None else self.mesh
    y = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    self.pinned_as[id(y)] = (y, spec)
    return y

  def pin(self, x: Any, value: int) -> Any:
    """`x` constrained to value `value`'s spec in the named scope `realized` reads."""
    with jax.named_scope(scope_name(value)):
      return self.to(x, self.specs[value])

  def reshard(self, x: Any, spec: PartitionSpec) -> Any:
    """`x` constrained to `spec` for a pinned op, through `staged_spec` where it has one;
    once per array and spec, so that the ops reading one value on one sharding share one
    resharded copy (one collective), as the simulator prices them."""
    pinned_as = self.pinned_as
    if id(x) in pinned_as and pinned_as[id(x)][1] == spec:
      return x
    if (id(x), spec) not in self.resharded:
      middle = staged_spec(pinned_as[id(x)][1], spec, np.ndim(x)) if id(x) in pinned_as else None
      self.resharded[id(x), spec] = (x, self.to(x if middle is None else self.to(x, middle), spec))
    return self.resharded[id(x), spec][1]

  def before(self, origin: tuple[int, ...], operands: list[Any]) -> list[Any]:
    """An equation's operands, those of a pinned op resharded to what it computes on."""
    if origin in self.pinned:
      operands = [
        self.reshard(x, spec) for x, spec in zip(operands, self.pinned[origin][0], strict=True)
      ]
    self.operand_specs[:] = [
      (np.shape(x), self.pinned_as[id(x)][1]) for x in operands if id(x) in self.pinned_as
    ]
    return operands

  def follows(self, x: Any, spec: PartitionSpec) -> bool:
    """With `differentiated`: an operand of `x`'s shape is constrained to `spec` (`x` is
    then recorded as so constrained)."""
    if not self.differentiated or (np.shape(x), spec) not in self.operand_specs:
      return False
    self.pinned_as[id(x)] = (x, spec)
    return True

  def constrain(self, origin: tuple[int, ...], results: list[Any]) -> list[Any]:
    """An equation's results, pinned and constrained to their values' specs."""
    if origin in self.pinned:
      results = [
        x if self.follows(x, spec) else self.to(x, spec)
        for x, spec in zip(results, self.pinned[origin][1], strict=True)
      ]
    chosen = self.constrained.get(origin)
    if chosen is None:
      return results
    if len(chosen) != len(results):
      raise ValueError(
        f"Equation {origin} has {len(results)} results but its program op has {len(chosen)}; "
        "was the program traced from the same function and arguments?"
      )
    specs, pinned_as = self.specs, self.pinned_as
    kept = lambda x, spec: (
      self.differentiated and id(x) in pinned_as and pinned_as[id(x)][1] == spec
    )
    return [
      x if v is None or kept(x, specs[v]) or self.follows(x, specs[v]) else self.pin(x, v)
      for x, v in zip(results, chosen)
    ]
