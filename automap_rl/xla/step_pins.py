"""The plan's pins on a loss function's equations: each equation of the loss (traced
whole or on a microbatch) is pinned as `lower` pins its counterpart in the planned step
(`automap_rl.xla.correspond.align` pairs them), at its own shapes, without the axes a
`shard_map` around it is manual over."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jax_core
from jax.sharding import PartitionSpec

from automap_rl.mesh import spec_axes
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.xla.constraints import _constrained, _constrainer, _pinned, result_pins
from automap_rl.xla.correspond import Flat, Origin, align, flatten
from automap_rl.xla.grouped_conv import grouped_conv_binder
from automap_rl.xla.interpret import interpret

__all__ = ["StepPins", "loss_alignment", "pinned_loss", "spec_within"]


def spec_within(
  spec: PartitionSpec, shape: Sequence[int], manual: frozenset[str], mesh: jax.sharding.Mesh
) -> PartitionSpec:
  """`spec` for an array of `shape` in a stage: without the `manual` axes (the stage axis,
  and the batch axes where the loop is manual over them), and a dim that does not divide
  over its axes (a microbatch's share) left to XLA."""
  dims = []
  for size, axes in zip(shape, spec_axes(spec, len(shape))):
    axes = tuple(a for a in axes if a not in manual)
    dims.append(
      PartitionSpec.UNCONSTRAINED if size % math.prod(mesh.shape[a] for a in axes) else axes or None
    )
  return PartitionSpec(*dims)


@dataclasses.dataclass(frozen=True)
class StepPins:
  """What `lower` pins in the planned step, by the step's origins.

  Attributes:
    results: origin -> the value id each result of its op is constrained as (None for scalars).
    values: value id -> its planned spec.
    ops: origin of a pinned op -> (operand specs, result specs) it computes on.
  """

  results: Mapping[Origin, tuple[int | None, ...]]
  values: Mapping[int, PartitionSpec]
  ops: Mapping[Origin, tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]]

  @classmethod
  def build(cls, problem: Problem, decisions: Sequence[Decision]) -> StepPins:
    """One resolution of the plan for every value and op `lower` pins."""
    program, results, pinned = problem.program, _constrained(problem), _pinned(problem)
    value_ids = list(dict.fromkeys(v for ids in results.values() for v in ids if v is not None))
    value_specs, op_specs = problem.value_and_op_specs(decisions, value_ids, list(pinned.values()))
    values = dict(zip(value_ids, value_specs))
    ops = {
      origin: (operands, result_pins(program, op, result_specs, values))
      for (origin, op), (operands, result_specs) in zip(pinned.items(), op_specs)
    }
    return cls(results, values, ops)

  def constrainer(
    self,
    aligned: Mapping[Origin, Origin],
    entries: Mapping[Origin, Flat],
    manual: frozenset[str],
    mesh: jax.sharding.Mesh,
    in_stage: bool,
  ):
    """`(before, constrain, bind)` for `interpret`: the equations at `entries`' origins
    pinned as their counterparts in the step (`aligned`: origin -> the step's), at their
    own shapes without the `manual` axes (`spec_within`), on `mesh` or (`in_stage`) the
    stage's, those axes manual; grouped convolutions bound by `grouped_conv_binder`."""
    arrays = lambda vs: [v.aval for v in vs if not isinstance(v, jax_core.Literal)]
    ranks = lambda specs, avals: (
      len(specs) == len(avals)
      and all(s is None or len(s) <= len(a.shape) for s, a in zip(specs, avals))
    )
    results, values, pinned = {}, {}, {}
    for origin, at in aligned.items():
      if origin not in entries:
        continue
      eqn = entries[origin].eqn
      outs = arrays(eqn.outvars)
      ids = self.results.get(at)
      if ids is not None and ranks([None if v is None else self.values[v] for v in ids], outs):
        results[origin] = ids
        values.update(
          (v, spec_within(self.values[v], a.shape, manual, mesh))
          for v, a in zip(ids, outs)
          if v is not None
        )
      if (
        at in self.ops
        and ranks(self.ops[at][0], arrays(eqn.invars))
        and ranks(self.ops[at][1], outs)
      ):
        operands, result_specs = self.ops[at]
        pinned[origin] = (
          [spec_within(sp, a.shape, manual, mesh) for sp, a in zip(operands, arrays(eqn.invars))],
          [spec_within(sp, a.shape, manual, mesh) for sp, a in zip(result_specs, outs)],
        )
    on = None if in_stage else mesh
    return (
      *_constrainer(results, values, pinned, on, differentiated=True),
      grouped_conv_binder(pinned, on),
    )


def loss_alignment(
  closed: jax_core.ClosedJaxpr, problem: Problem, params: Any, batch: Any
) -> dict[Origin, Origin]:
  """Loss origin -> the planned step's origin (`correspond.align`) for the loss's jaxpr
  `closed` traced on `(params, batch)`: its inputs are the step's parameters and batch
  (its optimizer state between)."""
  step = problem.program.jaxpr.jaxpr
  n_params = len(jax.tree_util.tree_leaves(params))
  n_batch = len(jax.tree_util.tree_leaves(batch))
  step_inputs = [*step.invars[:n_params], *step.invars[len(step.invars) - n_batch :]]
  return align(flatten(closed.jaxpr), flatten(step), dict(zip(closed.jaxpr.invars, step_inputs)))


def pinned_loss(
  loss_fn: Callable[..., Any],
  problem: Problem,
  pins: StepPins,
  mesh: jax.sharding.Mesh,
  microbatches: int,
  manual: frozenset[str] = frozenset(),
) -> Callable[[Any, Any], Any]:
  """`loss(params, micro)`: `loss_fn` on a microbatch (every batch leaf [B / M, ...], or a
  device's rows of it [B / (M R), ...] under a `shard_map` `manual` over R devices),
  evaluated equation by equation (rematerialization and custom derivative rules kept: it
  is differentiated after), each equation pinned as its counterpart in the planned step
  (the whole batch's loss aligned with the step, the microbatch's equations taking the
  pins of those at the same origins with the same primitive), without the `manual` axes."""
  if problem.program.jaxpr is None:
    raise ValueError(
      "lowering pins the plan through the traced step's jaxpr; this program has none "
      "(build it with automap_rl.ir.trace)"
    )
  ratio = microbatches * math.prod(mesh.shape[a] for a in manual)

  def loss(params: Any, micro: Any) -> Any:
    whole = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] * ratio, *x.shape[1:]), x.dtype), micro
    )
    closed_whole = jax.make_jaxpr(loss_fn)(params, whole)
    aligned = loss_alignment(closed_whole, problem, params, whole)
    closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(params, micro)
    entries = lambda jaxpr: {e.origin: e for e in flatten(jaxpr, into_scans=True)}
    at_whole, at_micro = entries(closed_whole.jaxpr), entries(closed.jaxpr)
    same = {
      o: s
      for o, s in aligned.items()
      if o in at_micro and at_micro[o].eqn.primitive == at_whole[o].eqn.primitive
    }
    before, constrain, bind = pins.constrainer(same, at_micro, manual, mesh, in_stage=bool(manual))
    evaluate = interpret(closed, constrain, before, bind, differentiable=True)
    outs = evaluate(*jax.tree_util.tree_leaves((params, micro)))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  return loss
