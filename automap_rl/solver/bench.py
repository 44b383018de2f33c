"""Benchmark: the solver on the IOPDDL contest instances against the best known costs.

`bench_iopddl` solves each `asplos-2025-iopddl-*.json[.gz]` of a directory in
turn (one at a time: each solve uses `workers` processes) and compares with the
directory's `best_known.csv` (columns instance, best_known_cost, ...). The
timeout covers loading as well as solving, as in the contest. With `copies` > 1
each instance is first `tile`d into that many independent copies (a synthetic
instance whose optimum is `copies` times the original's), compared with
`copies` times the best known cost; building the copies counts as loading.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path

from automap_rl.solver.graph import tile
from automap_rl.solver.iopddl import evaluate, load_problem
from automap_rl.solver.solve import solve

__all__ = ["BenchRow", "bench_iopddl", "contest_points", "geometric_mean"]

_INSTANCE = re.compile(r"asplos-2025-iopddl-([A-Za-z0-9]+)\.json(\.gz)?$")


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
  """

  instance: str
  cost: int | float | None
  best_known: int | None
  ratio: float | None
  seconds: float
  feasible: bool
  stopped_by: str | None = None
  failure: str | None = None


def bench_iopddl(
  directory: str | Path,
  timeout_s: float,
  seed: int,
  instances: Sequence[str] | None = None,
  workers: int = 2,
  copies: int = 1,
) -> list[BenchRow]:
  """Solves the contest instances in `directory` (all, or those named), each tiled into `copies`."""
  directory = Path(directory)
  best = _best_known(directory / "best_known.csv")
  files = sorted(p for p in directory.iterdir() if _INSTANCE.search(p.name))
  rows = []
  for path in files:
    name = _INSTANCE.search(path.name).group(1)
    if instances is not None and name not in instances:
      continue
    started = time.monotonic()
    graph = tile(load_problem(path), copies)
    label = name if copies == 1 else f"{name} x{copies}"
    known = best[name] * copies if name in best else None
    try:
      result = solve(
        graph,
        timeout_s=max(timeout_s - (time.monotonic() - started), 1.0),
        seed=seed,
        workers=workers,
      )
    except (
      RuntimeError
    ) as e:  # No plan within the limit, `LimitReached` before one, or `GraphTooLarge`.
      rows.append(
        BenchRow(
          label,
          None,
          known,
          None,
          time.monotonic() - started,
          False,
          getattr(e, "limit", None),
          str(e),
        )
      )
      continue
    verdict = evaluate(graph, result.choice)
    seconds = time.monotonic() - started
    ratio = verdict.cost / known if known and verdict.cost is not None else None
    rows.append(
      BenchRow(label, verdict.cost, known, ratio, seconds, verdict.feasible, result.stopped_by)
    )
  return rows


def contest_points(rows: Sequence[BenchRow]) -> float:
  """The contest's score: the sum over instances of best known / ours (0 for no feasible plan)."""
  return sum(
    row.best_known / row.cost for row in rows if row.feasible and row.cost and row.best_known
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
