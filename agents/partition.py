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

from collections.abc import Callable, Sequence
from typing import Any

from agents.registry import run_agent
from automap_rl import ir, tactics
from automap_rl.mesh import Mesh, make_mesh
from automap_rl.plan import Plan
from automap_rl.problem import Problem

def partition(fn: Callable[..., Any], *args: Any, mesh: str | Mesh = "data=2,model=4", hardware: str = "h100",
              agent: str = "mcts", budget: Any = 2000, seed: int = 0, arg_names: Sequence[str] | None = None,
              arg_roles: Sequence[str] | None = None, config: Any = None,
              progress: Callable[[int, float], None] | None = None,
              phase: Callable[[str], None] | None = None) -> Plan:
  """Finds a sharding plan for `fn(*args)` on `mesh` by search.

  Args:
    fn: the function, typically a whole training step.
    *args: example arguments: arrays or `jax.ShapeDtypeStruct`s (nothing is run while
      searching; `Plan.check_numerics` needs arrays).
    mesh: a mesh spec (`data=2,model=4`) or an `automap_rl.mesh.Mesh`.
    hardware: the hardware profile of a mesh spec (`h100`, `a100`, ...).
    agent: `mcts`, `greedy`, `random`, `gumbel`, `learned` (the shipped trained network guiding
      Gumbel MuZero; `config=LearnedConfig(checkpoint=...)` for another), or an expert
      tactic name (`data_megatron`, ...).
    budget: simulator evaluations (int), seconds (float) or an `agents.Budget`.
    seed: the search seed; the same seed and a simulations budget give the same plan.
    arg_names, arg_roles: a name and a role (`parameter`, `optimizer_state`, `input`)
      per positional argument, for paths in reports and for the expert tactics
      (data parallel shards `input` arguments, Megatron and FSDP `parameter`s).
    config: the agent's config dataclass (default: its defaults).
    progress: called as `progress(simulations, best_step_time_s)` during the search.
    phase: called with each phase's name as it starts: `tracing`, `building cost tables`,
      then `searching` (or `applying the tactic`); for a progress display of the parts
      before the search's own progress.

  Returns:
    The plan.
  """
  started = phase or (lambda name: None)
  started("tracing")
  program = ir.trace(fn, *args, arg_names=arg_names, arg_roles=arg_roles)
  the_mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh, hardware)
  started("building cost tables")
  problem = Problem.build(program, the_mesh)
  if agent in tactics.TACTICS:
    started("applying the tactic")
    return Plan(fn, tuple(args), problem, tactics.TACTICS[agent](problem), agent=agent)
  started("searching")
  result = run_agent(agent, problem, seed=seed, budget=budget, config=config, progress=progress)
  return Plan(fn, tuple(args), problem, result.decisions, agent=agent, search=result)
