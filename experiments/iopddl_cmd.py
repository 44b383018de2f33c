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

ProblemPath = Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="PROBLEM",
                                                                 help="a contest problem, .json or .json.gz")]


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
    output: where to write the solution (a JSON list of strategy indices).
    json: where to write the figures.
  """

  problem: ProblemPath
  timeout: float = 60.0
  seed: int = 0
  output: str | None = None
  json: JsonPath = None


def run_solve(config: SolveConfig) -> dict[str, Any]:
  started = time.monotonic()
  graph = solver.load_problem(_existing(config.problem))
  print(f"{config.problem}: {graph.num_nodes} nodes, {graph.num_edges} edges; solving for at most "
        f"{config.timeout:g}s", flush=True)
  result = solver.solve(graph, timeout_s=max(config.timeout - (time.monotonic() - started), 1.0), seed=config.seed,
                        progress=lambda seconds, cost, stage: print(f"  {seconds:6.1f}s  cost {cost}  ({stage})",
                                                                    flush=True))
  verdict = solver.evaluate(graph, result.choice)
  print(f"cost {verdict.cost}  feasible {verdict.feasible}  peak usage {verdict.peak_usage} of "
        f"{graph.usage_limit}  ({time.monotonic() - started:.1f}s)")
  if config.output:
    solver.write_solution(config.output, result.choice)
    print(f"solution written to {config.output}")
  document = {"problem": config.problem, "cost": verdict.cost, "feasible": verdict.feasible,
              "seconds": time.monotonic() - started, "log": list(result.log)}
  write_json(config.json, document)
  return document


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
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


def run_evaluate(config: EvaluateConfig) -> dict[str, Any]:
  graph = solver.load_problem(_existing(config.problem))
  verdict = solver.evaluate(graph, solver.read_solution(_existing(config.solution)))
  print(f"cost {verdict.cost}  feasible {verdict.feasible}  peak usage {verdict.peak_usage} of {graph.usage_limit}"
        + (f"  rejected: {verdict.reason}" if verdict.reason else ""))
  document = dataclasses.asdict(verdict)
  write_json(config.json, document)
  if not verdict.feasible:
    raise ValueError(f"{config.solution} is not a feasible solution of {config.problem}: {verdict.reason}")
  return document


@dataclasses.dataclass(frozen=True)
class IopddlBenchConfig:
  """The solver on every contest instance of a directory, against the best known costs.

  Attributes:
    directory: holds `asplos-2025-iopddl-*.json.gz` and `best_known.csv`.
    timeout: seconds per instance (loading included).
    seed: the solver's seed.
    instances: instance letters to run (default: all in the directory).
    json: where to write the rows.
  """

  directory: str = "../shared/iopddl"
  timeout: float = 60.0
  seed: int = 0
  instances: tuple[str, ...] | None = None
  json: JsonPath = None


def run_bench(config: IopddlBenchConfig) -> dict[str, Any]:
  if not Path(config.directory, "best_known.csv").is_file():
    raise ValueError(f"{config.directory} has no best_known.csv (expected the IOPDDL instances there).")
  names = config.instances or sorted(p.name.split("-")[-1].split(".")[0]
                                     for p in Path(config.directory).glob("asplos-2025-iopddl-*.json*"))
  rows = []
  for name in tqdm(names, desc="bench iopddl", unit="instance"):  # One at a time, for progress.
    rows += solver.bench_iopddl(config.directory, config.timeout, config.seed, [name])
  print(f"{'instance':<9} {'cost':>16} {'best known':>16} {'ratio':>8} {'seconds':>8} feasible")
  for r in rows:
    ratio = "-" if r.ratio is None else f"{r.ratio:.4f}"
    print(f"{r.instance:<9} {str(r.cost):>16} {str(r.best_known):>16} {ratio:>8} {r.seconds:>8.1f} {r.feasible}")
  mean = solver.geometric_mean(rows)
  print(f"geometric mean of cost / best known: {'-' if mean is None else f'{mean:.4f}'} "
        f"({len(rows)} instances, timeout {config.timeout:g}s, seed {config.seed})")
  document = {"rows": [dataclasses.asdict(r) for r in rows], "geometric_mean": mean, "timeout": config.timeout,
              "seed": config.seed}
  write_json(config.json, document)
  return document
