"""`automap-rl suite list` and `automap-rl bench suite`: the task suite and how hard it is.

`bench suite` scores, per case, the replicated plan, every applicable expert tactic, each
search agent at a fixed budget and the case's best-known plan, all as ratios of simulated
step time to the best expert (`automap_rl.tactics.best_expert`: the fastest expert plan
that fits in memory). Where no expert fits, the row says so and its ratios are to the best
plan that fits (the best-known), never to a plan that cannot run. Best-known plans are reference
data (`best_known.json` beside
`suite.json`, with the command that made them); they are stored as decision lists and
re-costed on every run, so a changed simulator re-scores them instead of trusting old
figures, and a run that finds a better plan can write it back (`--update-best-known`).

The summary gives the suite's difficulty figures: the share of cases where replication
and data parallelism do not fit, where the best-known plan beats random search by 10% or
more, and where it beats the best expert by 5% or more (or fits where no expert does).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import time
from typing import Any, Literal

from tqdm import tqdm

import agents
from agents.base import release
from automap_rl import tactics
from automap_rl.plan import plan_from_json, plan_to_json
from automap_rl.problem import Problem
from automap_rl.workloads import SPLITS, Case, load_cases
from experiments.cli import write_json
from experiments.options import AgentName, JsonPath, PlotPath

Split = Literal[SPLITS]  # type: ignore[valid-type]
BEST_KNOWN = "best_known.json"


@dataclasses.dataclass(frozen=True)
class SuiteListConfig:
  """The suite's cases as a table.

  Attributes:
    split: only this split (default: every split).
    json: write the cases as JSON here.
  """

  split: Split | None = None
  json: JsonPath = None


@dataclasses.dataclass(frozen=True)
class SuiteBenchConfig:
  """The suite benchmark.

  Attributes:
    split: the cases to score.
    families: only the split's cases of these families (empty: all of them).
    cases: only the split's cases of these names (empty: all of them).
    agents: search agents, each run for `budget` simulations.
    budget: simulations per search.
    seed: search seed.
    best_known: the best-known plans' file (default: the suite's reference data).
    update_best_known: write plans that beat the stored best-known back to that file,
      with this run's command.
    json: write every case's figures here.
    plot: draw the ratios here.
  """

  split: Split = "smoke"
  families: tuple[str, ...] = ()
  cases: tuple[str, ...] = ()
  agents: tuple[AgentName, ...] = ("random", "mcts")
  budget: int = 2000
  seed: int = 0
  best_known: str | None = None
  update_best_known: bool = False
  json: JsonPath = None
  plot: PlotPath = None


def format_case_table(cases: list[Case]) -> str:
  """One row per case: name, split, family, size, mesh, devices, hardware."""
  header = ("case", "split", "family", "size", "mesh", "devices", "hardware")
  rows = [
    (c.name, c.split, c.family, c.size, c.mesh, str(c.make_mesh().num_devices), c.hardware)
    for c in cases
  ]
  widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
  return "\n".join(
    "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)
  )


def run_list(config: SuiteListConfig) -> list[Case]:
  cases = load_cases(config.split)
  print(format_case_table(cases))
  counts = {s: sum(c.split == s for c in cases) for s in SPLITS}
  print(
    f"{len(cases)} cases ({', '.join(f'{s} {n}' for s, n in counts.items() if n)}), "
    f"{len({c.family for c in cases})} families"
  )
  write_json(config.json, [dataclasses.asdict(c) for c in cases])
  return cases


def best_known_path(path: str | None) -> str:
  return path or str(importlib.resources.files("automap_rl.workloads").joinpath(BEST_KNOWN))


def load_best_known(path: str | None, missing_ok: bool = False) -> dict[str, Any]:
  """`{"cases": {case name: {"decisions": [...], "source": ..., "command": ...}}}` (and
  `"pipeline": {...}` for a plan with pipeline stages, `plan.plan_to_json`); the
  suite's own file may be missing (no case has a best-known plan yet), a given one not
  unless `missing_ok`."""
  try:
    with open(best_known_path(path)) as f:
      return json.load(f)
  except FileNotFoundError:
    if path is not None and not missing_ok:
      raise ValueError(f"--best-known {path}: no such file") from None
    return {"cases": {}}


def _score(cost) -> dict[str, Any]:
  return {
    "step_time_s": float(cost.step_time),
    "peak_memory_gib": float(cost.peak_memory) / 2**30,
    "fits": bool(cost.fits),
  }


def bench_case(
  case: Case, config: SuiteBenchConfig, stored: dict[str, Any] | None
) -> dict[str, Any]:
  """Every expert, every agent and the best-known plan on one case."""
  start = time.perf_counter()
  problem = Problem.build(case.make_workload().trace(), case.make_mesh())
  expert_costs = tactics.applicable_costs(problem)
  plans = {name: plan for name, (plan, _) in expert_costs.items()}
  experts = {name: _score(cost) for name, (_, cost) in expert_costs.items()}
  best_name = tactics.best_expert(
    {n: tactics.Score.of(cost) for n, (_, cost) in expert_costs.items()}
  )
  expert_fits = experts[best_name]["fits"]
  searched = {}
  # A plan's pipeline stages, where it has some: its cost and its stored form need them.
  pipelines = {}
  for agent in config.agents:
    result = agents.run_agent(agent, problem, seed=config.seed, budget=config.budget)
    searched[agent] = _score(result.cost)
    plans[agent], pipelines[agent] = result.decisions, result.pipeline
  candidates = {}  # The stored plan first: a tie keeps it (no rewrite of an equal plan).
  if stored is not None:
    plans["stored"], pipelines["stored"] = plan_from_json(stored)
    candidates["stored"] = _score(problem.plan_cost(plans["stored"], pipelines["stored"]))
  candidates.update({**experts, **searched})
  fitting = {n: c for n, c in candidates.items() if c["fits"]} or candidates
  source = min(fitting, key=lambda n: fitting[n]["step_time_s"])
  best_known = fitting[source]
  # The yardstick: the best expert; where no expert fits, the best plan that does.
  yardstick = best_name if expert_fits or not best_known["fits"] else source
  yardstick_time = candidates[yardstick]["step_time_s"]
  ratio = lambda score: score["step_time_s"] / yardstick_time
  return {
    "case": case.name,
    "split": case.split,
    "family": case.family,
    "workload": case.workload,
    "mesh": case.mesh,
    "hardware": case.hardware,
    "best_expert": best_name,
    "best_expert_step_time_s": experts[best_name]["step_time_s"],
    "expert_fits": expert_fits,
    "yardstick": yardstick,
    "yardstick_step_time_s": yardstick_time,
    "experts": {n: {**c, "ratio": ratio(c)} for n, c in experts.items()},
    "agents": {n: {**c, "ratio": ratio(c)} for n, c in searched.items()},
    "best_known": {
      **best_known,
      "ratio": ratio(best_known),
      "source": source,
      **plan_to_json(plans[source], pipelines.get(source)),
    },
    "seconds": time.perf_counter() - start,
  }


def summarize(rows: list[dict[str, Any]], agent: str = "random") -> dict[str, Any]:
  """The suite's difficulty figures (shares of cases, 0 to 1)."""
  n = len(rows)

  def share(predicate) -> float:
    return sum(bool(predicate(r)) for r in rows) / n if n else math.nan

  def no_fit(row, name):
    return name in row["experts"] and not row["experts"][name]["fits"]

  return {
    "cases": n,
    "families": len({r["family"] for r in rows}),
    "replicated_and_data_parallel_do_not_fit": share(
      lambda r: no_fit(r, "replicated") and no_fit(r, "data_parallel")
    ),
    f"best_known_beats_{agent}_by_10pct": share(
      lambda r: (
        agent in r["agents"] and r["best_known"]["ratio"] <= r["agents"][agent]["ratio"] / 1.10
      )
    ),
    "best_known_beats_best_expert_by_5pct_or_only_it_fits": share(
      lambda r: (
        r["best_known"]["ratio"] <= 1 / 1.05 or (not r["expert_fits"] and r["best_known"]["fits"])
      )
    ),
  }


def format_rows(rows: list[dict[str, Any]]) -> str:
  """A table of ratios to each case's yardstick, the best expert or, where no expert fits,
  the best plan that does (`*`: does not fit in memory)."""
  experts = list(dict.fromkeys(n for r in rows for n in r["experts"]))
  agent_names = list(dict.fromkeys(n for r in rows for n in r["agents"]))
  columns = experts + agent_names + ["best_known"]
  width = max(len(r["case"]) for r in rows) if rows else 4

  def cell(score):
    return "-" if score is None else f"{score['ratio']:.3f}{'' if score['fits'] else '*'}"

  lines = [f"{'case':<{width}}  " + "  ".join(f"{c[:14]:>14}" for c in columns)]
  for r in rows:
    scores = (
      [r["experts"].get(n) for n in experts]
      + [r["agents"].get(n) for n in agent_names]
      + [r["best_known"]]
    )
    note = "" if r["expert_fits"] else f"  no expert fits: ratios to {r['yardstick']}"
    lines.append(f"{r['case']:<{width}}  " + "  ".join(f"{cell(s):>14}" for s in scores) + note)
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Ratio to the best expert per case (log scale), one marker per plan source."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(rows)), 4.5))
  series: dict[str, list[tuple[int, float]]] = {}
  for i, r in enumerate(rows):
    for name, score in {**r["experts"], **r["agents"], "best_known": r["best_known"]}.items():
      series.setdefault(name, []).append((i, score["ratio"]))
  for name, points in series.items():
    xs, ys = zip(*points)
    ax.scatter(
      xs,
      ys,
      label=name,
      s=30 if name == "best_known" else 14,
      marker="*" if name == "best_known" else "o",
    )
  ax.axhline(1.0, color="gray", linewidth=0.8)
  ax.set_yscale("log")
  ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=90, fontsize=6)
  ax.set_ylabel("simulated step time / best expert")
  ax.legend(fontsize=7, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def update_best_known(rows: list[dict[str, Any]], path: str | None, command: str) -> int:
  """Writes the best-known plans of `rows` that are new to the file; returns how many."""
  document = load_best_known(path, missing_ok=True)
  changed = 0
  for r in rows:
    if r["best_known"]["source"] != "stored":
      plan = {
        key: r["best_known"][key] for key in ("decisions", "pipeline") if key in r["best_known"]
      }
      document["cases"][r["case"]] = {
        **plan,
        "source": r["best_known"]["source"],
        "step_time_s": r["best_known"]["step_time_s"],
        "command": command,
      }
      changed += 1
  if changed:
    with open(best_known_path(path), "w") as f:
      json.dump(document, f, indent=1, sort_keys=True)
  return changed


def bench_cases(config: SuiteBenchConfig) -> list[Case]:
  """The split's cases of `config.families` and named `config.cases` (every case when none
  is named).

  Raises:
    ValueError: a named family or case is not in the split.
  """
  cases = load_cases(config.split)
  present = list(dict.fromkeys(c.family for c in cases))
  missing = [f for f in config.families if f not in present]
  if missing:
    raise ValueError(
      f"--families {' '.join(missing)}: no such family in the {config.split} split "
      f"(its families: {', '.join(present)})"
    )
  unknown = [n for n in config.cases if n not in {c.name for c in cases}]
  if unknown:
    raise ValueError(f"--cases {' '.join(unknown)}: no such case in the {config.split} split")
  return [
    c
    for c in cases
    if (not config.families or c.family in config.families)
    and (not config.cases or c.name in config.cases)
  ]


def run_bench(config: SuiteBenchConfig) -> dict[str, Any]:
  cases = bench_cases(config)
  stored = load_best_known(config.best_known)["cases"]
  rows: list[dict[str, Any]] = []
  for case in tqdm(cases, desc=f"bench suite {config.split}", unit="case"):
    rows.append(bench_case(case, config, stored.get(case.name)))
    write_json(config.json, {"summary": summarize(rows), "cases": rows})  # The cases so far.
    release()  # Each case compiles its own environment.
  summary = summarize(rows)
  print(format_rows(rows))
  print("ratios to the best expert; * does not fit in memory")
  print(json.dumps(summary, indent=1))
  if config.update_best_known:
    families = f" --families {' '.join(config.families)}" if config.families else ""
    families += f" --cases {' '.join(config.cases)}" if config.cases else ""
    command = (
      f"automap-rl bench suite --split {config.split}{families} --agents {' '.join(config.agents)} "
      f"--budget {config.budget} --seed {config.seed} --update-best-known"
    )
    print(f"{update_best_known(rows, config.best_known, command)} best-known plans written")
  document = {"summary": summary, "cases": rows}
  write_json(config.json, document)
  if config.plot:
    plot(rows, config.plot)
  return document
