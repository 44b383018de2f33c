"""Benchmark: the solver on the IOPDDL contest instances against the best known costs.

`bench_iopddl` solves each `asplos-2025-iopddl-*.json[.gz]` of a directory in
turn (one at a time: the solver is single-process) and compares with the
directory's `best_known.csv` (columns instance, best_known_cost, ...). The
timeout covers loading as well as solving, as in the contest.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path

from automap_rl.solver.iopddl import evaluate, load_problem
from automap_rl.solver.solve import solve

__all__ = ["BenchRow", "bench_iopddl", "geometric_mean"]

_INSTANCE = re.compile(r"asplos-2025-iopddl-([A-Za-z0-9]+)\.json(\.gz)?$")


@dataclasses.dataclass(frozen=True)
class BenchRow:
  """One instance's result.

  Attributes:
    instance: Instance letter, e.g. "A".
    cost: Exact cost of the returned plan (None if the solver failed).
    best_known: Best cost any contest team reached (None if not listed).
    ratio: cost / best_known (None if either is missing).
    seconds: Wall time for loading plus solving.
    feasible: Whether the contest's evaluator accepts the plan.
  """

  instance: str
  cost: int | float | None
  best_known: int | None
  ratio: float | None
  seconds: float
  feasible: bool


def bench_iopddl(directory: str | Path, timeout_s: float, seed: int,
                 instances: Sequence[str] | None = None) -> list[BenchRow]:
  """Solves the contest instances in `directory` (all, or those named)."""
  directory = Path(directory)
  best = _best_known(directory / "best_known.csv")
  files = sorted(p for p in directory.iterdir() if _INSTANCE.search(p.name))
  rows = []
  for path in files:
    name = _INSTANCE.search(path.name).group(1)
    if instances is not None and name not in instances:
      continue
    started = time.monotonic()
    graph = load_problem(path)
    try:
      result = solve(graph, timeout_s=max(timeout_s - (time.monotonic() - started), 1.0), seed=seed)
    except RuntimeError:
      rows.append(BenchRow(name, None, best.get(name), None, time.monotonic() - started, False))
      continue
    verdict = evaluate(graph, result.choice)
    seconds = time.monotonic() - started
    known = best.get(name)
    ratio = verdict.cost / known if known and verdict.cost is not None else None
    rows.append(BenchRow(name, verdict.cost, known, ratio, seconds, verdict.feasible))
  return rows


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
