"""`Plan`: a sharding plan for a function on a mesh, with its cost, report, picture and jit.

Plans come from `agents.partition` (search or an expert tactic):

```python
from agents import partition

plan = partition(step, params, opt_state, batch, mesh="data=2,model=4", hardware="h100",
                 agent="mcts", budget=2000, seed=0,
                 arg_names=("params", "opt_state", "batch"),
                 arg_roles=("parameter", "optimizer_state", "input"))
print(plan.report())          # decisions, per-argument shardings, cost beside every expert tactic
print(plan.diagram())         # how the largest arguments are split over the devices
plan.plot("plan.png")         # the same as a picture
jitted = plan.jit()           # jax.jit(step) with the plan's in/out shardings
plan.check()                  # compiles the plan as written, checks its numbers
plan.in_shardings             # NamedShardings, pytrees like (params, opt_state, batch)
```

A plan may also pipeline a layer stack (`pipeline`, `automap_rl.pipeline.Pipeline`): its
decisions then apply inside every stage, and its cost is the pipelined step's
(`simulator.PipelineCost`). A training step is already differentiated and a pipeline is
built from the forward, so running such a plan needs the loss function and optimizer the
step is made of (`Plan(..., loss_fn=workload.loss_fn, optimizer=workload.optimizer)`):
`jit`, `lower` and `check` then run the pipelined step
(`automap_rl.xla.pipeline_lower`); a bare step's pipeline is priced and reported only.
`plan_to_json` and `plan_from_json` write and read decisions and pipeline as JSON.

The formatting helpers (`cost_dict`, `format_costs`, `format_arguments`, `baselines`) live
here so that the library and the `automap-rl partition` command share them. A plan knows
nothing of how it was found beyond the agent's name and its search result (any object
with `simulations`, `seconds`, `setup_seconds` and `actions`), so this module sits in the
core, below the agents that make plans.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl import tactics
from automap_rl.mesh import HARDWARE, Mesh, to_jax_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import ArgDim, Decision, Group
from automap_rl.simulator import COMM_KINDS, KINDS, Cost, PipelineCost
from automap_rl.topology import format_axis_links, links_json

__all__ = [
  "Plan",
  "baselines",
  "compare_with_best_expert",
  "cost_dict",
  "format_pipeline",
  "decision_from_json",
  "decision_to_json",
  "fit_advice",
  "format_arguments",
  "format_costs",
  "plan_from_json",
  "plan_to_json",
  "shardable",
  "transfer_decisions",
]


PIPELINE_TERMS = ("steady_s", "bubble_s", "transfer_s", "gradient_reduction_s", "update_s")


def cost_dict(cost: Cost | PipelineCost) -> dict[str, Any]:
  """The JSON figures of a cost: comm by kind (`COMM_KINDS`), and of a pipelined plan its
  step time's terms under `pipeline`."""
  kinds = COMM_KINDS
  out = {
    "step_time_s": float(cost.step_time),
    "peak_memory_bytes": float(cost.peak_memory),
    "fits": bool(cost.fits),
    "comm_bytes": {k: float(b) for k, b in zip(kinds, np.asarray(cost.comm_bytes))},
    "comm_count": {k: int(round(float(c))) for k, c in zip(kinds, np.asarray(cost.comm_count))},
  }
  if isinstance(cost, PipelineCost):
    out["pipeline"] = {name: float(getattr(cost.terms, name)) for name in PIPELINE_TERMS}
  return out


def decision_to_json(decision: Decision) -> dict[str, Any]:
  """A decision as JSON: its target (`path` and `dim`, `group` or `class`) and axis."""
  target = decision.target
  if isinstance(target, ArgDim):
    return {"path": target.path, "dim": target.dim, "axis": decision.axis}
  if isinstance(target, Group):
    return {"group": target.id, "axis": decision.axis}
  return {"class": int(target), "axis": decision.axis}


def decision_from_json(entry: dict[str, Any]) -> Decision:
  """The decision of `decision_to_json`'s dict."""
  if "path" in entry:
    return Decision(ArgDim(entry["path"], int(entry["dim"])), entry["axis"])
  if "group" in entry:
    return Decision(Group(int(entry["group"])), entry["axis"])
  return Decision(int(entry["class"]), entry["axis"])


def plan_to_json(decisions: Sequence[Decision], pipeline: Pipeline | None = None) -> dict[str, Any]:
  """`{"decisions": [...]}`, with `"pipeline": {...}` when the plan has one."""
  out: dict[str, Any] = {"decisions": [decision_to_json(d) for d in decisions]}
  if pipeline is not None:
    out["pipeline"] = pipeline.to_json()
  return out


def plan_from_json(entry: dict[str, Any]) -> tuple[list[Decision], Pipeline | None]:
  """The decisions and pipeline (None when absent) of `plan_to_json`'s dict."""
  pipeline = entry.get("pipeline")
  return [
    decision_from_json(d) for d in entry["decisions"]
  ], None if pipeline is None else Pipeline.from_json(pipeline)


def shardable(problem: Problem) -> bool:
  """Whether some named dimension of the program divides by some mesh axis (of size > 1):
  without one, every plan is the replicated plan."""
  sizes = [s for s in problem.mesh.axis_sizes if s > 1]
  return any(c.size % s == 0 for c in problem.named.classes for s in sizes)


def fit_advice(problem: Problem, cost: Cost) -> str:
  """What would make a plan of `cost` fit: more devices, a profile with more memory, or a
  smaller batch (one line)."""
  peak, capacity = float(cost.peak_memory), problem.mesh.hardware.hbm_bytes
  larger = sorted((h.hbm_bytes, name) for name, h in HARDWARE.items() if h.hbm_bytes >= peak)
  devices = problem.mesh.num_devices * int(np.ceil(peak / capacity))
  return (
    f"peak {peak / 2**30:.1f} GiB per device > {capacity / 2**30:.1f} GiB of "
    f"{problem.mesh.hardware.name}; "
    f"would fit: about {devices} devices (memory sharded as this plan shards it)"
    + (f", a profile with more memory ({', '.join(name for _, name in larger)})" if larger else "")
    + ", or a smaller batch, or rematerialization (remat=true) where the family has it"
  )


def format_costs(rows: dict[str, dict[str, Any]]) -> str:
  """A table of plans: step time, memory and collectives (collective-permutes when a
  plan has them)."""
  kinds = KINDS + tuple(
    k for k in COMM_KINDS[len(KINDS) :] if any(r["comm_bytes"].get(k) for r in rows.values())
  )
  lines = [
    f"{'plan':<16} {'step ms':>9} {'mem/dev MiB':>12} {'fits':>5}  "
    + "  ".join(f"{k:>16}" for k in kinds)
  ]
  for name, r in rows.items():
    comm = "  ".join(
      f"{r['comm_count'].get(k, 0):>5}x{r['comm_bytes'].get(k, 0.0) / 2**20:>8.1f}MiB"
      for k in kinds
    )
    lines.append(
      f"{name:<16} {r['step_time_s'] * 1e3:>9.3f} {r['peak_memory_bytes'] / 2**20:>12.1f} "
      f"{'yes' if r['fits'] else 'NO':>5}  {comm}"
    )
  return "\n".join(lines)


def format_arguments(problem: Problem, decisions, max_args: int) -> str:
  """Per-argument shardings, parameters and inputs first."""
  program = problem.program
  specs = problem.partition_specs(decisions, program.inputs)
  rows = [
    (program.values[v], s)
    for v, s in zip(program.inputs, specs)
    if not program.values[v].path.startswith("opt_state")
  ]
  lines = [f"{'argument':<48} {'shape':<20} sharding"]
  for value, spec in rows[:max_args]:
    lines.append(f"{value.path:<48} {str(list(value.shape)):<20} {tuple(spec)}")
  if len(rows) > max_args:
    lines.append(
      f"... {len(rows) - max_args} more arguments (optimizer state follows its parameter)"
    )
  return "\n".join(lines)


def baselines(problem: Problem) -> dict[str, dict[str, Any]]:
  """The cost figures of every applicable expert tactic (evaluated together: one compile)."""
  return {name: cost_dict(cost) for name, (_, cost) in tactics.applicable_costs(problem).items()}


def format_pipeline(pipeline: Pipeline, cost: Any) -> str:
  """The pipeline and its step time as the sum of its terms (ms), one line each."""
  terms = " + ".join(
    f"{name.removesuffix('_s').replace('_', ' ')} {float(getattr(cost.terms, name)) * 1e3:.3f}"
    for name in PIPELINE_TERMS
  )
  return f"{pipeline}\nstep time {float(cost.step_time) * 1e3:.3f} ms = {terms}"


def compare_with_best_expert(agent: str, costs: dict[str, dict[str, Any]]) -> str:
  """One line: the plan of `agent` against the best expert (`tactics.best_expert`) among
  the expert rows of `costs` (`Plan.costs()`; an expert's own row among them), or, where no expert
  fits, says so and
  whether the plan fits, never giving a ratio to a plan that cannot run."""
  experts = {
    k: tactics.Score(v["step_time_s"], v["peak_memory_bytes"], v["fits"])
    for k, v in costs.items()
    if k != agent or agent in tactics.TACTICS
  }
  plan = costs[agent]
  if not experts:
    return f"{agent}: no expert tactic applies"
  best = tactics.best_expert(experts)
  if experts[best].fits:
    note = "" if plan["fits"] else " (this plan does NOT fit in memory)"
    ratio = plan["step_time_s"] / experts[best].step_time
    return f"{agent} step time / best expert ({best}): {ratio:.3f}{note}"
  if plan["fits"]:
    return f"no expert fits in memory; {agent}'s plan fits, the only one here that does"
  return (
    f"no expert fits in memory, nor does {agent}'s plan (least memory: {best}, "
    f"{experts[best].peak_memory / 2**30:.1f} GiB per device)"
  )


@dataclasses.dataclass(eq=False)
class Plan:
  """A sharding plan for `fn(*args)` on a mesh.

  Attributes:
    fn: the function partitioned.
    args: its example arguments (arrays or `jax.ShapeDtypeStruct`s).
    problem: the traced program on its mesh.
    decisions: the plan, in order (earlier decisions win); with a pipeline, inside every
      stage.
    agent: how it was found (an agent name or a tactic name).
    search: the search's result (trace, simulations, seconds), or None for a tactic.
    devices: the devices to run on, row-major over the mesh (None: the first of
      `jax.devices()`).
    pipeline: the layer stack's pipeline stages, or None.
    loss_fn: `loss_fn(params, batch) -> loss []`, the loss `fn` differentiates: what a
      pipelined plan lowers (None: `fn` only, which a pipeline cannot be built from).
    optimizer: the optax transformation `fn` applies to the gradients (with `loss_fn`).
    in_specs, out_specs: `PartitionSpec`s as pytrees like `args` and like the outputs
      (with a pipeline: those a stage's devices hold).
  """

  fn: Callable[..., Any]
  args: tuple[Any, ...]
  problem: Problem
  decisions: list[Decision]
  agent: str = "tactic"
  search: Any = None
  devices: tuple[Any, ...] | None = None
  pipeline: Pipeline | None = None
  loss_fn: Callable[..., Any] | None = None
  optimizer: Any = None
  in_specs: Any = None
  out_specs: Any = None

  def __post_init__(self):
    program = self.problem.program
    if self.pipeline is not None:  # Bad input fails here, in one line (`Pipeline.check`).
      self.pipeline.check(program, self.problem.named, self.mesh)
      self.pipeline.check_decisions(self.decisions, self.mesh)
    specs = self.problem.partition_specs(self.decisions, [*program.inputs, *program.outputs])
    arg_tree = jax.tree_util.tree_structure(tuple(self.args))
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(self.fn, *self.args))
    n = len(program.inputs)
    self.in_specs = jax.tree_util.tree_unflatten(arg_tree, specs[:n])
    self.out_specs = jax.tree_util.tree_unflatten(out_tree, specs[n:])

  @property
  def mesh(self) -> Mesh:
    return self.problem.mesh

  @functools.cached_property
  def jax_mesh(self) -> jax.sharding.Mesh:
    """The real mesh (needs `mesh.num_devices` devices; on CPU set
    `XLA_FLAGS=--xla_force_host_platform_device_count=N` before importing jax)."""
    return to_jax_mesh(self.mesh, self.devices)

  def _named(self, specs):
    return jax.tree.map(
      lambda s: NamedSharding(self.jax_mesh, s),
      specs,
      is_leaf=lambda x: isinstance(x, PartitionSpec),
    )

  @property
  def in_shardings(self):
    """`NamedSharding`s of the arguments, as pytrees like `args`."""
    return self._named(self.in_specs)

  @property
  def out_shardings(self):
    """`NamedSharding`s of the outputs, as a pytree like `fn`'s result."""
    return self._named(self.out_specs)

  @functools.cached_property
  def cost(self) -> Cost | PipelineCost:
    """The plan's cost: `Problem.plan_cost` (exactly today's without a pipeline, or with
    one stage and one microbatch)."""
    return self.problem.plan_cost(self.decisions, self.pipeline)

  def to_json(self) -> dict[str, Any]:
    """The plan's decisions and pipeline (`plan_to_json`), and the link of each mesh axis
    (`topology.links_json`)."""
    return {**plan_to_json(self.decisions, self.pipeline), "links": links_json(self.mesh)}

  def _pipelined(self) -> bool:
    """Whether the plan has pipeline stages to lower.

    Raises:
      ValueError: it has, and no loss function and optimizer to build them from.
    """
    if self.pipeline is None or self.pipeline.trivial:
      return False
    if self.loss_fn is None or self.optimizer is None:
      raise ValueError(
        f"a pipelined plan ({self.pipeline}) lowers the forward, and a bare step is already "
        "differentiated: pass the loss function and optimizer it is built from, "
        "Plan(..., loss_fn=workload.loss_fn, optimizer=workload.optimizer)"
      )
    return True

  def jit(self):
    """The user's own function under `jax.jit` with the plan's argument and output
    shardings on the real mesh, the arguments the step updates donated
    (`Program.donate_argnums`). The intermediates are left to XLA's sharding propagation;
    `check` compiles the plan with every decision it makes pinned, and checks it.
    With pipeline stages: the pipelined step built from `loss_fn` and `optimizer`
    (`automap_rl.xla.pipeline_lower.jit_pipelined`), ValueError without them."""
    if self._pipelined():
      from automap_rl.xla.pipeline_lower import jit_pipelined

      return jit_pipelined(
        self.problem,
        self.decisions,
        self.pipeline,
        self.loss_fn,
        self.optimizer,
        self.args,
        self.jax_mesh,
        self.problem.program.donate_argnums,
      )[0]
    return jax.jit(
      self.fn,
      in_shardings=self.in_shardings,
      out_shardings=self.out_shardings,
      donate_argnums=self.problem.program.donate_argnums,
    )

  def lower(self, donate_argnums: Sequence[int] = ()):
    """Compiles the plan as written (`automap_rl.xla.lower.lower`: sharding constraints on
    the intermediates it decides): a `Lowered` with the jitted function, the compiled
    executable, its collectives and its differences from the plan. With pipeline stages:
    the pipelined step (`automap_rl.xla.pipeline_lower.lower_pipelined`), ValueError
    without a loss function and optimizer."""
    if self._pipelined():
      from automap_rl.xla.pipeline_lower import lower_pipelined

      return lower_pipelined(
        self.problem,
        self.decisions,
        self.pipeline,
        self.loss_fn,
        self.optimizer,
        self.args,
        self.jax_mesh,
        tuple(donate_argnums),
      )
    from automap_rl.xla.lower import lower  # Lazily: lowering pulls in the HLO tools.

    return lower(
      self.problem,
      self.decisions,
      self.fn,
      self.args,
      jax_mesh=self.jax_mesh,
      donate_argnums=tuple(donate_argnums),
    )

  def check(self, args: Sequence[Any] | None = None):
    """Compiles the plan as written (`lower`; a pipelined plan's pipelined step), runs it on
    concrete `args` (default: the example arguments) and checks its outputs against the
    unpartitioned function `fn`; raises `automap_rl.xla.numerics.NumericsError` on a
    mismatch. Returns the `Lowered` (its `schedule` says how a pipelined step ran)."""
    from automap_rl.xla.numerics import check_numerics

    args = self.args if args is None else tuple(args)
    lowered = self.lower()
    check_numerics(self.fn, args, lowered)
    return lowered

  @functools.cached_property
  def expert_costs(self) -> dict[str, dict[str, Any]]:
    """JSON figures of every applicable expert tactic (`baselines`), priced once a plan."""
    return baselines(self.problem)

  def costs(self) -> dict[str, dict[str, Any]]:
    """JSON figures of this plan and of every applicable expert tactic."""
    return {self.agent: cost_dict(self.cost), **self.expert_costs}

  def report(self, max_args: int = 12) -> str:
    """The search's figures (for a searched plan), the pipeline and its step time's terms
    (for a pipelined plan), the decisions, per-argument shardings and the cost beside every
    expert tactic, with the step time against the best expert's."""
    lines = [f"plan by {self.agent} on mesh {self.mesh_name} ({self.mesh.hardware.name})"]
    if self.search is not None:
      s = self.search
      lines[0] += (
        f": {s.simulations} simulations in {s.seconds:.1f}s ({s.setup_seconds:.1f}s setup)"
      )
      if s.stopped_by is not None:
        lines[0] += f", stopped by its {s.stopped_by} limit"
      if s.lower_bound is not None:
        lines.append(
          f"lower bound on the step time of the plans searched: {s.lower_bound * 1e3:.3f} ms "
          "(see SearchResult.lower_bound)"
        )
      names = s.actions
    else:
      names = [str(d) for d in self.decisions]
    lines.append(format_axis_links(self.mesh))
    if self.pipeline is not None:
      lines.append(format_pipeline(self.pipeline, self.cost))
    lines.append(f"{len(self.decisions)} decisions" + (":" if names else " (replicated)"))
    lines += [f"  {i + 1}. {n}" for i, n in enumerate(names)]
    lines += ["", format_arguments(self.problem, self.decisions, max_args), ""]
    costs = self.costs()
    lines.append(format_costs(costs))
    lines.append("\n" + compare_with_best_expert(self.agent, costs))
    return "\n".join(lines)

  @property
  def mesh_name(self) -> str:
    """The mesh as a spec, `data=2,model=4`."""
    return ",".join(f"{n}={s}" for n, s in zip(self.mesh.axis_names, self.mesh.axis_sizes))

  def main_arguments(self, count: int = 4) -> list[tuple[str, tuple[int, ...], PartitionSpec]]:
    """The `count` largest arguments (optimizer state left out: it follows its parameter)
    as (path, shape, spec)."""
    program = self.problem.program
    specs = self.problem.partition_specs(self.decisions, program.inputs)
    rows = [
      (program.values[v], s)
      for v, s in zip(program.inputs, specs)
      if not program.values[v].path.startswith("opt_state") and program.values[v].shape
    ]
    rows.sort(key=lambda r: -math.prod(r[0].shape) * r[0].itemsize)
    return [(v.path, tuple(v.shape), s) for v, s in rows[:count]]

  def diagram(self, count: int = 3, max_cells: int = 8) -> str:
    """A text picture of how the largest arguments are split (`plan_pictures.diagram`)."""
    from automap_rl import plan_pictures

    return plan_pictures.diagram(self, count, max_cells)

  def plot(self, path: str, count: int = 4) -> str:
    """Draws the largest arguments' shards (`plan_pictures.plot`); returns `path`."""
    from automap_rl import plan_pictures

    return plan_pictures.plot(self, path, count)


def _structural_keys(
  problem: Problem, members_of: Sequence[Sequence[int]]
) -> list[tuple[str, int]]:
  """(first example of the first class, occurrence) per group (or class): a name that
  survives changing a model's sizes and depth."""
  keys, seen = [], {}
  for members in members_of:
    examples = problem.named.classes[members[0]].examples
    name = examples[0] if examples else ""
    keys.append((name, seen.get(name, 0)))
    seen[name] = seen.get(name, 0) + 1
  return keys


def transfer_decisions(
  decisions: Sequence[Decision], source: Problem, target: Problem
) -> list[Decision]:
  """Maps a plan for `source` onto `target`, a smaller or larger copy of the same model
  (`gpt:layers=8,d_model=1024` -> `gpt:layers=2,d_model=128`): groups and named
  dimensions by their first example's name, argument dims by path. Decisions with no
  counterpart (an argument of a layer the copy lacks) are dropped.

  Raises:
    ValueError: `target` is not a copy of `source`: their argument paths differ other
      than in layer numbers.
  """
  shapes = [
    {re.sub(r"\d+", "#", p.program.values[v].path) for v in p.program.inputs}
    for p in (source, target)
  ]
  if shapes[0] != shapes[1]:
    missing, extra = sorted(shapes[0] - shapes[1]), sorted(shapes[1] - shapes[0])
    raise ValueError(
      f"the model to check is not a copy of the planned one: arguments missing {missing[:3]}"
      f"{'...' if len(missing) > 3 else ''}, extra {extra[:3]}{'...' if len(extra) > 3 else ''}"
    )
  group_key = _structural_keys(source, source.named.groups)
  group_at = {k: g for g, k in enumerate(_structural_keys(target, target.named.groups))}
  class_key = _structural_keys(source, [(c.id,) for c in source.named.classes])
  class_at = {
    k: c for c, k in enumerate(_structural_keys(target, [(c.id,) for c in target.named.classes]))
  }
  paths = {target.program.values[v].path for v in target.program.inputs}
  out = []
  for d in decisions:
    t = d.target
    if isinstance(t, Group):
      g = group_at.get(group_key[t.id])
      out += [] if g is None else [Decision(Group(g), d.axis)]
    elif isinstance(t, ArgDim):
      out += [d] if t.path in paths else []
    else:
      c = class_at.get(class_key[int(t)])
      out += [] if c is None else [Decision(c, d.axis)]
  return out
