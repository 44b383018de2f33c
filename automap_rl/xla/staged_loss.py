"""A loss function split at its layer stack's scan, for `scheduled.run_schedule`.

The loss traced on one microbatch is evaluated equation by equation (`interpret`, each
equation pinned as `lower` pins its counterpart in the planned step, without the stage
axis), its stack's forward scan (the first top-level scan of the stack's L layers)
replaced:

* embed: the scan's initial carries, the equations after the scan left dead (XLA drops
  them): what runs before the stack on one microbatch, on the first stage;
* head: the loss given the scan's final carries (the equations before it dead): what
  runs after the stack, on the last stage;
* chunk: the scan's body (its rematerialization kept) over a chunk's layers;
* the stacked weights and the scan's constants are the scan's operands computed once from
  the parameters, outside the stages (the stacked weights' gradients flow back through
  that computation); constants that depend on the batch or the parameters are not
  pipelined by this split (NotImplementedError);
* the scan's per-layer outputs [L, ...] travel with the activations, each chunk writing
  its layers' rows, so that the head reads them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from automap_rl.ir.stacks import LayerStack
from automap_rl.ir.trace import scan_counts
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.xla.accumulate import microbatched
from automap_rl.xla.correspond import flatten
from automap_rl.xla.interpret import interpret
from automap_rl.xla.scheduled import run_schedule
from automap_rl.xla.step_pins import StepPins, loss_alignment

__all__ = ["scheduled_value_and_grad"]


def _depends(closed: jax_core.ClosedJaxpr, inputs: set[int]) -> list[bool]:
  """Whether each output of `closed` depends on its inputs at positions `inputs`."""
  tainted = {v for i, v in enumerate(closed.jaxpr.invars) if i in inputs}
  for eqn in closed.jaxpr.eqns:
    if any(not isinstance(v, jax_core.Literal) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return [not isinstance(v, jax_core.Literal) and v in tainted for v in closed.jaxpr.outvars]


def scheduled_value_and_grad(
  loss_fn: Callable[..., Any],
  pipeline: Pipeline,
  stack: LayerStack,
  problem: Problem,
  pins: StepPins,
  mesh: jax.sharding.Mesh,
  rows: Callable[[Any], Any],
) -> Callable[[Any, Any], tuple[Any, Any]]:
  """`value_and_grad(params, batch) -> (loss [], grads)` of `loss_fn` run as `pipeline`'s
  schedule (`scheduled.run_schedule`; module docstring for the split)."""
  program, m_count = problem.program, pipeline.microbatches
  stacked_ids = set(stack.stacked_inputs(program, problem.named))

  def value_and_grad(params: Any, batch: Any) -> tuple[Any, Any]:
    micro = microbatched(batch, m_count, rows)
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
    closed = jax.make_jaxpr(loss_fn)(params, one)
    scans = [
      e
      for e in flatten(closed.jaxpr)
      if e.eqn.primitive.name == "scan"
      and e.eqn.params["length"] == stack.layers
      and scan_counts(e.eqn.params)[1] > 0
      and not e.eqn.params["reverse"]
    ]
    if not scans:
      raise NotImplementedError(
        f"the {pipeline.schedule} lowering runs a scanned layer stack; the loss has no forward "
        f"scan of the {stack.describe()}"
      )
    target, where = scans[0].eqn, scans[0].origin
    n_const, n_carry = scan_counts(target.params)
    whole = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] * x.shape[1], *x.shape[2:]), x.dtype), micro
    )
    aligned = loss_alignment(jax.make_jaxpr(loss_fn)(params, whole), problem, params, whole)
    entries = {e.origin: e for e in flatten(closed.jaxpr, into_scans=True)}
    inside = {o[len(where) :]: s for o, s in aligned.items() if o[: len(where)] == where}
    body_entries = {
      o[len(where) :]: e for o, e in entries.items() if o[: len(where)] == where and o != where
    }
    outside = {o: s for o, s in aligned.items() if o[: len(where)] != where and o in entries}
    manual = frozenset({pipeline.axis})

    def evaluator(in_stage: bool, replace: Callable[[list[Any]], list[Any]]):
      before, constrain, bind = pins.constrainer(outside, entries, manual, mesh, in_stage=in_stage)
      return interpret(
        closed, constrain, before, bind, replaced={where: replace}, differentiable=True
      )

    outs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in target.outvars]
    param_leaves, tree = jax.tree_util.tree_flatten(params)
    is_stacked = [program.inputs[i] in stacked_ids for i in range(len(param_leaves))]

    def operands(leaves: list[Any], one_leaves: list[Any], in_stage: bool) -> list[Any]:
      captured: list[Any] = []
      capture = lambda ops: captured.extend(ops) or [jnp.zeros(o.shape, o.dtype) for o in outs]
      evaluator(in_stage, capture)(*leaves, *one_leaves)
      return captured

    first = jax.tree_util.tree_leaves(jax.tree.map(lambda x: x[0], micro))
    closed_ops = jax.make_jaxpr(lambda p, b: operands(p, b, False))(param_leaves, first)
    n_p = len(param_leaves)
    on_batch = _depends(closed_ops, set(range(n_p, n_p + len(first))))
    on_params = _depends(closed_ops, set(range(n_p)))
    if any(on_batch[:n_const]) or any(on_params[:n_const]):
      raise NotImplementedError(
        f"the loop of the {stack.describe()} has constants computed from the batch or the "
        f"parameters; the {pipeline.schedule} lowering pipelines loops whose constants are neither"
      )
    consts = operands(param_leaves, first, False)[:n_const]
    xs, xs_back = jax.vjp(lambda p: operands(p, first, False)[n_const + n_carry :], param_leaves)
    others = [x for x, s in zip(param_leaves, is_stacked) if not s]

    def full(o: list[Any]) -> list[Any]:
      """The parameters' leaves with the stacked ones as (dead) zeros."""
      it = iter(o)
      return [
        jnp.zeros(x.shape, x.dtype) if s else next(it) for x, s in zip(param_leaves, is_stacked)
      ]

    leaves_of = jax.tree_util.tree_leaves
    ys_zeros = lambda: [jnp.zeros(x.shape, x.dtype) for x in outs[n_carry:]]

    def embed(o: list[Any], b: Any) -> list[Any]:
      """The stack's initial carries, then its per-layer outputs [L, ...] (zeros: each
      chunk writes its layers')."""
      return [*operands(full(o), leaves_of(b), True)[n_const : n_const + n_carry], *ys_zeros()]

    def head(o: list[Any], b: Any, acts: list[Any]) -> Any:
      return evaluator(True, lambda ops: list(acts))(*full(o), *leaves_of(b))[0]

    before, constrain, bind = pins.constrainer(inside, body_entries, manual, mesh, in_stage=True)
    body = interpret(target.params["jaxpr"], constrain, before, bind, differentiable=True)

    def chunk(c: list[Any], w: list[Any], acts: list[Any], index: Any) -> list[Any]:
      """Global chunk `index`'s layers: the carries through them, their per-layer outputs
      written into the activations' [L, ...] buffers."""

      def layer(carry, x):
        out = body(*c, *carry, *x)
        return list(out[:n_carry]), list(out[n_carry:])

      carries, ys = jax.lax.scan(layer, list(acts[:n_carry]), list(w))
      start = index * w[0].shape[0]
      ys = [jax.lax.dynamic_update_slice_in_dim(a, y, start, 0) for a, y in zip(acts[n_carry:], ys)]
      return [*carries, *ys]

    loss, d_others, d_xs = run_schedule(
      pipeline, mesh, embed, chunk, head, others, xs, consts, micro
    )
    (d_params,) = xs_back(d_xs)
    it = iter(d_others)
    grads = [g if s else g + next(it) for g, s in zip(d_params, is_stacked)]
    return loss, jax.tree_util.tree_unflatten(tree, grads)

  return value_and_grad
