"""`partition(fn, *args, mesh=..., agent=...) -> Plan`: the one-call facade.

It lives in `agents` because it runs a search agent; the `Plan` it returns is core
(`automap_rl.plan`), so lowering, reports and costs need nothing from this layer.

```python
from agents import partition

plan = partition(step, params, opt_state, batch, mesh="data=2,model=4", hardware="h100",
                 agent="mcts", budget=2000, seed=0,
                 arg_names=("params", "opt_state", "batch"),
                 arg_roles=("parameter", "optimizer_state", "input"))
```
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from agents.base import Budget, SearchResult, TracePoint, plan_objective
from agents.registry import run_agent
from automap_rl import ir, tactics
from automap_rl.mesh import Hardware, as_mesh
from automap_rl.plan import Plan, shardable
from automap_rl.problem import Problem


def partition(
  fn: Callable[..., Any],
  *args: Any,
  mesh: Any = "data=2,model=4",
  hardware: str | Hardware | None = None,
  agent: str = "mcts",
  budget: Budget | int | str = 2000,
  seed: int = 0,
  arg_names: Sequence[str] | None = None,
  arg_roles: Sequence[str] | None = None,
  config: Any = None,
  progress: Callable[[int, float], None] | None = None,
  phase: Callable[[str], None] | None = None,
  loss_fn: Callable[..., Any] | None = None,
  optimizer: Any = None,
  since: float | None = None,
) -> Plan:
  """Finds a sharding plan for `fn(*args)` on `mesh` by search (or writes an expert's).

  Args:
    fn: the function, typically a whole training step.
    *args: example arguments: arrays or `jax.ShapeDtypeStruct`s (nothing is run while
      searching; `Plan.check` needs arrays).
    mesh: a mesh spec (`data=2,model=4`), an `automap_rl.mesh.Mesh`, or a
      `jax.sharding.Mesh` (the plan then runs on its devices).
    hardware: the hardware profile to price the mesh with (`h100`, `a100-80g`, ...);
      default a `Mesh`'s own, else h100.
    agent: `mcts`, `greedy`, `random`, `gumbel`, `ilp`, `learned` (the shipped trained network
      guiding Gumbel MuZero; `config=LearnedConfig(checkpoint=...)` for another), `alpa`
      (pipeline stages with expert plans inside; its plan carries the pipeline), or an
      expert tactic name (`data_megatron`, `fsdp_megatron`, ...; `megatron_3d`,
      `fsdp_megatron_3d` and `pipeline` pipeline the layer stack).
    budget: with its unit: `Simulations(2000)`, `Seconds(30)`, an int (simulations) or a
      string (`"2000"`, `"30s"`); a float is refused as ambiguous. Seconds bound the whole
      call: the agent gets what tracing and building the cost tables left of them
      (`Budget.after`); where they (or the agent's own set-up) left nothing, the result
      is the best expert plan, unsearched, with a warning, and its search's `stopped_by`
      is `seconds`.
    seed: the search seed; the same seed and a simulations budget give the same plan.
    arg_names: a name per positional argument, the first element of its paths.
    arg_roles: a role (`parameter`, `optimizer_state`, `state`, `input`) per positional
      argument. Default: read from the step (`automap_rl.ir.infer_roles`: an argument the
      step returns updated is state; optimizer state mirrors the parameters), with a
      warning naming the arguments where that is in doubt. Roles steer the expert
      tactics (data parallel shards `input`s, Megatron and FSDP `parameter`s), and the
      arguments the step updates are donated.
    config: the agent's config dataclass (default: its defaults).
    progress: called as `progress(simulations, best_step_time_s)` during the search.
    phase: called with each phase's name as it starts: `tracing`, `building cost tables`,
      then `searching` (or `applying the tactic`); for a progress display of the parts
      before the search's own progress.
    loss_fn, optimizer: the loss function and optax optimizer `fn` is built from (a
      `Workload` has them): a pipelined plan needs them to run (`Plan.jit`); a bare step's
      pipeline is priced only.
    since: the `time.monotonic()` a seconds budget counts from (default: the start of
      this call); a caller that builds `fn` and its arguments first passes its own start.

  Returns:
    The plan.

  Raises:
    ValueError: an unknown agent, a bad budget or mesh, or a program of which no dimension
      divides by any mesh axis (nothing to shard).
  """
  start = time.monotonic() if since is None else since
  expert = {**tactics.TACTICS, **tactics.PIPELINE_TACTICS}.get(agent)
  if expert is None:
    budget = Budget.of(budget)  # A bad budget fails before tracing.
  started = phase or (lambda name: None)
  the_mesh, devices = as_mesh(mesh, hardware)
  started("tracing")
  program = ir.trace_step(fn, *args, arg_names=arg_names, arg_roles=arg_roles)
  started("building cost tables")
  problem = Problem.build(program, the_mesh)
  if not shardable(problem):
    spec = ",".join(f"{name}={size}" for name, size in the_mesh.shape.items())
    sizes = ", ".join(map(str, the_mesh.axis_sizes))
    raise ValueError(
      f"mesh {spec}: no dimension of the program divides by any axis size ({sizes}), "
      "so nothing can be sharded"
    )
  if expert is not None:
    started("applying the tactic")
    decisions, pipeline = (
      expert(problem) if agent in tactics.PIPELINE_TACTICS else (expert(problem), None)
    )
    return Plan(
      fn,
      tuple(args),
      problem,
      decisions,
      agent=agent,
      devices=devices,
      pipeline=pipeline,
      loss_fn=loss_fn,
      optimizer=optimizer,
    )
  started("searching")
  spent = time.monotonic() - start
  left = budget.after(spent)
  result = (
    _unsearched(problem, agent, budget, spent)
    if left is None
    else run_agent(agent, problem, seed=seed, budget=left, config=config, progress=progress)
  )
  if (
    _evaluated_nothing(result) and budget.seconds is not None
  ):  # The agent's own set-up took the rest.
    result = _unsearched(problem, agent, budget, time.monotonic() - start)
  return Plan(
    fn,
    tuple(args),
    problem,
    result.decisions,
    agent=agent,
    search=result,
    devices=devices,
    pipeline=result.pipeline,
    loss_fn=loss_fn,
    optimizer=optimizer,
  )


def _evaluated_nothing(result: SearchResult) -> bool:
  """The agent returned the replicated plan without pricing a single plan: its time ran
  out before its first simulation."""
  return (
    result.simulations == 0
    and result.greedy_steps == 0
    and not result.decisions
    and result.pipeline is None
  )


def _unsearched(problem: Problem, agent: str, budget: Budget, spent: float) -> SearchResult:
  """The best expert plan as the search result of an agent whose seconds went to the work
  before its first simulation (`spent` of `budget.seconds`), with a warning naming the limit."""
  start = time.monotonic()
  expert = tactics.best_expert_plan(problem)
  warnings.warn(
    f"partition: tracing and building the cost tables took {spent:.1f} s, the whole time budget of "
    f"{budget.seconds:g} s; returning the best expert plan ({expert.name}) without running {agent} "
    "(stopped by its time budget).",
    stacklevel=3,
  )
  objective = plan_objective(problem, expert.cost)
  simulations = len(tactics.applicable(problem))
  seconds = time.monotonic() - start
  return SearchResult(
    decisions=list(expert.decisions),
    cost=expert.cost,
    trace=[TracePoint(simulations, seconds, float(expert.cost.step_time), objective)],
    simulations=simulations,
    seconds=seconds,
    actions=[str(d) for d in expert.decisions],
    objective=objective,
    setup_seconds=seconds,
    stopped_by="seconds",
  )
