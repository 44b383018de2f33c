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
import numpy as np
from jax.extend import core as jax_core
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.compile_options import quick_compile_options
from automap_rl.ir.program import Program
from automap_rl.ir.trace import CALL_PRIMITIVES, call_body
from automap_rl.mesh import spec_axes, to_jax_mesh
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.simulator.fusion import constant_ops
from automap_rl.xla.hlo import CompiledStats, inspect_compiled
from automap_rl.xla.isolated import CompileAborted
from automap_rl.xla.numerics import compute_dtype, host_copy, program_depth
from automap_rl.xla.realized import (
  Expected,
  ShardingDifference,
  normalize,
  partitioner_input,
  scope_name,
  sharding_differences,
)

__all__ = [
  "Lowered",
  "LoweringError",
  "grouped_conv_binder",
  "interpret",
  "lower",
  "lowering_errors",
]


@dataclasses.dataclass(frozen=True)
class Lowered:
  """A plan compiled by XLA.

  Attributes:
    jitted: the `jax.jit` of the interpreted function.
    compiled: the compiled executable for the example arguments, for checks (with
      `quick_compile_options`; calls of `jitted` compile with XLA's defaults).
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

  def run(self, args: Sequence[Any]) -> Any:
    """Copies `args` onto the mesh with `in_shardings` and runs the compiled program.

    The copy goes through host memory: `jax.device_put(..., may_alias=False)` still
    reuses a device-0 buffer as the first shard of a replicated array (jax 0.10), which
    donation would then delete under the caller.
    """
    placed = jax.device_put(jax.tree.map(host_copy, tuple(args)), self.in_shardings)
    return self.compiled(*placed)


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


def _bind(eqn, invals: Sequence[Any], **replaced: Any) -> list[Any]:
  """`eqn`'s primitive applied to `invals`, with its params but `replaced`."""
  params = eqn.primitive.get_bind_params({**eqn.params, **replaced})
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*invals, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


# Calls whose custom derivative rule a differentiated interpretation keeps.
_CUSTOM_DERIVATIVES = frozenset(
  {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}
)
# Calls that rematerialize their body (`jax.checkpoint`) in a differentiated interpretation.
_REMAT = frozenset({"checkpoint", "remat", "remat2"})


def interpret(
  closed: jax_core.ClosedJaxpr,
  constrain: Callable[[tuple[int, ...], list[Any]], list[Any]],
  before: Callable[[tuple[int, ...], list[Any]], list[Any]] = lambda origin, operands: operands,
  bind: Callable[[tuple[int, ...], Any, list[Any]], list[Any]] = lambda origin, eqn, invals: _bind(
    eqn, invals
  ),
  *,
  replaced: Mapping[tuple[int, ...], Callable[[list[Any]], list[Any]]] | None = None,
  differentiable: bool = False,
  stacks: bool = False,
) -> Callable[..., list[Any]]:
  """A function evaluating `closed` equation by equation, calling `before(origin, operands)`
  on each equation's array (non-literal) operands, `bind(origin, eqn, operands)` to apply it
  and `constrain(origin, results)` on its results, for every equation outside `while` and
  `cond` bodies (calls are inlined and a `scan` is bound with its body interpreted the same
  way, so origins are index paths through calls and scans, as in `automap_rl.ir.trace`).

  `replaced`: origin -> a function computing that equation's results from its operands
  instead. `differentiable`: the function will be differentiated, so a remat call runs
  its interpreted body under `jax.checkpoint` with the same policy (its rematerialization
  kept) and a custom derivative rule's call is bound whole (its rule kept; the equations
  inside get no constraints). `stacks`: a scan's stacked outputs are treated as the
  results of an equation at the scan's origin: in the body each iteration's values go
  through `before(origin, values)`, after the loop the stacked results through
  `constrain(origin, results)`.
  """
  replaced = replaced or {}

  def walk(
    jaxpr: jax_core.Jaxpr, consts: Sequence[Any], args: Sequence[Any], prefix: tuple[int, ...]
  ):
    env: dict = {}
    read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for index, eqn in enumerate(jaxpr.eqns):
      origin = (*prefix, index)
      invals = [read(v) for v in eqn.invars]
      name = eqn.primitive.name
      if origin in replaced:
        outs = replaced[origin](invals)
      elif differentiable and name in _CUSTOM_DERIVATIVES:
        outs = _bind(eqn, invals)
      elif name in CALL_PRIMITIVES:
        body = call_body(eqn)
        run = lambda *a, body=body, origin=origin: walk(
          getattr(body, "jaxpr", body), getattr(body, "consts", ()), a, origin
        )
        if differentiable and name in _REMAT:
          run = jax.checkpoint(
            run, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
          )
        outs = run(*invals)
      elif name == "scan":
        carried = eqn.params["num_carry"]
        outs = _bind(eqn, invals, jaxpr=scan_body(eqn.params["jaxpr"], origin, carried))
        if stacks:
          outs[carried:] = constrain(origin, outs[carried:])
      else:
        arrays = [i for i, v in enumerate(eqn.invars) if not isinstance(v, jax_core.Literal)]
        for i, x in zip(arrays, before(origin, [invals[i] for i in arrays])):
          invals[i] = x
        outs = constrain(origin, bind(origin, eqn, invals))
      for var, val in zip(eqn.outvars, outs):
        if not isinstance(var, jax_core.DropVar):
          env[var] = val
    return [read(v) for v in jaxpr.outvars]

  def scan_body(
    body: jax_core.ClosedJaxpr, prefix: tuple[int, ...], carried: int
  ) -> jax_core.ClosedJaxpr:
    """A scan's body, interpreted with origins under `prefix` (the scan's): the same
    inputs and outputs, so the scan's other params stay valid (constants the trace hoists
    stay in the closed jaxpr, which `scan` accepts); with `stacks`, its outputs after the
    `carried` carries go through `before(prefix, ...)`."""

    def run(*args):
      outs = walk(body.jaxpr, body.consts, args, prefix)
      return [*outs[:carried], *before(prefix, outs[carried:])] if stacks else outs

    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in body.in_avals]
    return jax.make_jaxpr(run)(*avals)

  return lambda *args: walk(closed.jaxpr, closed.consts, args, ())


# Ops XLA would partition otherwise than their rule if it saw their operands sharded as
# they are stored: along a window (halo exchanges), or, for gathers and scatter-adds by
# index (a GNN's messages), over devices of no mesh axis (whole operands all-reduced and
# permuted), or, for a split, along the split dim (an LSTM's gates; a GNN's edge features
# split where their pieces are stored over the feature dim), where XLA moves the operand
# to the results' sharding and exchanges each piece's unaligned edges by collective-permute
# between device pairs, while the rule splits the operand where it is and moves the pieces
# by one all-to-all each. `lower` pins their operands and results to the shardings their
# rule computes on.
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
  on = lambda spec: NamedSharding(jax.sharding.get_abstract_mesh() if mesh is None else mesh, spec)
  pinned_as: dict[
    int, tuple[Any, PartitionSpec]
  ] = {}  # id(array) -> (the array, its constraint's spec).

  def to(x: Any, spec: PartitionSpec) -> Any:
    y = jax.lax.with_sharding_constraint(x, on(spec))
    pinned_as[id(y)] = (y, spec)
    return y

  def pin(x: Any, value: int) -> Any:
    with jax.named_scope(scope_name(value)):
      return to(x, specs[value])

  resharded: dict[
    tuple[int, PartitionSpec], tuple[Any, Any]
  ] = {}  # (id(x), spec) -> (x, x resharded).

  def reshard(x: Any, spec: PartitionSpec) -> Any:
    """`x` constrained to `spec` for a pinned op, through `staged_spec` where it has one;
    once per array and spec, so that the ops reading one value on one sharding share one
    resharded copy (one collective), as the simulator prices them."""
    if id(x) in pinned_as and pinned_as[id(x)][1] == spec:
      return x
    if (id(x), spec) not in resharded:
      middle = staged_spec(pinned_as[id(x)][1], spec, np.ndim(x)) if id(x) in pinned_as else None
      resharded[id(x), spec] = (x, to(x if middle is None else to(x, middle), spec))
    return resharded[id(x), spec][1]

  operand_specs: list[
    tuple[tuple[int, ...], PartitionSpec]
  ] = []  # The last equation's constrained operands.

  def before(origin: tuple[int, ...], operands: list[Any]) -> list[Any]:
    if origin in pinned:
      operands = [reshard(x, spec) for x, spec in zip(operands, pinned[origin][0], strict=True)]
    operand_specs[:] = [(np.shape(x), pinned_as[id(x)][1]) for x in operands if id(x) in pinned_as]
    return operands

  def follows(x: Any, spec: PartitionSpec) -> bool:
    """With `differentiated`: an operand of `x`'s shape is constrained to `spec` (`x` is
    then recorded as so constrained)."""
    if not differentiated or (np.shape(x), spec) not in operand_specs:
      return False
    pinned_as[id(x)] = (x, spec)
    return True

  def constrain(origin: tuple[int, ...], results: list[Any]) -> list[Any]:
    if origin in pinned:
      results = [
        x if follows(x, spec) else to(x, spec)
        for x, spec in zip(results, pinned[origin][1], strict=True)
      ]
    chosen = constrained.get(origin)
    if chosen is None:
      return results
    if len(chosen) != len(results):
      raise ValueError(
        f"Equation {origin} has {len(results)} results but its program op has {len(chosen)}; "
        "was the program traced from the same function and arguments?"
      )
    kept = lambda x, spec: differentiated and id(x) in pinned_as and pinned_as[id(x)][1] == spec
    return [
      x if v is None or kept(x, specs[v]) or follows(x, specs[v]) else pin(x, v)
      for x, v in zip(results, chosen)
    ]

  return before, constrain


def _grouped_conv_axes(
  eqn,
  pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  origin: tuple[int, ...],
  count_param: str,
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
  """The mesh axes of a pinned grouped convolution's lhs batch and feature dims, or None
  when `eqn` is not a convolution at `origin` in `pinned` with `count_param` above one."""
  if (
    eqn.primitive.name != "conv_general_dilated"
    or eqn.params.get(count_param, 1) <= 1
    or origin not in pinned
  ):
    return None
  lhs_dims = eqn.params["dimension_numbers"][0]
  lhs_axes = spec_axes(pinned[origin][0][0], len(lhs_dims))
  return lhs_axes[lhs_dims[0]], lhs_axes[lhs_dims[1]]


def _dims_spec(dims: Sequence[int], by_dim: Mapping[int, tuple[str, ...]]) -> PartitionSpec:
  """A spec over `len(dims)` dims with the axes `by_dim` gives (others replicated)."""
  return PartitionSpec(*(by_dim.get(d) or None for d in range(len(dims))))


def _conv_binder(
  pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  mesh: jax.sharding.Mesh,
) -> Callable[[tuple[int, ...], Any, list[Any]], list[Any]]:
  """`bind` for `interpret`: a batch-grouped convolution (`batch_group_count > 1`, the kernel
  gradient of a grouped one) whose reduction (its lhs feature dim) the plan shards runs
  per device under `shard_map` and sums its partial results with a `psum` over the
  reduction's axes, as the simulator prices it; every other equation is bound as is.

  XLA's SPMD partitioner all-reduces such a convolution's partial results over every
  device, replicas included: with the reduction on a strict subset of the mesh and the
  other axes idle, the kernel gradient comes out multiplied by their size (see
  tests/test_lower.py). Under `shard_map` each device holds the groups of its lhs batch
  dim's axes (the rhs output features are gathered to whole groups where the plan splits
  them within a group) and the reduction's share of the batch.
  """

  def bind(origin: tuple[int, ...], eqn, invals: list[Any]) -> list[Any]:
    axes = _grouped_conv_axes(eqn, pinned, origin, "batch_group_count")
    if axes is None or not axes[1]:
      return _bind(eqn, invals)
    groups, summed = axes
    groups_count = eqn.params["batch_group_count"]
    lhs_dims, rhs_dims, out_dims = eqn.params["dimension_numbers"]
    spec = _dims_spec
    shards = int(np.prod([mesh.shape[a] for a in groups]))
    local = lambda lhs, rhs: jax.lax.psum(
      _bind(eqn, [lhs, rhs], batch_group_count=groups_count // shards)[0], summed
    )
    in_specs = (
      spec(lhs_dims, {lhs_dims[0]: groups, lhs_dims[1]: summed}),
      spec(rhs_dims, {rhs_dims[0]: groups, rhs_dims[1]: summed}),
    )
    out_spec = spec(out_dims, {out_dims[1]: groups})
    return [jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(*invals)]

  return bind


def grouped_conv_binder(
  pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  mesh: jax.sharding.Mesh | None,
) -> Callable[[tuple[int, ...], Any, list[Any]], list[Any]]:
  """`bind` for an `interpret` that will be differentiated (`_conv_binder`'s counterpart,
  for a kernel gradient that autodiff writes, not the program): a grouped convolution
  (`feature_group_count > 1`) whose lhs batch dim the plan shards (`pinned`: origin ->
  (operand specs, result specs)) gets a custom derivative whose kernel gradient runs per
  device under `shard_map`, its groups split as the lhs features are, and sums its
  partial results with a `psum` over the batch's axes; XLA's partitioner, given that
  batch-grouped convolution, over-counts it (twice the gradient on a 2 x 2 mesh, see
  tests/test_pipeline_lower.py). `mesh` None: the trace's mesh (inside `shard_map`).
  Every other equation is bound as is."""

  def bind(origin: tuple[int, ...], eqn, invals: list[Any]) -> list[Any]:
    axes = _grouped_conv_axes(eqn, pinned, origin, "feature_group_count")
    if axes is None or not axes[0]:
      return _bind(eqn, invals)
    batch, features = axes
    groups = eqn.params["feature_group_count"]
    lhs_dims, rhs_dims, out_dims = eqn.params["dimension_numbers"]
    on = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    shards = int(np.prod([on.shape[a] for a in features]))
    spec = _dims_spec
    specs = (
      spec(lhs_dims, {lhs_dims[0]: batch, lhs_dims[1]: features}),
      spec(rhs_dims, {rhs_dims[0]: features}),
      spec(out_dims, {out_dims[0]: batch, out_dims[1]: features}),
    )
    conv = lambda lhs, rhs: _bind(eqn, [lhs, rhs])[0]

    def kernel_gradient(lhs, rhs, cotangent):
      local = lambda w: _bind(eqn, [lhs, w], feature_group_count=groups // shards)[0]
      return jax.lax.psum(jax.vjp(local, rhs)[1](cotangent)[0], batch)

    @jax.custom_vjp
    def grouped(lhs, rhs):
      return conv(lhs, rhs)

    def backward(saved, cotangent):
      lhs, rhs = saved
      d_lhs = jax.vjp(lambda x: conv(x, rhs), lhs)[1](cotangent)[0]
      d_rhs = jax.shard_map(
        kernel_gradient,
        mesh=on,
        in_specs=specs,
        out_specs=specs[1],
        axis_names={*batch, *features},
        check_vma=False,
      )(lhs, rhs, cotangent)
      return d_lhs, d_rhs

    grouped.defvjp(lambda lhs, rhs: (conv(lhs, rhs), (lhs, rhs)), backward)
    return [grouped(*invals)]

  return bind


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


def lower(
  problem: Problem,
  decisions: Sequence[Decision],
  fn: Callable[..., Any],
  args: Sequence[Any],
  *,
  jax_mesh: jax.sharding.Mesh | None = None,
  donate_argnums: Sequence[int] = (),
  isolated: bool = True,
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

  Returns:
    The compiled plan, its statistics and its differences from the plan.

  Raises:
    LoweringError: XLA raised, or (isolated) aborted or timed out, compiling the plan.
  """
  program = problem.program
  mesh = to_jax_mesh(problem.mesh) if jax_mesh is None else jax_mesh
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
  constrained = _constrained(problem)
  results = [v for chosen in constrained.values() for v in chosen if v is not None]
  value_ids = list(dict.fromkeys([*program.inputs, *program.outputs, *results]))
  pinned, stacks = _pinned(problem), _stacks(problem)
  stack_ops = [op for ops in stacks.values() for op in ops]
  value_specs, op_specs = problem.value_and_op_specs(
    decisions, value_ids, [*pinned.values(), *stack_ops]
  )  # One resolution.
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
  stage = jitted.lower(*args)
  with lowering_errors(problem, decisions):
    partitioned = partitioner_input(stage, mesh.devices, isolated)
    compiled = stage.compile(compiler_options=quick_compile_options(mesh.devices.flat[0].platform))
  if partitioned is None and mesh.devices.size > 1:
    raise RuntimeError(
      f"The sharding check of a {mesh.devices.size}-device plan got no module from XLA's "
      "partitioner dump (the direct compile failed where jax's compile did not)."
    )
  axis_names, axis_sizes = problem.mesh.axis_names, problem.mesh.axis_sizes
  stats = inspect_compiled(compiled, axis_names, axis_sizes)
  differences = (
    ()
    if partitioned is None
    else sharding_differences(
      partitioned,
      *_expectations(problem, specs, args, constrained, computed),
      axis_names,
      axis_sizes,
    )
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
