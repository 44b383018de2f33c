"""`automap-rl iopddl solve|evaluate` and `automap-rl bench iopddl`: the strategy-graph
solver on the ASPLOS/EuroSys 2025 IOPDDL contest problems (`automap_rl.solver`)."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class IopddlBenchConfig:
  """The solver on every contest instance of a directory, against the best known costs.

  Attributes:
    directory: holds `asplos-2025-iopddl-*.json.gz` and `best_known.csv`.
    timeout: seconds per instance (loading included).
    seed: the solver's seed.
    workers: search processes per instance (see `iopddl solve`).
    copies: solve each instance tiled into this many independent copies one after another in
      time (a synthetic instance this many times larger, whose optimum is this many times the
      original's), against this many times the best known cost.
    instances: instance letters to run (default: all in the directory).
    json: where to write the rows.
  """

  directory: str = "../shared/iopddl"
  timeout: float = 60.0
  seed: int = 0
  workers: int = 2
  copies: int = 1
  instances: tuple[str, ...] | None = None
  json: JsonPath = None


def run_bench(config: IopddlBenchConfig) -> dict[str, Any]:
  if not Path(config.directory, "best_known.csv").is_file():
    raise ValueError(
      f"{config.directory} has no best_known.csv (expected the IOPDDL instances there)."
    )
  _check_workers(config.workers)
  if config.copies < 1:
    raise ValueError(f"--copies must be at least 1, got {config.copies}")
  names = config.instances or sorted(
    p.name.split("-")[-1].split(".")[0]
    for p in Path(config.directory).glob("asplos-2025-iopddl-*.json*")
  )
  rows = []
  for name in tqdm(names, desc="bench iopddl", unit="instance"):  # One at a time, for progress.
    rows += solver.bench_iopddl(
      config.directory,
      config.timeout,
      config.seed,
      [name],
      workers=config.workers,
      copies=config.copies,
    )
  print(
    f"{'instance':<9} {'cost':>17} {'best known':>17} {'ratio':>8} {'seconds':>8} feasible stopped "
    "by"
  )
  for r in rows:
    ratio = "-" if r.ratio is None else f"{r.ratio:.4f}"
    print(
      f"{r.instance:<9} {str(r.cost):>17} {str(r.best_known):>17} {ratio:>8} {r.seconds:>8.1f} "
      f"{str(r.feasible):<8} {r.stopped_by or '-'}" + (f"  ({r.failure})" if r.failure else "")
    )
  mean, points = solver.geometric_mean(rows), solver.contest_points(rows)
  print(
    f"geometric mean of cost / best known: {'-' if mean is None else f'{mean:.4f}'}; contest "
    "points "
    f"(sum of best known / cost): {points:.3f} of {len(rows)} ({len(rows)} instances, timeout "
    f"{config.timeout:g}s, seed {config.seed}, {config.workers} workers, {config.copies} copies)"
  )
  document = {
    "rows": [dataclasses.asdict(r) for r in rows],
    "geometric_mean": mean,
    "contest_points": points,
    "timeout": config.timeout,
    "seed": config.seed,
    "workers": config.workers,
    "copies": config.copies,
  }
  write_json(config.json, document)
  return document
