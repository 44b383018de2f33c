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
* the scan's per-layer outputs [L, ...] that the head reads travel with the activations,
  each chunk writing its layers' rows (those it does not read, such as a rematerialized
  layer's module state returned per layer, stay on their stage: zeros to the head).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.interpreters import partial_eval as pe

from automap_rl.ir.stacks import LayerStack
from automap_rl.ir.trace import scan_counts
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.xla.accumulate import microbatched
from automap_rl.xla.correspond import Flat, flatten
from automap_rl.xla.interpret import interpret
from automap_rl.xla.scheduled import depends, run_schedule
from automap_rl.xla.step_pins import StepPins, loss_alignment
from automap_rl.xla.unrolled import UnrolledSplit

__all__ = ["scheduled_value_and_grad"]


def _stack_scan(closed: jax_core.ClosedJaxpr, stack: LayerStack, schedule: str) -> Flat:
  """The stack's forward scan in `closed` (the first top-level scan of its L layers)."""
  for e in flatten(closed.jaxpr):
    params = e.eqn.params
    if (
      e.eqn.primitive.name == "scan"
      and params["length"] == stack.layers
      and scan_counts(params)[1] > 0
      and not params["reverse"]
    ):
      return e
  raise NotImplementedError(
    f"the {schedule} lowering runs a scanned layer stack; the loss has no forward scan of the "
    f"{stack.describe()}"
  )


class _Split:
  """The loss on one microbatch, split at its stack's scan (module docstring).

  Built from the loss's jaxpr `closed` on a microbatch, the scan `scan` in it, the plan's
  pins aligned with the loss on the whole batch (`aligned`), and which parameter leaves
  the stack stacks (`is_stacked`)."""

  def __init__(self, closed, scan: Flat, aligned, pins: StepPins, mesh, manual, is_stacked):
    self.closed, self.where, self.pins, self.mesh = closed, scan.origin, pins, mesh
    self.target, self.is_stacked = scan.eqn, is_stacked
    self.n_const, self.n_carry = scan_counts(scan.eqn.params)
    self.outs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in scan.eqn.outvars]
    self.read = [True] * (len(self.outs) - self.n_carry)
    where, entries = self.where, {e.origin: e for e in flatten(closed.jaxpr, into_scans=True)}
    under = lambda o: o[: len(where)] == where
    self.entries = entries
    self.outside = {o: s for o, s in aligned.items() if not under(o) and o in entries}
    self.inside = {o[len(where) :]: s for o, s in aligned.items() if under(o)}
    self.body_entries = {o[len(where) :]: e for o, e in entries.items() if under(o) and o != where}
    self.manual = manual

  def evaluator(self, in_stage: bool, replace: Callable[[list[Any]], list[Any]]):
    """The loss on (parameter leaves, microbatch leaves), its scan computed by `replace`."""
    before, constrain, bind = self.pins.constrainer(
      self.outside, self.entries, self.manual, self.mesh, in_stage=in_stage
    )
    return interpret(
      self.closed, constrain, before, bind, replaced={self.where: replace}, differentiable=True
    )

  def operands(self, leaves: list[Any], one_leaves: list[Any], in_stage: bool) -> list[Any]:
    """The scan's operands (what runs after it left dead)."""
    captured: list[Any] = []
    zeros = [jnp.zeros(o.shape, o.dtype) for o in self.outs]
    self.evaluator(in_stage, lambda ops: captured.extend(ops) or zeros)(*leaves, *one_leaves)
    return captured

  def full(self, others: list[Any], like: list[Any]) -> list[Any]:
    """The parameters' leaves (`like`) with the stacked ones as (dead) zeros."""
    it = iter(others)
    return [jnp.zeros(x.shape, x.dtype) if s else next(it) for x, s in zip(like, self.is_stacked)]

  def prepare(self, param_leaves: list[Any], first: list[Any]) -> tuple[list[Any], list[Any], Any]:
    """The scan's constants, its stacked weights [L, ...] and their pullback to the
    parameters' leaves, from the parameters and a microbatch `first` (leaves)."""
    n_const, n_carry = self.n_const, self.n_carry
    self.param_leaves = param_leaves
    consts = self.operands(param_leaves, first, False)[:n_const]
    self.read = self.head_reads(param_leaves, first)
    xs, xs_back = jax.vjp(
      lambda p: self.operands(p, first, False)[n_const + n_carry :], param_leaves
    )
    return consts, xs, xs_back

  def embed(self, others: list[Any], one: Any) -> list[Any]:
    """The stack's initial carries, then its per-layer outputs [L, ...] (zeros: each chunk
    writes its layers'), of microbatch `one`."""
    leaves = jax.tree_util.tree_leaves(one)
    ops = self.operands(self.full(others, self.param_leaves), leaves, True)
    ys = [jnp.zeros(x.shape, x.dtype) for x, r in zip(self.outs[self.n_carry :], self.read) if r]
    return [*ops[self.n_const : self.n_const + self.n_carry], *ys]

  def head_reads(self, param_leaves: list[Any], first: list[Any]) -> list[bool]:
    """Which of the scan's per-layer outputs the loss reads after the scan."""
    evaluate = lambda p, b, outs: self.evaluator(False, lambda ops: list(outs))(*p, *b)
    closed = jax.make_jaxpr(evaluate)(param_leaves, first, self.outs)
    used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[1]
    return used[len(used) - len(self.outs) + self.n_carry :]

  def scan_results(self, acts: list[Any]) -> list[Any]:
    """The scan's results from the activations (carries, the per-layer outputs the head
    reads): those it does not read as zeros."""
    it = iter(acts[self.n_carry :])
    ys = [
      next(it) if r else jnp.zeros(x.shape, x.dtype)
      for x, r in zip(self.outs[self.n_carry :], self.read)
    ]
    return [*acts[: self.n_carry], *ys]

  def head(self, others: list[Any], one: Any, acts: list[Any]) -> Any:
    """The loss of microbatch `one` given the scan's results `acts`."""
    evaluate = self.evaluator(True, lambda ops: self.scan_results(acts))
    return evaluate(*self.full(others, self.param_leaves), *jax.tree_util.tree_leaves(one))[0]

  def chunk_fn(self) -> Callable[..., list[Any]]:
    """`chunk(consts, weights, acts, index)` for `run_schedule`: global chunk `index`'s
    layers, the carries through them, their per-layer outputs written into the
    activations' [L, ...] buffers."""
    before, constrain, bind = self.pins.constrainer(
      self.inside, self.body_entries, self.manual, self.mesh, in_stage=True
    )
    body = interpret(self.target.params["jaxpr"], constrain, before, bind, differentiable=True)
    n_carry, read = self.n_carry, self.read

    def chunk(c: list[Any], w: list[Any], acts: list[Any], index: Any) -> list[Any]:
      def layer(carry, x):
        out = body(*c, *carry, *x)
        return list(out[:n_carry]), list(out[n_carry:])

      # The weights are the loop's scanned inputs: the pullback keeps them as they are
      # (`scheduled` does not save them per microbatch in flight).
      carries, ys = jax.lax.scan(layer, list(acts[:n_carry]), list(w))
      start = index * w[0].shape[0]
      ys = [y for y, r in zip(ys, read) if r]
      ys = [jax.lax.dynamic_update_slice_in_dim(a, y, start, 0) for a, y in zip(acts[n_carry:], ys)]
      return [*carries, *ys]

    return chunk

  def check_consts(self, param_leaves: list[Any], first: list[Any], describe: str) -> None:
    """NotImplementedError where the scan's constants depend on the batch or parameters."""
    closed_ops = jax.make_jaxpr(lambda p, b: self.operands(p, b, False))(param_leaves, first)
    n_p = len(param_leaves)
    on_batch = depends(closed_ops, set(range(n_p, n_p + len(first))))
    on_params = depends(closed_ops, set(range(n_p)))
    if any(on_batch[: self.n_const]) or any(on_params[: self.n_const]):
      raise NotImplementedError(
        f"the loop of the {describe} has constants computed from the batch or the parameters; "
        "the scheduled lowering pipelines loops whose constants are neither"
      )


def scheduled_value_and_grad(
  loss_fn: Callable[..., Any],
  pipeline: Pipeline,
  stack: LayerStack,
  problem: Problem,
  pins: StepPins,
  mesh: jax.sharding.Mesh,
  rows: Callable[[Any], Any],
  manual_rows: tuple[str, ...] = (),
  uniform: bool = False,
) -> Callable[[Any, Any], tuple[Any, Any]]:
  """`value_and_grad(params, batch) -> (loss [], grads)` of `loss_fn` run as `pipeline`'s
  schedule (`scheduled.run_schedule`; module docstring for the split), the loop manual
  over the batch axes `manual_rows` too (each device's rows of a microbatch, the loss
  traced at that size); `uniform`: see `scheduled.run_schedule`."""
  program, m_count = problem.program, pipeline.microbatches
  stacked_ids = set(stack.stacked_inputs(program, problem.named))
  leaves_of = jax.tree_util.tree_leaves
  manual = frozenset({pipeline.axis, *manual_rows})
  splits = math.prod(mesh.shape[a] for a in manual_rows)

  def value_and_grad(params: Any, batch: Any) -> tuple[Any, Any]:
    micro = microbatched(batch, m_count, rows)
    one = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[1] // splits, *x.shape[2:]), x.dtype), micro
    )
    closed = jax.make_jaxpr(loss_fn)(params, one)
    whole = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] * x.shape[1], *x.shape[2:]), x.dtype), micro
    )
    aligned = loss_alignment(jax.make_jaxpr(loss_fn)(params, whole), problem, params, whole)
    param_leaves, tree = jax.tree_util.tree_flatten(params)
    first = leaves_of(jax.tree.map(lambda x: x[0, : x.shape[1] // splits], micro))
    if stack.scanned:
      is_stacked = [program.inputs[i] in stacked_ids for i in range(len(param_leaves))]
      scan = _stack_scan(closed, stack, pipeline.schedule)
      split = _Split(closed, scan, aligned, pins, mesh, manual, is_stacked)
      split.check_consts(param_leaves, first, stack.describe())
    else:
      split = UnrolledSplit(closed, stack, problem, aligned, pins, mesh, manual)
    consts, xs, xs_back = split.prepare(param_leaves, first)
    others = [x for x, s in zip(param_leaves, split.is_stacked) if not s]
    loss, d_others, d_xs = run_schedule(
      pipeline,
      mesh,
      split.embed,
      split.chunk_fn(),
      split.head,
      others,
      xs,
      consts,
      micro,
      manual_rows,
      uniform,
    )
    (d_params,) = xs_back(d_xs)
    it = iter(d_others)
    grads = [g if s else g + next(it) for g, s in zip(d_params, split.is_stacked)]
    return loss, jax.tree_util.tree_unflatten(tree, grads)

  return value_and_grad
