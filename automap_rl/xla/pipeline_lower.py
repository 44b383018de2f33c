"""Lowering a pipelined plan: the step for each schedule; GPipe of a scanned layer stack.

A training step is already differentiated, so a pipeline is built from its forward:
`lower_pipelined` takes the loss function `loss_fn(params, batch) -> loss []` and the optax
optimizer that the step `(params, opt_state, batch) -> (params, opt_state, loss)` is made
of (`automap_rl.workloads.training.make_train_step`), and returns the same step with the
forward pipelined:

1. The loss's jaxpr is evaluated equation by equation (calls inlined, rematerialization
   and custom derivative rules kept: it is differentiated after); at the forward
   stack's `scan` (the first top-level scan of the stack's L iterations) it runs
   `gpipe` instead of the loop.
2. `gpipe`: the scanned inputs (the stacked layer weights, [L, ...]) are reshaped to
   [S, L / S, ...] and split over the stage axis, stage s holding layers s L / S to
   (s + 1) L / S - 1; the carries (activations [B, ...]) are split into M microbatches
   [M, B / M, ...] (microbatch m holds rows m, m + M, m + 2M, ..., so that a batch dim
   sharded over the data axes stays on its devices). One loop of M + S - 1 iterations
   runs under `jax.shard_map`, manual over the stage axis (and the batch axes, below): at iteration
   t stage s
   applies its L / S layers (a scan of the original body, its rematerialization kept) to
   microbatch t - s (stage 0 reads it as the loop's input of iteration t, the others
   receive it from the stage before with `jax.lax.ppermute`); its result is the loop's
   output of iteration t (the last stage's from iteration S - 1 on are the M
   microbatches').
   The outputs are re-assembled in microbatch order. Per-layer outputs of the scan (its
   `ys`, [L, ...]) are averaged over the microbatches: exact for outputs that do not
   depend on the activations (a dense block's zero auxiliary loss) or are batch means.
3. `jax.value_and_grad` of that loss (the loop's transpose runs the backward pass stage
   by stage in reverse; gradients of the stage weights accumulate over the microbatches
   by construction), one optimizer update.

What the plan's intra-op decisions control: the shardings the step's arguments are stored
with and its outputs returned with (parameters, optimizer state and batch), the stacked
values of the stack with the stage axis added on their layer dim, the batch dim of the
microbatched activations (the axes the plan gives the batch inputs' dim 0, where they
divide a microbatch), and every intermediate, in the stages and outside them: each loss
equation is pinned as `lower` pins its counterpart in the planned step
(`automap_rl.xla.correspond` aligns the two), the stage and manual axes left out. Where no
stacked weight is split over the batch axes (other than on its layer dim, which is gathered
before the loop), the loop is manual over them too: each device runs its rows of a
microbatch, and the stage weights' gradients are summed over the batch axes once, where
the backward leaves the loop. Over the axes it is auto over, XLA reduces the gradients in
every iteration (`simulator.pipeline.manual_axes` prices both). A grouped convolution's
kernel gradient is summed per device (`lower.grouped_conv_binder`).

This GPipe lowering runs the `gpipe` schedule of a scanned stack. The others run as they
are priced: one stage (S = 1) is gradient accumulation (`accumulate`); `1f1b` and
`interleaved` run their tick tables (`schedules`, `scheduled`) with the first stage
embedding and the last computing head and loss per microbatch, scanned stacks split at
their scan (`staged_loss`) and unrolled ones at their repeated segments (`unrolled`).
Stages fewer (but one) than the stage axis's devices, uneven chunks and steps with model
state raise NotImplementedError (`check_lowerable`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jax_core
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.compile_options import quick_compile_options
from automap_rl.ir.stacks import LayerStack
from automap_rl.ir.trace import scan_counts
from automap_rl.mesh import spec_axes
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.workloads.training import make_train_step
from automap_rl.xla.accumulate import accumulated, row_constrainer, train_step
from automap_rl.xla.correspond import Flat, align, flatten
from automap_rl.xla.hlo import inspect_compiled
from automap_rl.xla.interpret import interpret
from automap_rl.xla.isolated import compile_directly
from automap_rl.xla.lower import Lowered, lowering_errors
from automap_rl.xla.numerics import compute_dtype, program_depth
from automap_rl.xla.staged_loss import scheduled_value_and_grad
from automap_rl.xla.step_pins import StepPins, pinned_loss

__all__ = [
  "batch_axes",
  "check_lowerable",
  "gpipe",
  "jit_pipelined",
  "lower_pipelined",
  "pipelined_loss",
  "staged_specs",
]


def gpipe(
  body: Callable[..., list[Any]],
  num_carry: int,
  consts: Sequence[Any],
  carries: Sequence[Any],
  xs: Sequence[Any],
  *,
  stages: int,
  microbatches: int,
  axis: str,
  batch_axes: tuple[str, ...],
  mesh: jax.sharding.Mesh,
  manual_batch: bool = False,
) -> list[Any]:
  """A layer scan run as a GPipe pipeline over mesh axis `axis` (module docstring, 2).

  Args:
    body: the scan body, `body(*consts, *carry, *x) -> [*carry, *y]`.
    num_carry: how many carries it has.
    consts: the loop's constants (every stage gets them whole).
    carries: the initial carries, each [B, ...] (B the batch).
    xs: the scanned inputs, each [L, ...] (L the layers).
    stages: S, dividing L.
    microbatches: M, dividing B.
    axis: the stage axis (S devices).
    batch_axes: mesh axes a microbatch's batch dim is split over (where they divide it).
    mesh: the mesh.
    manual_batch: the loop is manual over `batch_axes` too (every microbatch divides over
      them and no stacked weight is split over them): each device runs its rows, and the
      stage weights' gradients are summed over the batch axes once, where the backward
      leaves the loop, not in every iteration.

  Returns:
    The final carries, each [B, ...], then the per-layer outputs, each [L, ...] (averaged
    over the microbatches).
  """
  s_count, m_count = stages, microbatches
  layers = xs[0].shape[0]
  free = PartitionSpec.UNCONSTRAINED  # Dims XLA's propagation shards as the arguments are.
  constrain = lambda x, *dims: jax.lax.with_sharding_constraint(
    x, NamedSharding(mesh, PartitionSpec(*dims, *(free,) * (x.ndim - len(dims))))
  )
  splits = math.prod(mesh.shape[a] for a in batch_axes)
  rows = lambda c: (
    batch_axes if (c.shape[0] // m_count) % splits == 0 else None
  )  # A microbatch of one row stays whole.
  split = lambda c: constrain(
    jnp.swapaxes(c.reshape(c.shape[0] // m_count, m_count, *c.shape[1:]), 0, 1),
    None,
    rows(c) or None,
  )
  micro = [split(c) for c in carries]  # Each [M, B / M, ...].
  staged = [constrain(x.reshape(s_count, layers // s_count, *x.shape[1:]), axis, None) for x in xs]

  def run_stage(
    consts: list[Any], weights: list[Any], carry: list[Any]
  ) -> tuple[list[Any], list[Any]]:
    """This stage's L / S layers on one microbatch: (carries, per-layer outputs [L / S, ...])."""

    def layer(c, x):
      out = body(*consts, *c, *x)
      return list(out[:num_carry]), list(out[num_carry:])

    return jax.lax.scan(layer, list(carry), list(weights))

  def pipeline(
    weights: list[Any], inputs: list[Any], consts: list[Any]
  ) -> tuple[list[Any], list[Any]]:
    """Per stage: weights [1, L / S, ...], inputs [M, B / M, ...] -> (outputs [1, M, B / M,
    ...], per-layer outputs [1, L / S, ...])."""
    weights = [w[0] for w in weights]
    stage = jax.lax.axis_index(axis)
    ys_shape = jax.eval_shape(run_stage, consts, weights, [i[0] for i in inputs])[1]
    shift = [(s, s + 1) for s in range(s_count - 1)]  # The last stage sends nothing on.

    def tick(state, step):
      (received, ys_sum), (t, fresh) = state, step
      m = t - stage
      valid = (m >= 0) & (m < m_count)
      current = [jnp.where(stage == 0, f, r) for f, r in zip(fresh, received)]
      done, ys = run_stage(consts, weights, current)
      ys_sum = [a + jnp.where(valid, y, jnp.zeros_like(y)) for a, y in zip(ys_sum, ys)]
      return ([jax.lax.ppermute(d, axis, shift) for d in done], ys_sum), done

    # The loop reads microbatch t as its input of iteration t (zeros after the M-th) and
    # gives its result as its output of iteration t (the last stage's from iteration S - 1
    # on are the M microbatches'): read from, or written into, a carried buffer, the
    # buffer's gradient would be summed and selected over whole in every iteration.
    padded = [jnp.concatenate([i, jnp.zeros((s_count - 1, *i.shape[1:]), i.dtype)]) for i in inputs]
    start = (
      [jnp.zeros_like(i[0]) for i in inputs],
      [jnp.zeros(y.shape, y.dtype) for y in ys_shape],
    )
    (_, ys_sum), outputs = jax.lax.scan(tick, start, (jnp.arange(m_count + s_count - 1), padded))
    if manual_batch:  # Per-layer outputs are batch means or do not depend on the batch.
      ys_sum = [jax.lax.pmean(y, batch_axes) for y in ys_sum]
    return [o[None, s_count - 1 :] for o in outputs], [(y / m_count)[None] for y in ys_sum]

  rows_spec = PartitionSpec(None, batch_axes) if manual_batch else PartitionSpec()
  outputs, ys = jax.shard_map(
    pipeline,
    mesh=mesh,
    in_specs=(PartitionSpec(axis), rows_spec, PartitionSpec()),
    out_specs=(PartitionSpec(axis, *rows_spec), PartitionSpec(axis)),
    axis_names={axis, *batch_axes} if manual_batch else {axis},
    check_vma=False,
  )(staged, micro, list(consts))
  merge = lambda o, c: jnp.swapaxes(o[-1], 0, 1).reshape(c.shape)
  return [merge(o, c) for o, c in zip(outputs, carries)] + [
    y.reshape(layers, *y.shape[2:]) for y in ys
  ]


def _stack_scans(jaxpr: jax_core.Jaxpr, layers: int) -> list[Flat]:
  """The forward scans of `layers` iterations with a carry in `jaxpr` (calls inlined), in
  order: a layer stack's loop."""
  return [
    e
    for e in flatten(jaxpr)
    if e.eqn.primitive.name == "scan"
    and e.eqn.params["length"] == layers
    and scan_counts(e.eqn.params)[1] > 0
    and not e.eqn.params["reverse"]
  ]


def pipelined_loss(
  loss_fn: Callable[..., Any],
  pipeline: Pipeline,
  stack: LayerStack,
  problem: Problem,
  decisions: Sequence[Decision],
  mesh: jax.sharding.Mesh,
) -> Callable[..., Any]:
  """`loss_fn(params, batch)` with its layer stack's forward scan (the first scan of the
  stack's L layers) run by `gpipe` (module docstring, 1). The loop body `gpipe` runs on a
  microbatch is the same scan's of `loss_fn` traced on a microbatch (every leaf of `batch`
  [B, ...] cut to [B / M, ...]). Every other equation, in the stages and outside them, is
  pinned as `lower` pins its counterpart in the planned step (`correspond.align`).

  Raises:
    NotImplementedError: the loss has no forward scan of the stack's L layers (an
      unrolled stack), or its loop on a microbatch differs from the loop on the batch
      other than in the batch dim.
    ValueError: the problem's program keeps no jaxpr to align the loss with.
  """
  m_count, layers = pipeline.microbatches, stack.layers
  if problem.program.jaxpr is None:
    raise ValueError(
      "pipeline lowering pins the plan through the traced step's jaxpr; this program has none "
      "(build it with automap_rl.ir.trace)"
    )
  step = problem.program.jaxpr.jaxpr
  rows = batch_axes(problem, decisions)
  pins = StepPins.build(problem, decisions)
  program, stacked = problem.program, stack.stacked_inputs(problem.program, problem.named)
  # A stacked weight split over the batch axes on its layer dim only is gathered over them
  # before the loop (`gpipe` takes the stage's layers whole); on another dim, it cannot be.
  weights_on_rows = any(
    set(rows) & {a for axes in spec_axes(spec, len(program.values[v].shape))[1:] for a in axes}
    for v, spec in zip(stacked, problem.partition_specs(decisions, stacked))
  )

  def loss(params, batch):
    closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(params, batch)
    scans = _stack_scans(closed.jaxpr, layers)
    if not scans:
      raise NotImplementedError(
        f"pipeline lowering runs a scanned layer stack; the loss function has no forward "
        f"scan of the {stack.describe()} (unrolled stacks are not lowered yet)"
      )
    target, where = scans[0].eqn, scans[0].origin
    n_const, n_carry = scan_counts(target.params)
    whole = [v.aval.shape for v in target.invars]
    splits = math.prod(mesh.shape[a] for a in rows)
    manual_batch = (
      bool(rows)
      and not weights_on_rows
      and all((s[0] // m_count) % splits == 0 for s in whole[n_const : n_const + n_carry])
    )
    # The body runs on a device's rows of a microbatch where the loop is manual over the batch axes.
    cut_by = m_count * (splits if manual_batch else 1)
    micro = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] // cut_by, *x.shape[1:]), x.dtype), batch
    )
    micro_scans = _stack_scans(jax.make_jaxpr(loss_fn)(params, micro).jaxpr, layers)
    cut = [
      (s[0] // cut_by, *s[1:]) if n_const <= i < n_const + n_carry else s
      for i, s in enumerate(whole)
    ]
    if len(micro_scans) != len(scans) or cut != [v.aval.shape for v in micro_scans[0].eqn.invars]:
      raise NotImplementedError(
        f"the loop of the {stack.describe()} on a microbatch is not its loop on the batch "
        "cut along the carries' dim 0; only such loops are pipelined"
      )
    micro_scan = micro_scans[0].eqn
    # The loss's inputs are the step's parameters and batch (its optimizer state between).
    n_params, n_batch = (
      len(jax.tree_util.tree_leaves(params)),
      len(jax.tree_util.tree_leaves(batch)),
    )
    inputs = list(closed.jaxpr.invars)
    step_inputs = [*step.invars[:n_params], *step.invars[len(step.invars) - n_batch :]]
    aligned = align(flatten(closed.jaxpr), flatten(step), dict(zip(inputs, step_inputs)))
    body_closed = micro_scan.params["jaxpr"]
    entries = lambda jaxpr: {e.origin: e for e in flatten(jaxpr, into_scans=True)}
    whole_body, in_body = entries(target.params["jaxpr"].jaxpr), entries(body_closed.jaxpr)
    inside = {
      o[len(where) :]: s
      for o, s in aligned.items()
      if o[: len(where)] == where and len(o) > len(where)
    }
    inside = {
      o: s
      for o, s in inside.items()
      if o in in_body
      and o in whole_body
      and in_body[o].eqn.primitive == whole_body[o].eqn.primitive
    }
    manual = frozenset({pipeline.axis, *(rows if manual_batch else ())})
    before, constrain, bind = pins.constrainer(inside, in_body, manual, mesh, in_stage=True)
    # Evaluated as traced, rematerialization (`checkpoint`) kept: the loss is differentiated after
    # this.
    body = interpret(body_closed, constrain, before, bind, differentiable=True)
    run = lambda operands: gpipe(
      body,
      n_carry,
      operands[:n_const],
      operands[n_const : n_const + n_carry],
      operands[n_const + n_carry :],
      stages=pipeline.stages,
      microbatches=m_count,
      axis=pipeline.axis,
      batch_axes=rows,
      mesh=mesh,
      manual_batch=manual_batch,
    )
    outside = {o: s for o, s in aligned.items() if o[: len(where)] != where}
    before, constrain, bind = pins.constrainer(
      outside, entries(closed.jaxpr), frozenset({pipeline.axis}), mesh, in_stage=False
    )
    evaluate = interpret(
      closed, constrain, before, bind, replaced={where: run}, differentiable=True
    )
    outs = evaluate(*jax.tree_util.tree_leaves((params, batch)))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  return loss


def check_lowerable(
  pipeline: Pipeline, stack: LayerStack, mesh_axis_size: int, args: Sequence[Any]
) -> None:
  """Raises NotImplementedError (one line) for what the lowering does not run yet: fewer
  stages (but one) than the stage axis's `mesh_axis_size` devices, GPipe over an unrolled
  `stack`, uneven chunks, a step whose `args` are not `(params, opt_state, batch)`."""
  if pipeline.stages == 1:  # Gradient accumulation: any stack, the axis free for intra-op use.
    if len(args) != 3:
      raise NotImplementedError(
        "gradient accumulation runs steps (params, opt_state, batch); model state is not "
        "accumulated yet"
      )
    return
  if pipeline.stages != mesh_axis_size:
    raise NotImplementedError(
      f"{pipeline.stages} stages on the {mesh_axis_size} devices of axis {pipeline.axis!r}: "
      "the lowering needs one stage per device of the stage axis"
    )
  if not stack.scanned and pipeline.schedule == "gpipe":
    raise NotImplementedError(
      f"the GPipe lowering runs a scanned layer stack, not the {stack.describe()} (1F1B and "
      "interleaved run unrolled stacks)"
    )
  if pipeline.layers_per_chunk is not None and len(set(pipeline.layers_per_chunk)) > 1:
    raise NotImplementedError(
      f"the lowering splits a stack into equal chunks; layers_per_chunk="
      f"{list(pipeline.layers_per_chunk)} is uneven"
    )
  if len(args) != 3:
    raise NotImplementedError(
      "pipeline lowering runs steps (params, opt_state, batch); model state is not lowered yet"
    )


def staged_specs(
  problem: Problem,
  decisions: Sequence[Decision],
  pipeline: Pipeline,
  stack: LayerStack,
  values: Sequence[int],
) -> list[PartitionSpec]:
  """The plan's spec of each of `values`, the stage axis added (major) on the layer dim of
  every value stacked along the stack's layers (stacked weights, their optimizer state)
  where there are stages (S > 1)."""
  program, classes = problem.program, set(stack.layer_classes)
  out = []
  for v, spec in zip(values, problem.partition_specs(decisions, values)):
    shape = program.values[v].shape
    if pipeline.stages > 1 and shape and problem.named.class_of(v, 0) in classes:
      axes = spec_axes(spec, len(shape))
      spec = PartitionSpec((pipeline.axis, *axes[0]), *(a or None for a in axes[1:]))
    out.append(spec)
  return out


def batch_axes(problem: Problem, decisions: Sequence[Decision]) -> tuple[str, ...]:
  """The mesh axes the plan splits the batch dim (dim 0 of the batch inputs) over."""
  program = problem.program
  inputs = program.batch_inputs
  return spec_axes(problem.partition_specs(decisions, inputs[:1])[0], 1)[0] if inputs else ()


def jit_pipelined(
  problem: Problem,
  decisions: Sequence[Decision],
  pipeline: Pipeline,
  loss_fn: Callable[..., Any],
  optimizer: optax.GradientTransformation,
  args: Sequence[Any],
  jax_mesh: jax.sharding.Mesh,
  donate_argnums: Sequence[int] = (),
) -> tuple[Any, Any, Any]:
  """The pipelined training step (module docstring) under `jax.jit` on `jax_mesh`, with
  the plan's argument and output shardings (`staged_specs`): (jitted, in_shardings as a
  pytree like `args`, out_shardings as a pytree like the outputs).

  Args:
    problem: the traced step `(params, opt_state, batch) -> (params, opt_state, loss)`.
    decisions: the plan's intra-op decisions, inside every stage.
    pipeline: its stages over one mesh axis.
    loss_fn: `loss_fn(params, batch) -> loss []`, the loss the step differentiates.
    optimizer: the optax transformation the step applies.
    args: example `(params, opt_state, batch)`.
    jax_mesh: the mesh to run on.
    donate_argnums: positional arguments whose buffers the step may reuse.

  Raises:
    NotImplementedError: (one line) a schedule, stage count, stack or step that is not
      lowered yet (module docstring).
  """
  program, mesh = problem.program, problem.mesh
  stack = pipeline.check(program, problem.named, mesh)
  check_lowerable(pipeline, stack, mesh.axis_size(pipeline.axis), args)
  specs = staged_specs(problem, decisions, pipeline, stack, [*program.inputs, *program.outputs])
  named = [NamedSharding(jax_mesh, s) for s in specs]
  n = len(program.inputs)
  in_shardings = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tuple(args)), named[:n])
  if pipeline.stages == 1:
    rows = row_constrainer(jax_mesh, batch_axes(problem, decisions), pipeline.microbatches)
    pins = StepPins.build(problem, decisions)
    micro_loss = pinned_loss(loss_fn, problem, pins, jax_mesh, pipeline.microbatches)
    value_and_grad = accumulated(micro_loss, pipeline.microbatches, in_shardings[0], rows)
    step = train_step(value_and_grad, optimizer)
  elif pipeline.schedule in ("1f1b", "interleaved"):
    rows = row_constrainer(jax_mesh, batch_axes(problem, decisions), pipeline.microbatches)
    pins = StepPins.build(problem, decisions)
    value_and_grad = scheduled_value_and_grad(
      loss_fn, pipeline, stack, problem, pins, jax_mesh, rows
    )
    step = train_step(value_and_grad, optimizer)
  else:
    step = make_train_step(
      pipelined_loss(loss_fn, pipeline, stack, problem, decisions, jax_mesh), optimizer
    )
  out_tree = jax.tree_util.tree_structure(jax.eval_shape(step, *args))
  if out_tree.num_leaves != len(program.outputs):
    raise ValueError(
      f"the loss function and optimizer make a step of {out_tree.num_leaves} outputs, the planned "
      f"step has {len(program.outputs)}: are they the ones the step is built from?"
    )
  out_shardings = jax.tree_util.tree_unflatten(out_tree, named[n:])
  jitted = jax.jit(
    step,
    in_shardings=in_shardings,
    out_shardings=out_shardings,
    donate_argnums=tuple(donate_argnums),
  )
  return jitted, in_shardings, out_shardings


def lower_pipelined(
  problem: Problem,
  decisions: Sequence[Decision],
  pipeline: Pipeline,
  loss_fn: Callable[..., Any],
  optimizer: optax.GradientTransformation,
  args: Sequence[Any],
  jax_mesh: jax.sharding.Mesh,
  donate_argnums: Sequence[int] = (),
  isolated: bool = False,
) -> Lowered:
  """Compiles `jit_pipelined`'s step for `args` (arrays or `jax.ShapeDtypeStruct`s): a
  `Lowered` with its collectives (the stage transfers are collective-permutes over the
  stage axis), flops and memory. Its `differences` are empty: the sharding check reads
  the named scopes of `lower`'s module, which the pipelined step's pins do not carry the
  same way, so they are not compared (the pins are, module docstring).

  `isolated`: first compile the module in a child process (`isolated.compile_directly`,
  one more compile), so that an XLA abort raises `LoweringError` here instead of killing
  this process (`validate` runs random plans so; `Plan.check` runs expert ones without).

  Raises:
    LoweringError: XLA raised, or (isolated) aborted or timed out, compiling the step.
    NotImplementedError: see `jit_pipelined`.
  """
  jitted, in_shardings, out_shardings = jit_pipelined(
    problem, decisions, pipeline, loss_fn, optimizer, args, jax_mesh, donate_argnums
  )
  stage = jitted.lower(*args)
  with lowering_errors(problem, decisions):
    if isolated:
      compile_directly(stage, jax_mesh.devices)
    compiled = stage.compile(
      compiler_options=quick_compile_options(jax_mesh.devices.flat[0].platform)
    )
  stats = inspect_compiled(compiled, problem.mesh.axis_names, problem.mesh.axis_sizes)
  return Lowered(
    jitted,
    compiled,
    in_shardings,
    out_shardings,
    stats,
    jax_mesh,
    (),
    program_depth(problem.program),
    compute_dtype(problem.program),
    "accumulation" if pipeline.stages == 1 else pipeline.schedule,
  )
