"""Lowering a pipelined plan: the training step run as the schedule it is priced with.

A training step is already differentiated, so a pipeline is built from its forward:
`lower_pipelined` takes the loss function `loss_fn(params, batch) -> loss []` and the optax
optimizer that the step `(params, opt_state, batch) -> (params, opt_state, loss)` is made
of (`automap_rl.workloads.training.make_train_step`), and returns the same step with the
forward and backward run per microbatch, then one optimizer update:

* one stage (S = 1): gradient accumulation (`accumulate`);
* `gpipe`, `1f1b` and `interleaved`: their tick tables (`schedules`; GPipe runs every
  forward, then every backward) run by one loop under `jax.shard_map` (`scheduled`), the
  first stage embedding and the last computing head and loss per microbatch; scanned
  stacks are split at their scan (`staged_loss`), unrolled ones at their repeated
  segments (`unrolled`). The loop is manual over the stage axis, and over the plan's batch
  axes where no stacked weight is split over them but on its layer dim (`manual_rows`):
  the stage weights' gradients are then summed over the batch axes once, after the loop;
  over an axis the loop is auto over, XLA reduces them in every tick
  (`simulator.pipeline.manual_axes` prices both).

What the plan's intra-op decisions control: the shardings the step's arguments are stored
with and its outputs returned with (parameters, optimizer state and batch), the stacked
values of the stack with the stage axis added on their layer dim, the rows of the
microbatches (the axes the plan gives the batch inputs' dim 0, where they divide a
microbatch), and every intermediate, in the stages and outside them: each loss equation is
pinned as `lower` pins its counterpart in the planned step (`step_pins`), the stage and
manual axes left out. A grouped convolution's kernel gradient is summed per device
(`lower.grouped_conv_binder`).

On CPU, where XLA put a collective-permute inside an operation of a tick,
`lower_pipelined` compiles the uniform schedule instead (`scheduled`: every operation run
on every stage and the table's selected; `jit_pipelined(uniform=True)`), since the CPU
runtime's permutes wait for every device.

Fewer stages (but one) than the stage axis's devices run on the mesh with that axis split
in two, the stages over one part and the plan's decisions using the other
(`split_stage_axis`). Uneven chunks and steps with model state raise NotImplementedError
(`check_lowerable`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.compile_options import quick_compile_options
from automap_rl.ir.stacks import LayerStack
from automap_rl.mesh import spec_axes
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.xla import hlo
from automap_rl.xla.accumulate import accumulated, row_constrainer, train_step
from automap_rl.xla.hlo import inspect_compiled
from automap_rl.xla.hlo.module import called_computations
from automap_rl.xla.isolated import compile_directly
from automap_rl.xla.lower import Lowered, lowering_errors
from automap_rl.xla.numerics import compute_dtype, program_depth
from automap_rl.xla.scheduled import branches_taken
from automap_rl.xla.schedules import tick_table
from automap_rl.xla.staged_loss import scheduled_value_and_grad
from automap_rl.xla.step_pins import StepPins, pinned_loss

__all__ = [
  "check_lowerable",
  "jit_pipelined",
  "lower_pipelined",
  "manual_rows",
  "permutes_in_branches",
  "staged_specs",
]


def manual_rows(
  problem: Problem,
  decisions: Sequence[Decision],
  stack: LayerStack,
  batch: Any,
  microbatches: int,
  mesh: jax.sharding.Mesh,
  gather_weights_once: bool = False,
) -> tuple[str, ...]:
  """The batch axes a pipeline's loop runs manual over besides the stage axis (as
  `simulator.pipeline.manual_axes` prices it): the plan's batch axes where no stacked
  weight is split over them other than on its layer dim (or `gather_weights_once`
  gathers the weights before the loop) and every leaf of `batch` [B, ...] has
  microbatches [B / M, ...] whose rows divide over them; else none."""
  rows = problem.batch_axes(decisions)
  program = problem.program
  stacked = stack.stacked_inputs(program, problem.named)
  weights_on_rows = any(
    set(rows) & {a for axes in spec_axes(spec, len(program.values[v].shape))[1:] for a in axes}
    for v, spec in zip(stacked, problem.partition_specs(decisions, stacked))
  )
  splits = math.prod(mesh.shape[a] for a in rows)
  divides = all(
    (x.shape[0] // microbatches) % splits == 0 for x in jax.tree_util.tree_leaves(batch)
  )
  return rows if rows and divides and (gather_weights_once or not weights_on_rows) else ()


# A step with model state (batch norm's statistics) normalizes each microbatch by its own
# statistics and updates the running averages once per microbatch: not the step's numbers.
_MODEL_STATE = (
  "steps with model state (batch norm) are not {what}: each microbatch would be normalized "
  "by its own batch statistics, not the whole batch's as in the step (args must be "
  "(params, opt_state, batch))"
)


def permutes_in_branches(hlo_text: str) -> bool:
  """Whether a compiled module has a collective-permute inside a branch of a conditional
  (through the computations the branch calls): on CPU, where each waits for every device,
  stages running different branches of a tick deadlock there (`scheduled`)."""
  module = hlo.parse_module(hlo_text)
  pending = [
    name
    for body in module.bodies.values()
    for inst in body
    if inst.opcode == "conditional"
    for name, _ in called_computations(inst)
  ]
  seen: set[str] = set()
  while pending:
    name = pending.pop()
    if name in seen or name not in module.bodies:
      continue
    seen.add(name)
    for inst in module.bodies[name]:
      if inst.opcode.startswith("collective-permute"):
        return True
      pending += [n for n, _ in called_computations(inst)]
  return False


def check_lowerable(pipeline: Pipeline, stack: LayerStack, args: Sequence[Any]) -> None:
  """Raises NotImplementedError (one line) for what the lowering does not run: uneven
  chunks of a `stack`, a step whose `args` are not `(params, opt_state, batch)`."""
  if pipeline.stages == 1:  # Gradient accumulation: any stack, the axis free for intra-op use.
    if len(args) != 3:
      raise NotImplementedError(_MODEL_STATE.format(what="accumulated"))
    return
  if pipeline.layers_per_chunk is not None and len(set(pipeline.layers_per_chunk)) > 1:
    raise NotImplementedError(
      f"the lowering splits a stack into equal chunks; layers_per_chunk="
      f"{list(pipeline.layers_per_chunk)} is uneven"
    )
  if len(args) != 3:
    raise NotImplementedError(_MODEL_STATE.format(what="pipelined"))


def staged_specs(
  problem: Problem,
  decisions: Sequence[Decision],
  pipeline: Pipeline,
  stack: LayerStack,
  values: Sequence[int],
  sizes: Mapping[str, int],
) -> list[PartitionSpec]:
  """The plan's spec of each of `values`, the stage axis added (major) on the layer dim of
  every value stacked along the stack's layers (stacked weights, their optimizer state;
  an unrolled stack's per-layer ones on their dim 0 where it divides over the mesh axes'
  `sizes`) where there are stages (S > 1)."""
  program, classes = problem.program, set(stack.layer_classes)
  out = []
  for v, spec in zip(values, problem.partition_specs(decisions, values)):
    shape = program.values[v].shape
    if pipeline.stages > 1 and shape and problem.named.class_of(v, 0) in classes:
      axes = spec_axes(spec, len(shape))
      stacked = (pipeline.axis, *axes[0])
      if shape[0] % math.prod(sizes[a] for a in stacked) == 0:
        spec = PartitionSpec(stacked, *(a or None for a in axes[1:]))
    out.append(spec)
  return out


def split_stage_axis(
  jax_mesh: jax.sharding.Mesh, pipeline: Pipeline
) -> tuple[jax.sharding.Mesh, Pipeline]:
  """Where there are fewer stages (but one) than the stage axis's A devices: the mesh with
  that axis split in two, `{axis}_stages` of S devices (stage s on devices s A / S to
  (s + 1) A / S - 1 of the axis) and the axis itself keeping A / S, as the plan's
  decisions use it inside every stage (`Pipeline.stage_mesh`); and the pipeline over
  `{axis}_stages`. Otherwise both as they are."""
  names, sizes = list(jax_mesh.axis_names), list(jax_mesh.devices.shape)
  at = names.index(pipeline.axis)
  if pipeline.stages in (1, sizes[at]):
    return jax_mesh, pipeline
  outer = f"{pipeline.axis}_stages"
  sizes[at : at + 1] = [pipeline.stages, sizes[at] // pipeline.stages]
  names.insert(at, outer)
  mesh = jax.sharding.Mesh(jax_mesh.devices.reshape(sizes), tuple(names))
  return mesh, dataclasses.replace(pipeline, axis=outer)


def jit_pipelined(
  problem: Problem,
  decisions: Sequence[Decision],
  pipeline: Pipeline,
  loss_fn: Callable[..., Any],
  optimizer: optax.GradientTransformation,
  args: Sequence[Any],
  jax_mesh: jax.sharding.Mesh,
  donate_argnums: Sequence[int] = (),
  uniform: bool = False,
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
    uniform: every stage runs every operation of a tick (`scheduled.run_schedule`).

  Raises:
    NotImplementedError: (one line) a schedule, stage count, stack or step that is not
      lowered yet (module docstring).
  """
  program, mesh = problem.program, problem.mesh
  stack = pipeline.check(program, problem.named, mesh)
  check_lowerable(pipeline, stack, args)
  jax_mesh, pipeline = split_stage_axis(jax_mesh, pipeline)
  values = [*program.inputs, *program.outputs]
  specs = staged_specs(problem, decisions, pipeline, stack, values, dict(jax_mesh.shape))
  named = [NamedSharding(jax_mesh, s) for s in specs]
  n = len(program.inputs)
  in_shardings = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tuple(args)), named[:n])
  rows = row_constrainer(jax_mesh, problem.batch_axes(decisions), pipeline.microbatches)
  pins = StepPins.build(problem, decisions)
  manual = manual_rows(
    problem,
    decisions,
    stack,
    args[2],
    pipeline.microbatches,
    jax_mesh,
    pipeline.gather_weights_once,
  )
  if pipeline.stages == 1:
    micro_loss = pinned_loss(
      loss_fn, problem, pins, jax_mesh, pipeline.microbatches, frozenset(manual)
    )
    value_and_grad = accumulated(micro_loss, pipeline.microbatches, in_shardings[0], rows, manual)
    step = train_step(value_and_grad, optimizer)
  else:
    value_and_grad = scheduled_value_and_grad(
      loss_fn, pipeline, stack, problem, pins, jax_mesh, rows, manual, uniform
    )
    step = train_step(value_and_grad, optimizer)
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
  executable: bool = True,
) -> Lowered:
  """Compiles `jit_pipelined`'s step for `args` (arrays or `jax.ShapeDtypeStruct`s): a
  `Lowered` with its collectives (the stage transfers are collective-permutes over the
  stage axis), flops and memory. Its `differences` are empty: the sharding check reads
  the named scopes of `lower`'s module, which the pipelined step's pins do not carry the
  same way, so they are not compared (the pins are, module docstring).

  `isolated`: first compile the module in a child process (`isolated.compile_directly`,
  one more compile), so that an XLA abort raises `LoweringError` here instead of killing
  this process (`validate` runs random plans so; `Plan.check` runs expert ones without).
  Without `executable`, that compile is the only one and `Lowered.compiled` is its
  `isolated.CompiledModule` (a compile-only check).

  Raises:
    LoweringError: XLA raised, or (isolated) aborted or timed out, compiling the step.
    NotImplementedError: see `jit_pipelined`.
  """
  platform = jax_mesh.devices.flat[0].platform
  for uniform in (False, True):
    jitted, in_shardings, out_shardings = jit_pipelined(
      problem, decisions, pipeline, loss_fn, optimizer, args, jax_mesh, donate_argnums, uniform
    )
    stage = jitted.lower(*args)
    with lowering_errors(problem, decisions):
      if not executable:
        compiled = compile_directly(stage, jax_mesh.devices, isolated, analyses=True)
      else:
        if isolated:
          compile_directly(stage, jax_mesh.devices)
        compiled = stage.compile(compiler_options=quick_compile_options(platform))
    if uniform or platform != "cpu" or not permutes_in_branches(compiled.as_text()):
      break
  jax_mesh = jax.tree_util.tree_leaves(in_shardings)[0].mesh  # The stage axis split, if it is.
  # Each stage's figures count a tick's switch branch in the ticks that run it.
  taken = () if uniform or pipeline.stages == 1 else branches_taken(tick_table(pipeline))
  stats = inspect_compiled(compiled, jax_mesh.axis_names, tuple(jax_mesh.devices.shape), taken)
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
