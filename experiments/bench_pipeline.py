"""`automap-rl bench pipeline`: pipeline stages against intra-op plans on multi-node cases.

Per case (task-suite cases whose meshes span nodes), the simulated step time of:

- the best intra-op-only plan: the case's best-known plan (`best_known.json`, re-costed),
  or the best of the agents below where one beats it;
- the best expert (`tactics.best_expert`, intra-op);
- each pipelined expert (`tactics.applicable_pipelines`: `megatron_3d`, `fsdp_megatron_3d`,
  `pipeline`), and each agent of `--agents` (`mcts`, `learned`, `alpa`, which plans
  pipelines), and UCT with pipeline actions in its environment (`mcts+stages`);
- each fitting intra-op plan inside `megatron_3d`'s stages (`X + stages`: its decisions on
  the stage axis dropped, as many microbatches as its batch sharding allows);
- the best pipelined plan among them, its ratio to the best intra-op plan, and why it wins
  or loses: its bubble's share of its step time and its stages' balance (mean over slowest
  microbatch time) against the share of the intra-op plan's step time spent in
  collectives (what stages on the slow axis save).

Each agent's plan records its search's wall seconds (environment build included), and every
plan its hardware flops utilization (the program's flops, recomputed ones included, per
device per second over the profile's bf16 peak), to compare with what Megatron-LM reports
for its GPT runs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from tqdm import tqdm

import agents
from agents import MCTSConfig
from agents.base import release
from automap_rl import tactics
from automap_rl.pipeline import Pipeline
from automap_rl.plan import plan_from_json
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.simulator.tables import program_flops
from automap_rl.workloads import load_cases
from experiments.cli import write_json
from experiments.options import JsonPath, PlotPath
from experiments.suite_cmd import load_best_known

MULTI_NODE_CASES = (
  "gpt-39b-4x2x8-h100-remat",
  "llama-70b-2x4x8-h100-remat",
  "moe-70b-4x2x8-h100",
  "vit-22b-2x4x8-h100-remat",
  "t5-xxl-8x8-h100",
  "t5-xxl-4x2x8-a100-80g-remat",
  "gpt-175b-8x2x8-h100-remat",
  "gpt-175b-16x8x8-h100-remat",
  "llama-70b-8x8x8-a100-80g-remat",
  "t5-xxl-16x8x8-tpu-v4-remat",
  "ssm-2.8b-8x4x8-a100-80g",
)


@dataclasses.dataclass(frozen=True)
class PipelineBenchConfig:
  """Pipelined plans against intra-op ones.

  Attributes:
    cases: task-suite case names (default: the multi-node cases, GPT-175B on 128 H100s
      and, at GPT-3's batch of 1,536 x 2,048, on 1,024 among them).
    agents: search agents run on each case at `budget` (their plans are intra-op unless
      the agent plans pipelines).
    budget: simulations per search.
    pipeline_options: with `mcts` among the agents, also UCT with this many pipeline
      options in its environment (`EnvConfig.pipelines`; 0: none), as `mcts+stages`.
    seed: search seed.
    json: where to write every case's figures.
    plot: where to draw the ratios.
  """

  cases: tuple[str, ...] = MULTI_NODE_CASES
  agents: tuple[str, ...] = ("mcts", "learned", "alpa")
  budget: int = 2000
  pipeline_options: int = 6
  seed: int = 0
  json: JsonPath = None
  plot: PlotPath = None


def _figures(cost: Any, flops_per_device: float, peak: float) -> dict[str, Any]:
  step = float(cost.step_time)
  out = {
    "step_time_s": step,
    "peak_memory_gib": float(cost.peak_memory) / 2**30,
    "fits": bool(cost.fits),
    "comm_share": float(cost.comm_time) / step,
    "utilization": flops_per_device / step / peak,
  }
  terms = getattr(cost, "terms", None)
  if terms is not None:
    stage = np.asarray(terms.microbatch_compute_s) + np.asarray(terms.microbatch_comm_s)
    out["bubble_share"] = float(terms.bubble_s) / step
    out["stage_balance"] = float(stage.mean() / stage.max())
  return out


def _with_stages(
  problem: Problem, decisions: list[Decision], pipeline: Pipeline
) -> tuple[list[Decision], Pipeline] | None:
  """An intra-op plan inside the stages of `pipeline` (`megatron_3d`'s): its decisions on
  the stage axis dropped, with the most microbatches, halving from the pipeline's, whose
  size the plan's batch sharding divides; None when none does."""
  inside = [d for d in decisions if d.axis != pipeline.axis]
  microbatches = pipeline.microbatches
  while microbatches >= 1:
    candidate = dataclasses.replace(pipeline, microbatches=microbatches)
    try:
      problem.plan_cost(inside, candidate)
      return inside, candidate
    except ValueError:
      microbatches //= 2
  return None


def bench_case(
  name: str, config: PipelineBenchConfig, stored: dict[str, Any] | None
) -> dict[str, Any]:
  """Every plan of one case, as JSON figures."""
  start = time.perf_counter()
  case = {c.name: c for split in ("train", "test") for c in load_cases(split)}[name]
  problem = Problem.build(case.make_workload().trace(), case.make_mesh())
  program = problem.program
  flops = float(sum(f * op.repeat for f, op in zip(program_flops(program), program.ops)))
  per_device, peak = flops / problem.mesh.num_devices, problem.mesh.hardware.flops["bfloat16"]
  expert = tactics.best_expert_plan(problem)
  plans: dict[str, dict[str, Any]] = {
    f"best expert ({expert.name})": _figures(expert.cost, per_device, peak)
  }
  intra_op = {
    f"best expert ({expert.name})": list(expert.decisions)
  }  # Decisions of the intra-op plans.
  if stored is not None:
    decisions, pipeline = plan_from_json(stored)
    plans["best-known"] = {
      **_figures(problem.plan_cost(decisions, pipeline), per_device, peak),
      "pipelined": pipeline is not None,
    }
    if pipeline is None:
      intra_op["best-known"] = decisions
  for tactic, (decisions, pipeline) in tactics.applicable_pipelines(problem).items():
    plans[tactic] = {
      **_figures(problem.plan_cost(decisions, pipeline), per_device, peak),
      "pipelined": True,
      "pipeline": str(pipeline),
    }
  runs = [(agent, agent, None) for agent in config.agents]
  if "mcts" in config.agents and config.pipeline_options:
    runs.append(("mcts+stages", "mcts", MCTSConfig(pipelines=config.pipeline_options)))
  for label, agent, agent_config in runs:
    result = agents.run_agent(
      agent, problem, seed=config.seed, budget=config.budget, config=agent_config
    )
    pipeline = getattr(result, "pipeline", None)
    if pipeline is None:
      intra_op[f"{label}@{config.budget}"] = list(result.decisions)
    plans[f"{label}@{config.budget}"] = {
      **_figures(problem.plan_cost(result.decisions, pipeline), per_device, peak),
      "pipelined": pipeline is not None,
      "seconds": result.seconds,
      **({"pipeline": str(pipeline)} if pipeline is not None else {}),
    }
  stages = tactics.applicable_pipelines(problem).get("megatron_3d")
  if stages is not None:
    for source in [n for n, p in plans.items() if not p.get("pipelined", False) and p["fits"]]:
      staged = _with_stages(problem, intra_op[source], stages[1])
      if staged is not None:
        plans[f"{source} + stages"] = {
          **_figures(problem.plan_cost(*staged), per_device, peak),
          "pipelined": True,
          "pipeline": str(staged[1]),
        }
  fitting = lambda pipelined: {
    n: p for n, p in plans.items() if p.get("pipelined", False) == pipelined and p["fits"]
  }
  intra, piped = fitting(False), fitting(True)
  best_intra = min(intra, key=lambda n: intra[n]["step_time_s"]) if intra else None
  best_piped = min(piped, key=lambda n: piped[n]["step_time_s"]) if piped else None
  ratio = (
    piped[best_piped]["step_time_s"] / intra[best_intra]["step_time_s"]
    if best_intra and best_piped
    else None
  )
  return {
    "case": name,
    "mesh": case.mesh,
    "hardware": case.hardware,
    "devices": problem.mesh.num_devices,
    "plans": plans,
    "best_intra_op": best_intra,
    "best_pipelined": best_piped,
    "pipelined_over_intra_op": ratio,
    "seconds": time.perf_counter() - start,
  }


def format_rows(rows: list[dict[str, Any]]) -> str:
  """One line per case: the best intra-op and pipelined plans, their ratio and why."""
  lines = [
    f"{'case':<30} {'best intra-op':<32} {'ms':>9} {'comm%':>6}  {'best pipelined':<40} {'ms':>9} "
    f"{'bubble%':>7} {'balance':>7} {'ratio':>6}"
  ]
  for r in rows:
    intra = r["plans"].get(r["best_intra_op"] or "", {})
    piped = r["plans"].get(r["best_pipelined"] or "", {})
    cell = lambda p, key, scale: f"{p[key] * scale:.1f}" if key in p else "-"
    ratio = "-" if r["pipelined_over_intra_op"] is None else f"{r['pipelined_over_intra_op']:.3f}"
    lines.append(
      f"{r['case']:<30} {str(r['best_intra_op']):<32} {cell(intra, 'step_time_s', 1e3):>9} "
      f"{cell(intra, 'comm_share', 100):>6}  {str(r['best_pipelined']):<40} "
      f"{cell(piped, 'step_time_s', 1e3):>9} {cell(piped, 'bubble_share', 100):>7} "
      f"{cell(piped, 'stage_balance', 1):>7} {ratio:>6}"
    )
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Each plan's step time over the case's best intra-op plan, per case (log scale)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.5))
  names = list(
    dict.fromkeys(n for r in rows for n in r["plans"] if not n.startswith("best expert"))
  )
  for j, name in enumerate(names):
    xs, ys = [], []
    for i, r in enumerate(rows):
      base = r["plans"].get(r["best_intra_op"] or "")
      if name in r["plans"] and base:
        xs.append(i + 0.08 * (j - len(names) / 2))
        ys.append(r["plans"][name]["step_time_s"] / base["step_time_s"])
    ax.scatter(xs, ys, label=name, s=18, marker="s" if name in tactics.PIPELINE_TACTICS else "o")
  ax.axhline(1.0, color="gray", linewidth=0.8)
  ax.axhline(0.9, color="gray", linewidth=0.8, linestyle="--")
  ax.set_yscale("log")
  ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=30, ha="right", fontsize=7)
  ax.set_ylabel("simulated step time / best intra-op plan")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(config: PipelineBenchConfig) -> list[dict[str, Any]]:
  unknown = sorted(set(config.agents) - set(agents.AGENTS))
  if unknown:
    raise ValueError(f"unknown agent(s) {unknown}; valid: {', '.join(agents.AGENTS)}")
  cases = {c.name for split in ("train", "test") for c in load_cases(split)}
  missing = [c for c in config.cases if c not in cases]
  if missing:
    raise ValueError(f"unknown case(s) {missing}; `automap-rl suite list` lists them")
  stored = load_best_known(None)["cases"]
  rows: list[dict[str, Any]] = []
  for name in tqdm(config.cases, desc="bench pipeline", unit="case"):
    rows.append(bench_case(name, config, stored.get(name)))
    write_json(config.json, rows)  # The cases so far.
    release()
  print(format_rows(rows))
  print(
    "ratio: best pipelined plan / best intra-op plan (both fitting); comm%: the intra-op plan's "
    "share of "
    "step time in collectives; bubble%: the pipelined plan's share in its bubble; balance: its "
    "stages' mean "
    "microbatch time over the slowest's"
  )
  if config.plot:
    plot(rows, config.plot)
  return rows
