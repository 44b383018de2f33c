"""`automap-rl iopddl solve|evaluate` and `automap-rl bench iopddl`: the strategy-graph
solver on the ASPLOS/EuroSys 2025 IOPDDL contest problems (`automap_rl.solver`)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path
from typing import Annotated, Any

import tyro
from tqdm import tqdm

from automap_rl import solver
from experiments.cli import write_json
from experiments.options import JsonPath

ProblemPath = Annotated[
  str,
  tyro.conf.Positional,
  tyro.conf.arg(metavar="PROBLEM", help="a contest problem, .json or .json.gz"),
]


def _existing(path: str) -> Path:
  if not Path(path).is_file():
    raise ValueError(f"no such file: {path}")
  return Path(path)


@dataclasses.dataclass(frozen=True)
class SolveConfig:
  """Solve one contest problem: print its cost and write the contest's solution format.

  Attributes:
    problem: the problem file.
    timeout: seconds for loading and solving, as in the contest.
    seed: the solver's seed.
    workers: search processes (2 uses both cores of a 2-core machine; 0 searches in this
      process, where a HiGHS call that ignores its time limit can overrun the timeout).
    output: where to write the solution (a JSON list of strategy indices).
    json: where to write the figures.
  """

  problem: ProblemPath
  timeout: float = 60.0
  seed: int = 0
  workers: int = 2
  output: str | None = None
  json: JsonPath = None


def _check_workers(workers: int) -> None:
  if workers < 0:
    raise ValueError(
      f"--workers must be 0 (search in this process) or a number of processes, got {workers}"
    )


def run_solve(config: SolveConfig) -> dict[str, Any]:
  started = time.monotonic()
  _check_workers(config.workers)
  graph = solver.load_problem(_existing(config.problem))
  print(
    f"{config.problem}: {graph.num_nodes} nodes, {graph.num_edges} edges; solving for at most "
    f"{config.timeout:g}s",
    flush=True,
  )
  result = solver.solve(
    graph,
    timeout_s=max(config.timeout - (time.monotonic() - started), 1.0),
    seed=config.seed,
    workers=config.workers,
    progress=lambda seconds, cost, stage: print(
      f"  {seconds:6.1f}s  cost {cost}  ({stage})", flush=True
    ),
  )
  verdict = solver.evaluate(graph, result.choice)
  print(
    f"cost {verdict.cost}  feasible {verdict.feasible}  peak usage {verdict.peak_usage} of "
    f"{graph.usage_limit}  ({time.monotonic() - started:.1f}s"
    + (
      ", stopped by the time limit)"
      if result.stopped_by == "seconds"
      else ", stopped by the memory ceiling)"
      if result.stopped_by == "memory"
      else ")"
    )
  )
  if config.output:
    solver.write_solution(config.output, result.choice)
    print(f"solution written to {config.output}")
  document = {
    "problem": config.problem,
    "cost": verdict.cost,
    "feasible": verdict.feasible,
    "seconds": time.monotonic() - started,
    "stopped_by": result.stopped_by,
    "log": list(result.log),
  }
  write_json(config.json, document)
  return document


@dataclasses.dataclass(frozen=True)
class CheckSolutionConfig:
  """Check a solution as the contest does: memory at every time, forbidden strategies,
  exact integer cost.

  Attributes:
    problem: the problem file.
    solution: the solution file (a JSON list of strategy indices).
    json: where to write the verdict.
  """

  problem: ProblemPath
  solution: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="SOLUTION")]
  json: JsonPath = None


def run_evaluate(config: CheckSolutionConfig) -> dict[str, Any]:
  graph = solver.load_problem(_existing(config.problem))
  verdict = solver.evaluate(graph, solver.read_solution(_existing(config.solution)))
  print(
    f"cost {verdict.cost}  feasible {verdict.feasible}  peak usage {verdict.peak_usage} of "
    f"{graph.usage_limit}" + (f"  rejected: {verdict.reason}" if verdict.reason else "")
  )
  document = dataclasses.asdict(verdict)
  write_json(config.json, document)
  if not verdict.feasible:
    raise ValueError(
      f"{config.solution} is not a feasible solution of {config.problem}: {verdict.reason}"
    )
  return document


def _default_cache() -> str:
  """Where `bench iopddl` keeps the contest's files: the user's cache directory."""
  root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return str(Path(root) / "automap_rl" / "iopddl")


@dataclasses.dataclass(frozen=True)
class IopddlBenchConfig:
  """The solver on every contest instance of some directories, against the contest's results.

  Prints, per instance, the cost (median of the runs, and the spread of cost / best known),
  the contest's best, the points as the contest scored them (with this solver as one more
  team), the winner's points, the solver's lower bound and the gap to it, and the wall time;
  then the total points on the withheld instances held, against the winner's on the same.

  Attributes:
    directories: where to look for `asplos-2025-iopddl-*.json[.gz]` (the first holding an
      instance wins), the contest's `iopddl_final_results.csv` or a `best_known.csv`.
    extract_from: bare git directories of the public `google/iopddl` and `asplos-contest/2025`
      repositories: their benchmark files and results table are first copied into the first
      directory (files the snapshot lacks are skipped and named).
    timeout: seconds per instance (loading included).
    contest_timeouts: give each instance its contest time limit instead of `timeout`.
    seed: the solver's seed (run i uses seed + i).
    runs: solves per instance; the table shows the median and the spread.
    workers: search processes per instance (see `iopddl solve`).
    copies: solve each instance tiled into this many independent copies one after another in
      time (a synthetic instance this many times larger, whose optimum is this many times the
      original's), against this many times the best known cost.
    instances: instance letters to run (default: all the directories hold).
    json: where to write the rows.
  """

  directories: tuple[str, ...] = (_default_cache(), "../shared/iopddl")
  extract_from: tuple[str, ...] = ()
  timeout: float = 60.0
  contest_timeouts: bool = False
  seed: int = 0
  runs: int = 1
  workers: int = 2
  copies: int = 1
  instances: tuple[str, ...] | None = None
  json: JsonPath = None


def extract_contest_files(git_dir: str, target: Path) -> list[str]:
  """Copies the benchmark files and the results table of a bare git snapshot (HEAD) into
  `target`, keeping those already there; returns the paths the snapshot lists but lacks."""
  listed = subprocess.run(
    ["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", "HEAD"],
    capture_output=True,
    text=True,
  )
  if listed.returncode != 0:
    raise ValueError(f"--extract-from {git_dir}: not a git directory ({listed.stderr.strip()})")
  target.mkdir(parents=True, exist_ok=True)
  missing = []
  for path in listed.stdout.split():
    name = Path(path).name
    if not (solver.is_instance_file(name) or name == solver.RESULTS_FILE):
      continue
    if (target / name).exists():
      continue
    shown = subprocess.run(
      ["git", "--git-dir", git_dir, "show", f"HEAD:{path}"], capture_output=True
    )
    if shown.returncode != 0:
      missing.append(path)
      continue
    partial = target / f".{name}.partial"
    partial.write_bytes(shown.stdout)
    partial.rename(target / name)
  return missing


def run_bench(config: IopddlBenchConfig) -> dict[str, Any]:
  _check_workers(config.workers)
  if config.copies < 1:
    raise ValueError(f"--copies must be at least 1, got {config.copies}")
  if config.runs < 1:
    raise ValueError(f"--runs must be at least 1, got {config.runs}")
  for git_dir in config.extract_from:
    missing = extract_contest_files(git_dir, Path(config.directories[0]))
    if missing:
      print(f"{git_dir}: {len(missing)} files absent from the snapshot: {', '.join(missing)}")
  found = solver.find_instances(config.directories)
  if not found:
    raise ValueError(
      f"no asplos-2025-iopddl-*.json[.gz] in {', '.join(config.directories)} "
      "(--extract-from copies them from a snapshot of google/iopddl)"
    )
  names = [n for n in found if config.instances is None or n in config.instances]
  timeout = None if config.contest_timeouts else config.timeout
  rows = []
  for name in tqdm(names, desc="bench iopddl", unit="instance"):  # One at a time, for progress.
    rows += solver.bench_iopddl(
      config.directories,
      timeout,
      config.seed,
      [name],
      workers=config.workers,
      copies=config.copies,
      runs=config.runs,
    )
  results = solver.read_results(config.directories)
  summary = _print_table(rows, results, names, config)
  document = {
    "rows": [dataclasses.asdict(r) for r in rows],
    **summary,
    "timeout": "contest" if config.contest_timeouts else config.timeout,
    "seed": config.seed,
    "runs": config.runs,
    "workers": config.workers,
    "copies": config.copies,
  }
  write_json(config.json, document)
  return document


def _print_table(
  rows: list[solver.BenchRow],
  results: solver.ContestResults,
  names: list[str],
  config: IopddlBenchConfig,
) -> dict[str, Any]:
  """Prints one line per instance (medians over the runs) and the totals; returns the totals."""
  winner = results.winner() if config.copies == 1 else None
  print(
    f"{'inst':<5} {'limit':>5} {'cost (median)':>17} {'contest best':>17} {'ratio':>7} "
    f"{'spread':>15} {'points':>6} {'winner':>6} {'lower bound':>17} {'gap':>8} {'wall':>6} "
    "stopped"
  )
  by_run = [[r for r in rows if r.seed == config.seed + i] for i in range(config.runs)]
  for name in names:
    mine = [r for r in rows if r.instance.split()[0] == name]
    if not mine:
      continue
    median = sorted(mine, key=_cost_key)[len(mine) // 2]
    ratios = [r.ratio for r in mine if r.ratio is not None]
    spread = f"{min(ratios):.4f}-{max(ratios):.4f}" if len(ratios) > 1 else "-"
    points = results.points(name, median.cost, median.cost) if winner else None
    theirs = (
      results.points(name, results.costs[name].get(winner), median.cost)
      if winner and name in results.costs
      else None
    )
    bound = median.lower_bound
    gap = (
      "optimal"
      if bound is not None and median.cost is not None and median.cost <= bound * (1 + 1e-7) + 1e-9
      else "-"
      if bound is None or median.cost is None or not bound > 0
      else f"{median.cost / bound - 1:.2%}"
    )
    print(
      f"{median.instance:<5} {median.timeout:>5.0f} {str(median.cost):>17} "
      f"{str(median.best_known):>17} {_fmt(median.ratio, 4):>7} {spread:>15} "
      f"{_fmt(points, 3):>6} {_fmt(theirs, 3):>6} {_fmt(bound, 0):>17} {gap:>8} "
      f"{median.seconds:>6.1f} {median.stopped_by or '-'}"
      + (f"  ({median.failure})" if median.failure else "")
    )
  withheld = [n for n in names if n not in solver.PUBLIC and n in results.costs]
  totals = [_totals(run, results, withheld, winner) for run in by_run]
  means = [solver.geometric_mean(run) for run in by_run]
  print(
    "geometric mean of cost / contest best, per run: "
    + ", ".join("-" if m is None else f"{m:.4f}" for m in means)
  )
  if winner:
    print(
      f"points on the {len(withheld)} withheld instances held ({' '.join(withheld)}), per run: "
      + ", ".join(f"{ours:.3f} vs the winner's ({winner}) {theirs:.3f}" for ours, theirs in totals)
    )
  print(
    f"({len(names)} instances, timeout "
    f"{'contest limits' if config.contest_timeouts else f'{config.timeout:g}s'}, seeds "
    f"{config.seed}-{config.seed + config.runs - 1}, {config.workers} workers, {config.copies} "
    "copies)"
  )
  return {
    "geometric_means": means,
    "withheld": withheld,
    "winner": winner,
    "withheld_points": [ours for ours, _ in totals],
    "winner_points": [theirs for _, theirs in totals],
  }


def _totals(
  run: list[solver.BenchRow],
  results: solver.ContestResults,
  withheld: list[str],
  winner: str | None,
) -> tuple[float, float]:
  """(our points, the winner's points) on `withheld`, with this run as one more team."""
  ours = theirs = 0.0
  for row in run:
    if row.instance in withheld and winner:
      cost = row.cost if row.feasible else None
      ours += results.points(row.instance, cost, cost)
      theirs += results.points(row.instance, results.costs[row.instance].get(winner), cost)
  return ours, theirs


def _cost_key(row: solver.BenchRow) -> float:
  return float(row.cost) if row.feasible and row.cost is not None else float("inf")


def _fmt(value: float | None, digits: int) -> str:
  return "-" if value is None else f"{value:.{digits}f}"
