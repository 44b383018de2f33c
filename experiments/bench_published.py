"""`automap-rl bench published`: published training runs against the simulator.

Per row of `automap_rl.workloads.published` (a paper's model, hardware, plan, batch and
measured figure): the simulated step time of the published plan, the figure it gives under
the paper's own definition (TFLOP/s per device with the paper's flop formula, or MFU), the
ratio simulated / published, and the simulated peak memory per device beside the device's
memory. The step's split (compute, communication, pipeline bubble) says where the simulated
time goes.

With `--search`, search agents (`mcts` with pipeline options, `alpa`, which plans
pipelines, and the `learned` policy) plan the same model on the same mesh and batch; each
plan is shown beside the published one: whether it fits, its step time over the published
plan's, and where it is slower or does not fit, why.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tqdm import tqdm

import agents
from agents import MCTSConfig
from agents.base import release
from automap_rl.workloads import published
from experiments.cli import write_json
from experiments.options import AgentName, JsonPath, PlotPath


@dataclasses.dataclass(frozen=True)
class PublishedBenchConfig:
  """Published runs priced by the simulator.

  Attributes:
    rows: row names (comma-separated or repeated; default: every row).
    search: also plan each row with the search agents, from the same mesh and batch.
    agents: the search agents of `--search`.
    budget: simulations per search.
    pipeline_options: `mcts`'s pipeline options in its environment (`EnvConfig.pipelines`).
    seed: search seed.
    json: where to write every row's figures.
    plot: where to draw simulated against published figures.
  """

  rows: tuple[str, ...] = ()
  search: bool = False
  agents: tuple[AgentName, ...] = ("mcts", "alpa", "learned")
  budget: int = 500
  pipeline_options: int = 6
  seed: int = 0
  json: JsonPath = None
  plot: PlotPath = None


def _split(cost: Any) -> dict[str, float]:
  """Seconds of a cost's step, its compute and communication (summed over the step, so
  they may overlap) and its pipeline bubble (0 without stages)."""
  terms = getattr(cost, "terms", None)
  return {
    "step_time_s": float(cost.step_time),
    "compute_s": float(cost.compute_time),
    "comm_s": float(cost.comm_time),
    "bubble_s": float(terms.bubble_s) if terms is not None else 0.0,
    "peak_memory_gb": float(cost.peak_memory) / 1e9,
    "fits": bool(cost.fits),
  }


def why(plan: dict[str, Any], base: dict[str, Any], hbm_gb: float) -> str:
  """Why a searched plan is not the published plan's equal: it does not fit (an agent's
  best plan: so it found none that fits), or the term
  of its step (compute, communication, bubble) that grew most is what makes it slower."""
  if not plan["fits"]:
    return f"no plan found that fits: {plan['peak_memory_gb']:.0f} GB > {hbm_gb:.0f} GB"
  if plan["step_time_s"] <= base["step_time_s"]:
    return "fits, as fast or faster"
  growth = {
    "compute": plan["compute_s"] - base["compute_s"],
    "communication": plan["comm_s"] - base["comm_s"],
    "bubble": plan["bubble_s"] - base["bubble_s"],
  }
  return f"slower: {max(growth, key=growth.get)}"


def _search(
  problem: Any, config: PublishedBenchConfig, base: dict[str, Any], hbm_gb: float
) -> dict[str, Any]:
  """Each agent's plan on the row's problem, beside the published plan."""
  out = {}
  for agent in config.agents:
    agent_config = MCTSConfig(pipelines=config.pipeline_options) if agent == "mcts" else None
    start = time.perf_counter()
    result = agents.run_agent(
      agent, problem, seed=config.seed, budget=config.budget, config=agent_config
    )
    pipeline = getattr(result, "pipeline", None)
    plan = _split(problem.plan_cost(result.decisions, pipeline))
    plan["over_published"] = plan["step_time_s"] / base["step_time_s"]
    plan["why"] = why(plan, base, hbm_gb)
    plan["pipeline"] = str(pipeline) if pipeline is not None else None
    plan["seconds"] = time.perf_counter() - start
    out[f"{agent}@{config.budget}"] = plan
    release()
  return out


def bench_row(run: published.PublishedRun, config: PublishedBenchConfig) -> dict[str, Any]:
  """One row's published and simulated figures (and searched plans, with `--search`)."""
  start = time.perf_counter()
  problem, decisions, pipeline = published.build(run)
  base = _split(problem.plan_cost(decisions, pipeline))
  simulated = run.figure_of(run.simulated_flops(), base["step_time_s"])
  hbm_gb = problem.mesh.hardware.hbm_bytes / 1e9
  row = {
    "row": run.name,
    "citation": str(run.citation),
    "short_citation": run.citation.short,
    "hardware": run.hardware,
    "devices": run.devices,
    "model": run.model,
    "params_b": run.shape.params() / 1e9,
    "mesh": run.mesh,
    "plan": run.plan.describe(),
    "pipeline": str(pipeline) if pipeline is not None else None,
    "kind": run.kind,
    "formula": run.formula,
    "published": run.figure,
    "simulated": simulated,
    "ratio": simulated / run.figure,
    "hbm_gb": hbm_gb,
    **base,
    "notes": list(run.notes),
  }
  if config.search:
    row["searched"] = _search(problem, config, base, hbm_gb)
  row["seconds"] = time.perf_counter() - start
  return row


def format_rows(rows: list[dict[str, Any]]) -> str:
  """The table: one line per row, and with `--search` one line per searched plan."""
  fmt = lambda r, v: f"{v:.1f} TF/s" if r["kind"] == "tflops" else f"{100 * v:.1f}% MFU"
  lines = [
    f"{'row':<17} {'citation':<19} {'hardware':<8} {'devices':>7} {'model':<10} "
    f"{'plan':<50} {'published':>11} {'simulated':>11} {'ratio':>6} {'peak/HBM GB':>12} "
    f"{'fits':>4} {'comp%':>5} {'comm%':>5} {'bubl%':>5}"
  ]
  for r in rows:
    share = lambda key: f"{100 * r[key] / r['step_time_s']:.0f}"
    params = f"{r['params_b']:.3g}" if r["params_b"] < 1000 else f"{r['params_b']:.0f}"
    model = f"{r['model'].split(':')[0]} {params}B"
    lines.append(
      f"{r['row']:<17} {r['short_citation']:<19} {r['hardware']:<8} {r['devices']:>7} "
      f"{model:<10} {r['plan']:<50} {fmt(r, r['published']):>11} {fmt(r, r['simulated']):>11} "
      f"{r['ratio']:>6.2f} {r['peak_memory_gb']:>6.1f}/{r['hbm_gb']:<5.0f} "
      f"{'yes' if r['fits'] else 'no':>4} {share('compute_s'):>5} {share('comm_s'):>5} "
      f"{share('bubble_s'):>5}"
    )
    for name, plan in r.get("searched", {}).items():
      lines.append(
        f"  {name:<15} fits {'yes' if plan['fits'] else 'no':<3} step "
        f"x{plan['over_published']:.2f} "
        f"of the published plan's: {plan['why']}"
        + f"; {plan['pipeline'] or 'no pipeline (an intra-op plan on the whole batch)'}"
      )
  return "\n".join(lines)


LEGEND = (
  "ratio: simulated / published figure (same definition: the paper's flop formula over the "
  "simulated step time); peak: simulated bytes per device at the peak; comp%, comm%, bubl%: "
  "compute, communication the compute does not hide, and pipeline bubble as shares of the "
  "simulated step"
)


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Simulated over published figure per row (log scale), filled where the plan fits, with
  the band within 15% of the published figure shaded."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows)), 4.5))
  xs = range(len(rows))
  colors = ["tab:blue" if r["fits"] else "white" for r in rows]
  ax.bar(xs, [r["ratio"] for r in rows], color=colors, edgecolor="tab:blue")
  ax.axhline(1.0, color="gray", linewidth=0.8)
  ax.axhspan(0.85, 1.15, color="tab:green", alpha=0.12, label="within 15%")
  ax.legend(fontsize=7, loc="lower left")
  ax.set_yscale("log")
  ax.set_xticks(list(xs), [r["row"] for r in rows], rotation=45, ha="right", fontsize=7)
  ax.set_ylabel("simulated / published figure")
  ax.set_title("Published runs (filled: the published plan fits in simulation)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(config: PublishedBenchConfig) -> list[dict[str, Any]]:
  names = [n.strip() for item in config.rows for n in item.split(",") if n.strip()]
  runs = published.get(names)
  unknown = sorted(set(config.agents) - set(agents.AGENTS))
  if unknown:
    raise ValueError(f"unknown agent(s) {unknown}; valid: {', '.join(agents.AGENTS)}")
  rows: list[dict[str, Any]] = []
  for published_run in tqdm(runs, desc="bench published", unit="row"):
    rows.append(bench_row(published_run, config))
    write_json(config.json, rows)  # The rows so far.
  print(format_rows(rows))
  print(LEGEND)
  if config.plot:
    plot(rows, config.plot)
  return rows
