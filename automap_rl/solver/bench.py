"""Benchmark: the solver on the IOPDDL contest instances against the best known costs.

`bench_iopddl` solves each `asplos-2025-iopddl-*.json[.gz]` of one or more directories in
turn (an instance in two directories once, from the first; one at a time: each solve uses
`workers` processes), `runs` times with seeds `seed`, `seed + 1`, ..., and compares with the
best known costs: the lowest cost of the contest's published results
(`iopddl_final_results.csv`, see `contest`) where a directory holds them, else its
`best_known.csv` (columns instance, best_known_cost, ...). The timeout covers loading as
well as solving, as in the contest; without one, each instance gets its contest time limit.
With `copies` > 1 each instance is first `tile`d into that many independent copies (a
synthetic instance whose optimum is `copies` times the original's), compared with `copies`
times the best known cost; building the copies counts as loading.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path

from automap_rl.solver.contest import CONTEST_TIMEOUTS, ContestResults, load_results
from automap_rl.solver.graph import tile
from automap_rl.solver.iopddl import evaluate, load_problem
from automap_rl.solver.solve import solve

__all__ = [
  "RESULTS_FILE",
  "BenchRow",
  "bench_iopddl",
  "find_instances",
  "geometric_mean",
  "is_instance_file",
  "read_results",
]

_INSTANCE = re.compile(r"asplos-2025-iopddl-([A-Za-z0-9]+)\.json(\.gz)?$")
# The contest's published results, as a directory of instances may hold them.
RESULTS_FILE = "iopddl_final_results.csv"


@dataclasses.dataclass(frozen=True)
class BenchRow:
  """One instance's result.

  Attributes:
    instance: Instance letter, e.g. "A" ("A x4" for 4 tiled copies).
    cost: Exact cost of the returned plan (None if the solver failed).
    best_known: Best cost any contest team reached, times the copies (None if not listed).
    ratio: cost / best_known (None if either is missing).
    seconds: Wall time for loading plus solving.
    feasible: Whether the contest's evaluator accepts the plan.
    stopped_by: The limit that stopped the solver early ("seconds" or "memory"), or None.
    failure: Why the solver returned no plan (its one-line message), or None.
    lower_bound: The solver's proven lower bound on every plan within the limit, or None.
    timeout: The seconds the instance was given (loading included).
    seed: The solver's seed.
  """

  instance: str
  cost: int | float | None
  best_known: int | None
  ratio: float | None
  seconds: float
  feasible: bool
  stopped_by: str | None = None
  failure: str | None = None
  lower_bound: float | None = None
  timeout: float = 0.0
  seed: int = 0


def is_instance_file(name: str) -> bool:
  """Whether a file name is a contest instance's (`asplos-2025-iopddl-<letter>.json[.gz]`)."""
  return _INSTANCE.search(name) is not None


def find_instances(directories: Sequence[str | Path]) -> dict[str, Path]:
  """Instance letter -> file, over `directories` in order (the first holding one wins)."""
  found: dict[str, Path] = {}
  for directory in directories:
    directory = Path(directory)
    if not directory.is_dir():
      continue
    for path in sorted(directory.iterdir()):
      match = _INSTANCE.search(path.name)
      if match and match.group(1) not in found:
        found[match.group(1)] = path
  return dict(sorted(found.items()))


def read_results(directories: Sequence[str | Path]) -> ContestResults:
  """The contest's results from the first directory holding `RESULTS_FILE`; else the best known
  costs of each directory's `best_known.csv` (as a results table of one team, "best known")."""
  for directory in directories:
    if Path(directory, RESULTS_FILE).is_file():
      return load_results(Path(directory, RESULTS_FILE))
  costs: dict[str, dict[str, int]] = {}
  for directory in directories:
    for instance, cost in _best_known(Path(directory) / "best_known.csv").items():
      costs.setdefault(instance, {"best known": cost})
  return ContestResults(costs)


def bench_iopddl(
  directories: str | Path | Sequence[str | Path],
  timeout_s: float | None,
  seed: int,
  instances: Sequence[str] | None = None,
  workers: int = 2,
  copies: int = 1,
  runs: int = 1,
) -> list[BenchRow]:
  """Solves the contest instances of `directories` (all, or those named), each tiled into
  `copies`, `runs` times (seeds `seed` on), each within `timeout_s` or (None) its contest
  time limit; one row per solve, instance by instance."""
  if isinstance(directories, (str, Path)):
    directories = [directories]
  results = read_results(directories)
  rows = []
  for name, path in find_instances(directories).items():
    if instances is not None and name not in instances:
      continue
    best = results.best(name)
    timeout = timeout_s if timeout_s is not None else CONTEST_TIMEOUTS.get(name, 60.0)
    for run in range(runs):
      rows.append(
        _bench_one(
          path, name, None if best is None else best * copies, timeout, seed + run, workers, copies
        )
      )
  return rows


def _bench_one(
  path: Path, name: str, known: int | None, timeout: float, seed: int, workers: int, copies: int
) -> BenchRow:
  """One solve of one instance, timed from before loading."""
  started = time.monotonic()
  graph = tile(load_problem(path), copies)
  label = name if copies == 1 else f"{name} x{copies}"
  common = dict(best_known=known, timeout=timeout, seed=seed)
  try:
    result = solve(
      graph,
      timeout_s=max(timeout - (time.monotonic() - started), 1.0),
      seed=seed,
      workers=workers,
    )
  except (
    RuntimeError
  ) as e:  # No plan within the limit, `LimitReached` before one, or `GraphTooLarge`.
    return BenchRow(
      label,
      None,
      ratio=None,
      seconds=time.monotonic() - started,
      feasible=False,
      stopped_by=getattr(e, "limit", None),
      failure=str(e),
      **common,
    )
  verdict = evaluate(graph, result.choice)
  ratio = verdict.cost / known if known and verdict.cost is not None else None
  return BenchRow(
    label,
    verdict.cost,
    ratio=ratio,
    seconds=time.monotonic() - started,
    feasible=verdict.feasible,
    stopped_by=result.stopped_by,
    lower_bound=result.lower_bound,
    **common,
  )


def geometric_mean(rows: Sequence[BenchRow]) -> float | None:
  """Geometric mean of the ratios (None if any row has none)."""
  ratios = [row.ratio for row in rows]
  if not ratios or any(r is None or not r > 0 for r in ratios):
    return None
  return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def _best_known(path: Path) -> dict[str, int]:
  if not path.exists():
    return {}
  with path.open() as f:
    return {row["instance"]: int(row["best_known_cost"]) for row in csv.DictReader(f)}
