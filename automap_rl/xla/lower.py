"""Lowering a plan to XLA: `jax.jit` with in/out shardings and sharding constraints.

`lower(problem, decisions, fn, args)` re-interprets the closed jaxpr of `fn` the way
`automap_rl.ir.trace` walks it: call-like primitives are inlined and a `scan` is bound
with its body interpreted the same way (a new closed jaxpr of the same signature), so
each equation's index path through calls and scans is the `Op.origin` of the program op
it became, and the ops of a loop body are constrained per iteration like any other.
`while` and `cond` are bound whole (their bodies have no origin), so XLA's sharding
propagation partitions them as it chooses. After every equation that is a program op,
each array result gets `jax.lax.with_sharding_constraint` to the
`PartitionSpec` the plan resolves for it, replicated ones included: every dim names its
axes or `None` (replicated), never `PartitionSpec.UNCONSTRAINED`, so XLA's sharding
propagation cannot spread an op over a mesh axis the plan leaves idle. Values folded from
constants (a scatter-add's zeros) are the exception: XLA makes them in the sharding each
reader needs. Convolutions and
windowed reductions (`PINNED_PRIMITIVES`) also get their operands and results constrained to
the shardings their rule computes on, so that XLA never splits a window (a spatial dim): a
spatially sharded activation is gathered before the convolution, as the simulator prices
it, and a grouped convolution is split only by whole groups. A grouped convolution's
kernel gradient (`batch_group_count > 1`) with its reduction sharded runs under
`shard_map` with an explicit `psum` (`_conv_binder`): XLA's partitioner sums it over every
device, replicas included, which multiplies it by their count. Dots (`OPERAND_PINNED`) get
their operands constrained to the shardings their rule computes on, so XLA reshards an
operand at the constraint, as the simulator prices it, rather than choosing its own
strategy inside the dot (which moved 1.6x the bytes on the demo's searched plan); their
results keep only their value's constraint, since a dot computed with a sharded
contraction leaves partial sums that the value's sharding reduces, unless the value
splits a dim the dot computes split over more axes (`result_pins`). The ops reading one
array on one sharding share one constrained copy (one collective, as priced), and an
operand that must both move axes between dims and gather others goes through
`staged_spec` (an all-to-all, then an all-gather), where XLA asked at once would gather
the whole array. A scan's stacked outputs are constrained after the loop, and each
iteration's value inside it to the sharding its `scan_stack` op reads it on (`_stacks`).
Arguments and
outputs get the plan's `NamedSharding`s as `in_shardings` / `out_shardings`. The compiled
module's shardings are compared with the plan's (`automap_rl.xla.realized`):
`Lowered.differences` lists every value XLA shards otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jax_core
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.compile_options import quick_compile_options
from automap_rl.mesh import to_jax_mesh
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.xla.constraints import (
  _constrained,
  _constrainer,
  _pinned,
  _stacks,
  result_pins,
  staged_spec,
)
from automap_rl.xla.grouped_conv import _conv_binder, grouped_conv_binder
from automap_rl.xla.hlo import CompiledStats, inspect_compiled
from automap_rl.xla.interpret import interpret
from automap_rl.xla.isolated import CompileAborted
from automap_rl.xla.numerics import compute_dtype, host_copy, program_depth
from automap_rl.xla.realized import (
  Expected,
  ShardingDifference,
  normalize,
  partitioned_compile,
  partitioner_input,
  sharding_differences,
)

__all__ = [
  "Lowered",
  "LoweringError",
  "grouped_conv_binder",
  "interpret",
  "lower",
  "lowering_errors",
  "result_pins",
  "staged_spec",
]


@dataclasses.dataclass(frozen=True)
class Lowered:
  """A plan compiled by XLA.

  Attributes:
    jitted: the `jax.jit` of the interpreted function.
    compiled: the compiled executable for the example arguments, for checks (with
      `quick_compile_options`; calls of `jitted` compile with XLA's defaults), or of a
      compile-only check its `isolated.CompiledModule`.
    in_shardings: a `NamedSharding` per argument, as pytrees like `args`.
    out_shardings: a `NamedSharding` per output leaf, as a pytree like the outputs.
    stats: collectives, flops and memory of the compiled module.
    mesh: the `jax.sharding.Mesh` it runs on.
    differences: every argument, constrained result and output that the module entering
      XLA's SPMD partitioner shards otherwise than the plan; empty when the plan is
      realized as written.
    depth: the program's op depth (`program_depth`), for numerics tolerances.
    compute_dtype: the narrowest float dtype the program computes in (`compute_dtype`),
      for numerics tolerances.
    schedule: how a pipelined step ran: "gpipe", "1f1b", "interleaved" or "accumulation"
      (one stage); "" for a step without a pipeline.
  """

  jitted: Any
  compiled: Any
  in_shardings: tuple[Any, ...]
  out_shardings: Any
  stats: CompiledStats
  mesh: jax.sharding.Mesh
  differences: tuple[ShardingDifference, ...]
  depth: int
  compute_dtype: str
  schedule: str = ""

  def run(self, args: Sequence[Any]) -> Any:
    """Copies `args` onto the mesh with `in_shardings` and runs the compiled program.

    The copy goes through host memory: `jax.device_put(..., may_alias=False)` still
    reuses a device-0 buffer as the first shard of a replicated array (jax 0.10), which
    donation would then delete under the caller.
    """
    placed = jax.device_put(jax.tree.map(host_copy, tuple(args)), self.in_shardings)
    return self.compiled(*placed)


def _expectations(
  problem: Problem,
  specs: Mapping[int, PartitionSpec],
  args: Sequence[Any],
  constrained: Mapping[tuple[int, ...], Sequence[int | None]],
  computed: Mapping[int, PartitionSpec],
) -> tuple[dict[str, Expected], dict[int, Expected], list[Expected]]:
  """The plan's sharding of each argument (by the `op_name` jax gives its HLO parameter),
  constrained result (by value id; a pinned op's result as its op computes it, `computed`)
  and output, for `realized.sharding_differences`."""
  program, shape = problem.program, problem.mesh.shape
  expect = lambda v, where, s=specs: Expected(
    v, where, normalize(s[v], len(program.values[v].shape), shape)
  )
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tuple(args))[0]]
  arguments = {
    f"call_args{path}": expect(v, f"argument {program.values[v].path or path}")
    for path, v in zip(paths, program.inputs)
  }
  ops = {v: op for op in program.ops for v in op.results}
  results = {
    v: expect(v, f"result of {ops[v].primitive} (op {ops[v].id})", {**specs, **computed})
    for chosen in constrained.values()
    for v in chosen
    if v is not None
  }
  outputs = [
    expect(v, f"output {i}" + (f" {program.values[v].path}" if program.values[v].path else ""))
    for i, v in enumerate(program.outputs)
  ]
  return arguments, results, outputs


class LoweringError(RuntimeError):
  """XLA cannot compile a plan: it aborted (in a child process, see `isolated`), timed out or
  raised. The message names XLA's complaint and the program op and shardings it is about."""


# Words of XLA's complaints (its SPMD handler's file, or the parameter it rejects) -> the
# primitives they are about.
_COMPLAINTS = {
  "convolution": ("conv_general_dilated",),
  "group_count": ("conv_general_dilated",),
  "dot_handler": ("dot_general",),
  "gather": ("gather",),
  "scatter": ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"),
}


def _lowering_error(
  problem: Problem, decisions: Sequence[Decision], complaint: str
) -> LoweringError:
  """One line: XLA's complaint, then the first program op of the kind it is about that the
  plan shards, with the shardings it computes on (and how many more there are)."""
  kinds = {p for word, primitives in _COMPLAINTS.items() if word in complaint for p in primitives}
  program = problem.program
  ops = [op.id for op in program.ops if op.primitive in kinds]
  _, specs = problem.value_and_op_specs(decisions, (), ops)
  sharded = [
    (o, operands, results)
    for o, (operands, results) in zip(ops, specs)
    if any(any(d is not None for d in spec) for spec in (*operands, *results))
  ]
  if not sharded:
    return LoweringError(f"XLA cannot compile the plan ({complaint}); it does not say which op.")
  o, operands, results = sharded[0]
  op = program.ops[o]
  shapes = lambda ids, specs_: ", ".join(
    f"{list(program.values[v].shape)} {spec}" for v, spec in zip(ids, specs_)
  )
  more = f" (and {len(sharded) - 1} more sharded {op.primitive} ops)" if len(sharded) > 1 else ""
  return LoweringError(
    f"XLA cannot compile the plan ({complaint}) at {op.primitive} (op {o}): "
    f"{shapes(op.operands, operands)} -> {shapes(op.results, results)}{more}."
  )


@contextlib.contextmanager
def lowering_errors(problem: Problem, decisions: Sequence[Decision]) -> Iterator[None]:
  """Compiling the plan `decisions` inside: XLA's abort (in a child process) or error
  becomes a one-line `LoweringError` naming the op it is about."""
  try:
    yield
  except CompileAborted as e:
    raise _lowering_error(problem, decisions, f"aborted: {e}") from None
  except jax.errors.JaxRuntimeError as e:
    raise _lowering_error(problem, decisions, str(e).strip().splitlines()[0]) from None


def _resolve(
  problem: Problem, decisions: Sequence[Decision]
) -> tuple[
  dict[tuple[int, ...], tuple[int | None, ...]],
  dict[int, PartitionSpec],
  dict[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  dict[int, PartitionSpec],
]:
  """One resolution of the plan for `lower`: the constrained results (`_constrained`), the
  spec of every argument, output and constrained value, the pinned ops' and scan stacks'
  (operand specs, result specs) by origin, and each pinned result's spec as computed."""
  program = problem.program
  constrained = _constrained(problem)
  results = [v for chosen in constrained.values() for v in chosen if v is not None]
  value_ids = list(dict.fromkeys([*program.inputs, *program.outputs, *results]))
  pinned, stacks = _pinned(problem), _stacks(problem)
  stack_ops = [op for ops in stacks.values() for op in ops]
  value_specs, op_specs = problem.value_and_op_specs(
    decisions, value_ids, [*pinned.values(), *stack_ops]
  )
  specs = dict(zip(value_ids, value_specs))
  stack_specs = dict(zip(stack_ops, op_specs[len(pinned) :]))
  op_specs = [
    (operands, result_pins(program, op, results, specs))
    for op, (operands, results) in zip(pinned.values(), op_specs)
  ]
  pinned_specs = dict(zip(pinned, op_specs))
  pinned_specs.update(
    {
      origin: ([stack_specs[op][0][0] for op in ops], [stack_specs[op][1][0] for op in ops])
      for origin, ops in stacks.items()
    }
  )
  computed = {
    v: spec
    for op, (_, result_specs) in [*zip(pinned.values(), op_specs), *stack_specs.items()]
    for v, spec in zip(program.ops[op].results, result_specs)
  }
  return constrained, specs, pinned_specs, computed


def _traced(
  problem: Problem, fn: Callable[..., Any], args: Sequence[Any]
) -> tuple[jax_core.ClosedJaxpr, Any]:
  """The closed jaxpr `lower` interprets and its output tree: the trace the program was
  built from (`fn` is not traced again), else `fn` traced on `args`; ValueError where its
  inputs or outputs are not the program's."""
  program = problem.program
  if program.jaxpr is not None:  # The trace the program was built from: fn is not traced again.
    closed, out_tree = program.jaxpr, program.out_tree
  else:
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(out_shape)
  if len(closed.jaxpr.invars) != len(program.inputs) or len(closed.jaxpr.outvars) != len(
    program.outputs
  ):
    raise ValueError(
      f"fn has {len(closed.jaxpr.invars)} inputs and {len(closed.jaxpr.outvars)} outputs but the "
      f"program has {len(program.inputs)} and {len(program.outputs)}."
    )
  return closed, out_tree


def _compiled(stage: Any, devices: Any, isolated: bool, executable: bool) -> tuple[str | None, Any]:
  """`lower`'s compiles of `stage` over `devices`: the module entering XLA's SPMD
  partitioner (None on one device) and the compiled executable, or without `executable`
  the `isolated.CompiledModule` of the sharding check's one compile."""
  if executable:
    partitioned = partitioner_input(stage, devices, isolated)
    compiled = stage.compile(compiler_options=quick_compile_options(devices.flat[0].platform))
  else:
    partitioned, compiled = partitioned_compile(stage, devices, isolated)
  if partitioned is None and devices.size > 1:
    raise RuntimeError(
      f"The sharding check of a {devices.size}-device plan got no module from XLA's "
      "partitioner dump (the direct compile failed where jax's compile did not)."
    )
  return partitioned, compiled


def lower(
  problem: Problem,
  decisions: Sequence[Decision],
  fn: Callable[..., Any],
  args: Sequence[Any],
  *,
  jax_mesh: jax.sharding.Mesh | None = None,
  donate_argnums: Sequence[int] = (),
  isolated: bool = True,
  executable: bool = True,
) -> Lowered:
  """Compiles `fn(*args)` partitioned by `decisions`.

  Args:
    problem: the problem `decisions` are for; its program must be `trace(fn, *args)`.
    decisions: the plan.
    fn: the function that was traced.
    args: example arguments (arrays or `jax.ShapeDtypeStruct`s), positional pytrees.
    jax_mesh: the mesh to run on; default `to_jax_mesh(problem.mesh)`.
    donate_argnums: positional arguments whose buffers the compiled program may reuse.
    isolated: first compile the module in a child process (`isolated.compile_directly`,
      a couple of seconds more), so that an XLA abort raises `LoweringError` here instead
      of killing this process. Either way the module is compiled once through the backend
      itself for the sharding check (`realized.partitioner_input`), then by `jax.jit`.
    executable: compile it by `jax.jit` too, for an executable to run (`Lowered.compiled`);
      without, the module is compiled once, for the check and its statistics, and
      `Lowered.compiled` is its `isolated.CompiledModule` (a compile-only check).

  Returns:
    The compiled plan, its statistics and its differences from the plan.

  Raises:
    LoweringError: XLA raised, or (isolated) aborted or timed out, compiling the plan.
  """
  program = problem.program
  mesh = to_jax_mesh(problem.mesh) if jax_mesh is None else jax_mesh
  closed, out_tree = _traced(problem, fn, args)
  constrained, specs, pinned_specs, computed = _resolve(problem, decisions)
  in_leaves = [NamedSharding(mesh, specs[v]) for v in program.inputs]
  out_leaves = [NamedSharding(mesh, specs[v]) for v in program.outputs]
  arg_tree = jax.tree_util.tree_structure(tuple(args))
  in_shardings = jax.tree_util.tree_unflatten(arg_tree, in_leaves)
  out_shardings = jax.tree_util.tree_unflatten(out_tree, out_leaves)
  before, constrain = _constrainer(constrained, specs, pinned_specs, mesh)
  body = interpret(closed, constrain, before, _conv_binder(pinned_specs, mesh), stacks=True)

  def interpreted(*call_args):
    flat = jax.tree_util.tree_leaves(call_args)
    return jax.tree_util.tree_unflatten(out_tree, body(*flat))

  jitted = jax.jit(
    interpreted,
    in_shardings=in_shardings,
    out_shardings=out_shardings,
    donate_argnums=tuple(donate_argnums),
  )
  with lowering_errors(problem, decisions):
    partitioned, compiled = _compiled(jitted.lower(*args), mesh.devices, isolated, executable)
  axis_names, axis_sizes = problem.mesh.axis_names, problem.mesh.axis_sizes
  stats = inspect_compiled(compiled, axis_names, axis_sizes)
  expected = _expectations(problem, specs, args, constrained, computed)
  differences = (
    ()
    if partitioned is None
    else sharding_differences(partitioned, *expected, axis_names, axis_sizes)
  )
  return Lowered(
    jitted,
    compiled,
    in_shardings,
    out_shardings,
    stats,
    mesh,
    differences,
    program_depth(program),
    compute_dtype(program),
  )
