"""`automap-rl bench search`: every agent against the best expert tactic on the zoo.

For every model and mesh: each agent's best simulated step time relative to the best
expert (`tactics.best_expert`: the fastest expert plan that fits; `expert_fits` false
where none does, and the ratio is then to a plan that cannot run), and the seconds and
simulations it took to come within 2% of it. Seconds are measured after a warm-up (the
environment built and its functions compiled, once per problem); `setup_seconds` of the
warm-up is reported beside them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tqdm import tqdm

import agents
from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from experiments.cli import write_json
from experiments.options import AgentName, Hardware, JsonPath

ZOO = (
  "mlp",
  "gpt:layers=4,d_model=1024",
  "gpt:layers=8,d_model=1024",
  "gpt:layers=12,d_model=1024",
  "moe",
  "gnn",
  "resnet",
  "unet",
)


@dataclasses.dataclass(frozen=True)
class SearchBenchConfig:
  """The search benchmark.

  Attributes:
    workloads: workload specs.
    meshes: mesh specs.
    agents: search agents.
    hardware: hardware profile.
    budget: simulations per search.
    seed: search seed.
    within: the tolerance of `*_to_2pct` (0.02: within 2% of the best expert).
    json: where to write the cases.
  """

  workloads: tuple[str, ...] = ZOO
  meshes: tuple[str, ...] = ("data=8", "data=2,model=4")
  agents: tuple[AgentName, ...] = ("random", "greedy", "mcts")
  hardware: Hardware = "h100"
  budget: int = 2000
  seed: int = 0
  within: float = 0.02
  json: JsonPath = None


def first_within(result: agents.SearchResult, target: float) -> tuple[float | None, int | None]:
  """Seconds (after setup) and simulations at which the trace first reaches `target`."""
  for point in result.trace:
    if point.step_time <= target:
      return max(point.seconds - result.setup_seconds, 0.0), point.simulations
  return None, None


def bench_case(
  problem: Problem,
  model: str,
  mesh: str,
  agent: str,
  budget: int,
  seed: int,
  within: float,
  expert: tactics.Expert,
) -> dict[str, Any]:
  """One agent on one problem (warmed up first), as a JSON case, against the problem's
  best expert (`tactics.best_expert_plan`)."""
  best_name, best = expert.name, float(expert.cost.step_time)
  agents.run_agent(
    agent, problem, seed=seed, budget=200
  )  # Warm-up: builds the env, compiles every call.
  result = agents.run_agent(agent, problem, seed=seed, budget=budget)
  seconds, simulations = first_within(result, best * (1 + within))
  return {
    "model": model,
    "mesh": mesh,
    "agent": agent,
    "ratio_to_best_expert": result.step_time / best,
    "seconds_to_2pct": seconds,
    "simulations_to_2pct": simulations,
    "step_time_s": result.step_time,
    "best_expert": best_name,
    "best_expert_step_time_s": best,
    "expert_fits": expert.fits,
    "simulations": result.simulations,
    "seconds": result.seconds - result.setup_seconds,
    "setup_seconds": result.setup_seconds,
    "fits": bool(result.cost.fits),
    "actions": result.actions,
  }


def bench_search(config: SearchBenchConfig = SearchBenchConfig()) -> list[dict[str, Any]]:
  """Runs every (model, mesh, agent) case; returns the JSON cases."""
  cases = []
  bar = tqdm(
    total=len(config.workloads) * len(config.meshes) * len(config.agents),
    desc="bench search",
    unit="case",
  )
  for model in config.workloads:
    program = workloads.make_workload(model, abstract=True).trace()
    for mesh in config.meshes:
      problem = Problem.build(program, make_mesh(mesh, config.hardware))
      expert = tactics.best_expert_plan(problem)
      for agent in config.agents:
        bar.set_postfix_str(f"{model} {mesh} {agent}")
        cases.append(
          bench_case(problem, model, mesh, agent, config.budget, config.seed, config.within, expert)
        )
        bar.update()
  bar.close()
  return cases


def format_cases(cases: list[dict[str, Any]]) -> str:
  """A table: one row per case."""
  lines = [
    f"{'model':<28} {'mesh':<15} {'agent':<7} {'ratio':>7} {'best expert':>14} {'s to 2%':>8} "
    f"{'sims to 2%':>10} {'sims':>6}"
  ]
  for c in cases:
    s = "-" if c["seconds_to_2pct"] is None else f"{c['seconds_to_2pct']:.2f}"
    n = "-" if c["simulations_to_2pct"] is None else str(c["simulations_to_2pct"])
    lines.append(
      f"{c['model']:<28} {c['mesh']:<15} {c['agent']:<7} {c['ratio_to_best_expert']:>7.4f} "
      f"{c['best_expert']:>14} {s:>8} {n:>10} {c['simulations']:>6}"
    )
  return "\n".join(lines)


def run(config: SearchBenchConfig) -> list[dict[str, Any]]:
  start = time.perf_counter()
  cases = bench_search(config)
  print(format_cases(cases))
  print(
    f"{len(cases)} cases in {time.perf_counter() - start:.1f}s (budget {config.budget} "
    "simulations, "
    f"seed {config.seed})"
  )
  write_json(config.json, cases)
  return cases
