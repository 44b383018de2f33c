"""`automap-rl evaluate --checkpoint PATH --split test`: a trained policy against the baselines, per
case.

For every case of the split (or one user model, `--workload module:function --mesh ...`):
the cost of the plan each method finds over the best expert's (`automap_rl.tactics.best_expert`;
the environment's objective: step time, penalised when memory overflows; below 1 beats every
expert; where no expert fits, over the best plan of the methods that fits), for

- `learned`: the network's policy alone, greedy, no search;
- `learned+gumbel@N`: that greedy path, then Gumbel MuZero guided by the network, N
  simulations;
- `gumbel@N`: the same search with a uniform prior and zero values (no network);
- `mcts@M`: UCT (Automap's search), and `random@M`: random episodes;
- `ilp@Ts`: the ILP agent (`agents.ilp`) with T = `--ilp-seconds` (20);
- `mcts@=R` and `random@=R`: UCT and random search given, as a seconds budget, the wall
  clock the learned search R (`learned+gumbel@64`, else the largest budget) took on the
  case: which is better at equal time; every method's seconds are its first call's on the
  case, compiles included (none inherits another's); `mcts@=R, compiled` and
  `random@=R, compiled` run again, compiled, for the seconds R takes when called again:
  equal time once every compile is cached;

with N in `--search-budgets` (16, 64, 256) and M = `--baseline-budget` (2000). Prints a
table with the median ratio, the share of cases that beat the best expert and each
method's median seconds, and the share of cases where R beats each equal-time method;
writes the figures as JSON (`--json`) and draws them with each method's best ratio
against its seconds (`--plot`).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from agents import gumbel, learned, selfplay
from agents.base import Budget, SearchResult, env_config, release, searcher
from agents.gumbel import GumbelConfig, GumbelSettings
from agents.learned import LearnedConfig
from agents.registry import run_agent
from automap_rl import tactics
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from automap_rl.workloads.suite import load_cases
from experiments.cli import write_json
from experiments.options import Hardware, JsonPath, MeshSpec, OptionalWorkload, PlotPath
from experiments.partition_cmd import load
from experiments.train_cmd import pick_cases


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
  """What to evaluate and against what.

  Attributes:
    checkpoint: a policy directory or a training run directory (None: the policy shipped
      with the package).
    split: the task-suite split whose cases are evaluated.
    max_cases: at most this many cases, one family after another in turn (None: all).
    workload: evaluate this one workload spec or `package.module:function` (on `--mesh`
      and `--hardware`) instead of the split.
    mesh: the user workload's mesh.
    hardware: the user workload's hardware profile.
    search_budgets: simulation budgets of the Gumbel searches (learned and uniform prior).
    baseline_budget: simulation budget of UCT and random search.
    baselines: run the methods that do not depend on the policy (uniform Gumbel, UCT,
      random, ILP) and the equal-time ones; `--no-baselines` runs the learned ones alone
      (a new policy against baselines measured before).
    ilp_seconds: the ILP agent's seconds budget (0: leave it out).
    gumbel: the settings of every Gumbel search, learned and uniform
      (`agents.gumbel.GumbelSettings`).
    past_stop: the learned agent's greedy paths go on this many steps after the network
      stops (`agents.learned.LearnedConfig.past_stop`).
    first_moves: the learned agent's greedy paths begin with each of the network's this
      many most likely first decisions (`agents.learned.LearnedConfig.first_moves`).
    seed: the seed of every search.
    json: where to write the figures.
    plot: where to draw the ratios (PNG).
    progress: show a progress bar.
  """

  checkpoint: str | None = None
  split: Literal["smoke", "train", "test", "external"] = "test"
  max_cases: int | None = None
  workload: OptionalWorkload = None
  mesh: MeshSpec = "data=2,model=4"
  hardware: Hardware = "h100"
  search_budgets: tuple[int, ...] = (16, 64, 256)
  baseline_budget: int = 2000
  baselines: bool = True
  ilp_seconds: float = 20.0
  gumbel: GumbelSettings = GumbelSettings(max_num_considered_actions=4)
  past_stop: int = LearnedConfig.past_stop
  first_moves: int = LearnedConfig.first_moves
  seed: int = 0
  json: JsonPath = None
  plot: PlotPath = None
  progress: bool = True


Method = Callable[[Problem], SearchResult]
# A method given the seconds the reference learned search took on the case.
TimedMethod = Callable[[Problem, float], SearchResult]


def methods(config: EvaluateConfig) -> dict[str, Method]:
  """Every method by name: a function of the problem that returns its search result."""
  policy = LearnedConfig(
    checkpoint=config.checkpoint,
    gumbel=config.gumbel,
    past_stop=config.past_stop,
    first_moves=config.first_moves,
  )
  uniform = GumbelConfig(gumbel=config.gumbel)
  out: dict[str, Method] = {
    "learned": lambda p: learned.search(
      p, dataclasses.replace(policy, search=False), config.seed, config.baseline_budget
    )
  }
  for n in config.search_budgets:
    out[f"learned+gumbel@{n}"] = lambda p, n=n: learned.search(p, policy, config.seed, n)
  if not config.baselines:
    return out
  for n in config.search_budgets:
    out[f"gumbel@{n}"] = lambda p, n=n: gumbel.search(p, uniform, config.seed, n)
  for agent in ("mcts", "random"):
    out[f"{agent}@{config.baseline_budget}"] = lambda p, a=agent: run_agent(
      a, p, config.seed, config.baseline_budget
    )
  if config.ilp_seconds > 0:
    out[f"ilp@{config.ilp_seconds:g}s"] = lambda p: run_agent(
      "ilp", p, config.seed, Budget(seconds=config.ilp_seconds)
    )
  return out


def reference(config: EvaluateConfig) -> str:
  """The learned search the equal-time methods get the seconds of: `learned+gumbel@64`,
  else the one with the largest budget."""
  return f"learned+gumbel@{64 if 64 in config.search_budgets else max(config.search_budgets)}"


def timed_methods(config: EvaluateConfig) -> dict[str, TimedMethod]:
  """UCT and random search for the reference's seconds on each case (none without baselines)."""
  if not config.baselines:
    return {}
  return {
    f"{agent}@={reference(config)}": lambda p, s, a=agent: run_agent(
      a, p, config.seed, Budget(seconds=s)
    )
    for agent in ("mcts", "random")
  }


def problems(config: EvaluateConfig) -> list[tuple[str, str, Callable[[], Problem]]]:
  """(name, family, a function that builds the problem) of every case evaluated."""
  if config.workload is not None:
    name, _, _, program = load(config.workload)
    return [
      (
        name,
        name.partition(":")[0],
        lambda: Problem.build(program, make_mesh(config.mesh, config.hardware)),
      )
    ]
  cases = pick_cases(load_cases(config.split), config.max_cases)
  return [(c.name, c.family, lambda c=c: selfplay.case_problem(c)) for c in cases]


COMPILED = (
  ", compiled"  # Suffix of an equal-time method's second run: the reference's compiled seconds.
)


def _call(fn: Callable[..., SearchResult], *args: Any) -> dict[str, Any]:
  """One timed call of a method, as its JSON figures."""
  start = time.perf_counter()
  result = fn(*args)
  return {
    "objective": float(result.objective),
    "step_time_s": result.step_time,
    "fits": bool(result.cost.fits),
    "simulations": result.simulations,
    "greedy_steps": result.greedy_steps,
    "seconds": time.perf_counter() - start,
    "actions": result.actions,
    "start": result.start,
    "trace": [[p.seconds, p.objective] for p in result.trace],
  }


def evaluate_case(
  name: str,
  family: str,
  problem: Problem,
  run: dict[str, Method],
  timed: dict[str, TimedMethod] | None = None,
  reference_method: str | None = None,
) -> dict[str, Any]:
  """Every method on one problem, as a JSON case, then each of `timed` given the seconds
  `reference_method` took. Ratios are to the best expert's objective
  (`tactics.best_expert`); where no expert fits, to the best objective of the methods'
  plans that fit (`yardstick` names it), never to a plan that cannot run.

  Each method's `seconds` are those of its first call on the problem, as for a user's
  first call on a new model: compiled environments and searches are released before it
  (`agents.base.release`), so its environment's build and every compile it needs count,
  and no method inherits another's. The reference runs first, then again, its compiles
  cached (`compiled_seconds`, the same plan). Each equal-time method runs next, twice: a
  first call given the reference's seconds (`mcts@=R`), then, compiled, its compiled
  seconds (`mcts@=R, compiled`): at equal time with compiles counted, and with them
  cached. They run before the other methods, so that neither side finds programs of this
  problem that another method put in the persistent compilation cache (programs of
  earlier problems of its bucket it may find, as a user's process would).
  """
  search = searcher(problem, env_config(problem, "groups", LearnedConfig.max_decisions))
  expert = tactics.best_expert_plan(problem)
  best = selfplay.expert_objective(problem, search.env.config, search.env.tables, expert)
  expert_fits = expert.fits
  case: dict[str, Any] = {
    "case": name,
    "family": family,
    "best_expert_objective": best,
    "expert_fits": expert_fits,
    "yardstick": "best expert",
    "methods": {},
  }
  methods_ = case["methods"]
  if timed:
    release()
    reference_figures = methods_[reference_method] = _call(run[reference_method], problem)
    reference_figures["compiled_seconds"] = _call(run[reference_method], problem)["seconds"]
    for method, fn in timed.items():
      release()
      methods_[method] = _call(fn, problem, reference_figures["seconds"])
      methods_[method + COMPILED] = _call(fn, problem, reference_figures["compiled_seconds"])
  for method, fn in run.items():
    if method not in methods_:
      release()
      methods_[method] = _call(fn, problem)
  fitting = {m: r["objective"] for m, r in methods_.items() if r["fits"]}
  if not expert_fits and fitting:
    case["yardstick"] = min(fitting, key=fitting.get)
    best = fitting[case["yardstick"]]
  for figures in methods_.values():
    figures["ratio"] = figures["objective"] / best
  return case


def summarize(cases: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
  """Per method: the median ratio to the yardstick, the share of cases that beat the best
  expert (below 1; where no expert fits, any plan that fits does), the share whose plan
  started from an expert's (`SearchResult.start`), the median seconds of a first
  call and, for the equal-time reference, of a compiled one."""
  names = list(cases[0]["methods"])
  beats = lambda c, m: (
    c["methods"][m]["ratio"] < 1 - 1e-6 if c["expert_fits"] else c["methods"][m]["fits"]
  )
  out = {
    m: {
      "median_ratio": statistics.median(c["methods"][m]["ratio"] for c in cases),
      "beats_expert": sum(beats(c, m) for c in cases) / len(cases),
      "from_expert": sum(c["methods"][m].get("start") is not None for c in cases) / len(cases),
      "median_seconds": statistics.median(c["methods"][m]["seconds"] for c in cases),
    }
    for m in names
  }
  for m in names:
    if all("compiled_seconds" in c["methods"][m] for c in cases):
      out[m]["median_compiled_seconds"] = statistics.median(
        c["methods"][m]["compiled_seconds"] for c in cases
      )
  return out


def equal_time_wins(cases: list[dict[str, Any]], reference_method: str) -> dict[str, float]:
  """Per equal-time method (`@=`): the share of cases where the reference's plan is better
  (a lower objective)."""
  names = [m for m in cases[0]["methods"] if "@=" in m]
  return {
    m: sum(
      c["methods"][reference_method]["objective"] < c["methods"][m]["objective"] * (1 - 1e-6)
      for c in cases
    )
    / len(cases)
    for m in names
  }


def ratio_at(case: dict[str, Any], method: str, seconds: np.ndarray) -> np.ndarray:
  """A method's best ratio to the case's yardstick after each of `seconds` of its run (its
  anytime trace; the replicated plan's before its first point), f32 [T]."""
  figures = case["methods"][method]
  times, objectives = np.asarray(figures["trace"], np.float64).reshape(-1, 2).T
  best = figures["objective"] / figures["ratio"]
  index = np.searchsorted(times, seconds, side="right") - 1
  return np.where(index >= 0, objectives[np.maximum(index, 0)], 1.0) / best


def table(cases: list[dict[str, Any]], summary: dict[str, dict[str, float]]) -> Table:
  """The ratios as a rich table: a row per case, a column per method, then the summary."""
  out = Table(title="plan cost / best expert's (below 1 beats every expert)")
  out.add_column("case")
  for m in summary:
    out.add_column(m, justify="right")
  for c in cases:
    label = c["case"] if c["expert_fits"] else f"{c['case']} (no expert fits: / {c['yardstick']})"
    out.add_row(label, *(f"{c['methods'][m]['ratio']:.4f}" for m in summary))
  out.add_section()
  out.add_row("median", *(f"{s['median_ratio']:.4f}" for s in summary.values()))
  out.add_row("beats expert", *(f"{s['beats_expert']:.0%}" for s in summary.values()))
  out.add_row("median seconds", *(f"{s['median_seconds']:.1f}" for s in summary.values()))
  return out


def plot(cases: list[dict[str, Any]], summary: dict[str, dict[str, float]], path: str) -> None:
  """Each method's ratios over the cases (dots) and their median (bar); beside them, the
  median over the cases of each method's best ratio after t seconds of its run, PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(summary)
  fig, (ax, anytime) = plt.subplots(1, 2, figsize=(1.1 * len(names) + 9, 4.5))
  longest = max(c["methods"][m]["seconds"] for c in cases for m in names)
  seconds = np.geomspace(0.1, max(longest, 0.2), 100)
  for m in names:
    anytime.plot(seconds, np.median([ratio_at(c, m, seconds) for c in cases], axis=0), label=m)
  anytime.axhline(1.0, color="gray", lw=0.8, ls="--")
  anytime.set_xscale("log")
  anytime.set_yscale("log")
  anytime.set_xlabel("seconds of the method's run")
  anytime.set_ylabel("best plan so far / best expert (median)")
  anytime.legend(fontsize=7)
  ax.bar(
    range(len(names)), [summary[m]["median_ratio"] for m in names], color="#9ecae1", label="median"
  )
  for i, m in enumerate(names):
    ax.scatter(
      [i] * len(cases), [c["methods"][m]["ratio"] for c in cases], s=10, color="#08519c", zorder=3
    )
  ax.axhline(1.0, color="gray", lw=0.8, ls="--")
  ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
  ax.set_ylabel("plan cost / best expert")
  ax.set_yscale("log")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run(config: EvaluateConfig) -> dict[str, Any]:
  if not config.search_budgets or min(config.search_budgets) < 1 or config.baseline_budget < 1:
    raise ValueError("--search-budgets and --baseline-budget must be at least 1 simulation.")
  checkpoint = learned.policy_path(config.checkpoint)  # A bad checkpoint fails before any tracing.
  run_methods, timed = methods(config), timed_methods(config)
  chosen = problems(config)
  bar = tqdm(chosen, desc="evaluate", unit="case", disable=not config.progress, dynamic_ncols=True)
  cases: list[dict[str, Any]] = []
  document = lambda: {
    "checkpoint": checkpoint,
    "split": config.split,
    "config": dataclasses.asdict(config),
    "cases": cases,
    "summary": summarize(cases),
    "equal_time_wins": equal_time_wins(cases, reference(config)),
  }
  for name, family, build in bar:
    bar.set_postfix_str(name)
    cases.append(evaluate_case(name, family, build(), run_methods, timed, reference(config)))
    if not config.progress:
      print(
        f"{len(cases)}/{len(chosen)} {name}: "
        + ", ".join(f"{m} {r['ratio']:.3f}" for m, r in cases[-1]["methods"].items()),
        flush=True,
      )
    write_json(config.json, document())  # The cases so far: a long run that dies keeps them.
    release()  # Each case compiles its own environment.
  bar.close()
  summary = summarize(cases)
  Console(width=None if sys.stdout.isatty() else 200).print(table(cases, summary))
  compiled = summary[reference(config)].get("median_compiled_seconds") if config.baselines else None
  if compiled is not None:
    print(
      f"{reference(config)}: median {summary[reference(config)]['median_seconds']:.1f} s on a "
      "first call, "
      f"{compiled:.1f} s compiled"
    )
  for method, share in equal_time_wins(cases, reference(config)).items():
    print(f"{reference(config)} beats {method} (the same seconds) on {share:.0%} of the cases")
  for method, figures in summary.items():
    if figures["from_expert"]:
      print(
        f"{method}: its plan refines an expert's on {round(figures['from_expert'] * len(cases))} "
        "of "
        f"{len(cases)} cases"
      )
  write_json(config.json, document())
  if config.plot:
    plot(cases, summary, config.plot)
  return document()
