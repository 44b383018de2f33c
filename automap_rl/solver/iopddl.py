"""The IOPDDL contest format: problems in, solutions out, and its evaluator.

The ASPLOS 2025 / EuroSys 2025 contest on intra-operator parallelism
(github.com/google/iopddl) poses strategy-graph problems as JSON:
`problem.nodes.intervals` ([start, end) per node, half-open),
`problem.nodes.costs` / `problem.nodes.usages` (one list per node, one entry
per strategy), `problem.edges.nodes` ([u, v] per edge), `problem.edges.costs`
(one list per edge, row-major over strategies of u, then v) and an optional
`problem.usage_limit`. A solution is a JSON list of strategy indices, one per
node; the contest reads the last line of a solver's output.

`evaluate` follows the contest's evaluator (iopddl.cc, `Evaluate`): a wrong
length or an out-of-range index is rejected, costs are summed exactly (it uses
128-bit integers), and a usage above the limit at any time is rejected. It also
rejects plans that pick a forbidden (cost >= 1e18) node strategy or strategy
pair, which the contest scores as losing.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from automap_rl.solver.graph import (
  StrategyGraph,
  forbidden_parts,
  offsets_from_counts,
  peak_usage,
  plan_cost,
)

__all__ = ["Evaluation", "evaluate", "load_problem", "read_solution", "write_solution"]

REASON_SIZE = "Incorrect solution size"
REASON_INDEX = "Invalid strategy index"
REASON_USAGE = "Usage limit exceeded"
REASON_FORBIDDEN = "Forbidden strategy (infinite cost)"


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The contest's verdict on a solution.

  Attributes:
    cost: Exact total cost (a Python int for integer problems), None when the
      indices are unusable (wrong length or out of range).
    feasible: Whether the contest would accept the solution.
    peak_usage: Largest total usage over time, None when the indices are
      unusable.
    reason: Why it was rejected (one of the REASON_* strings), None if feasible.
  """

  cost: int | float | None
  feasible: bool
  peak_usage: int | float | None
  reason: str | None


def load_problem(path: str | Path) -> StrategyGraph:
  """Reads a contest problem (.json or .json.gz) into a StrategyGraph.

  Raises:
    ValueError: one line naming the file and the malformed field.
  """
  path = Path(path)
  saw_float = []

  def parse_float(text: str) -> float:
    saw_float.append(True)
    return float(text)

  opener = gzip.open if path.suffix == ".gz" else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      data = json.load(f, parse_float=parse_float)
  except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable JSON problem ({e})") from None
  dtype = np.float64 if saw_float else np.int64
  field = _Fields(path)
  problem = field.get(data, "problem", dict)
  nodes = field.get(problem, "nodes", dict, "problem.")
  edges = field.get(problem, "edges", dict, "problem.")
  intervals = field.get(nodes, "intervals", list, "problem.nodes.")
  costs = field.get(nodes, "costs", list, "problem.nodes.")
  usages = field.get(nodes, "usages", list, "problem.nodes.")
  pairs = field.get(edges, "nodes", list, "problem.edges.")
  edge_costs = field.get(edges, "costs", list, "problem.edges.")
  limit = problem.get("usage_limit")
  if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
    field.fail("problem.usage_limit", "must be a number")

  num_nodes = len(intervals)
  counts = field.lengths(costs, "problem.nodes.costs", num_nodes)
  if field.lengths(usages, "problem.nodes.usages", num_nodes) != counts:
    field.fail("problem.nodes.usages", "must have as many entries as problem.nodes.costs, per node")
  if min(counts, default=1) < 1:
    field.fail("problem.nodes.costs", "every node needs at least one strategy")
  interval_array = field.pairs(intervals, "problem.nodes.intervals")
  if np.any(interval_array < 0):
    field.fail("problem.nodes.intervals", "must be non-negative")
  edge_array = field.pairs(pairs, "problem.edges.nodes")
  if np.any((edge_array < 0) | (edge_array >= num_nodes)):
    field.fail("problem.edges.nodes", "must be node indices")
  sizes = field.lengths(edge_costs, "problem.edges.costs", len(edge_array))
  count_array = np.asarray(counts, dtype=np.int64)
  if not np.array_equal(sizes, count_array[edge_array[:, 0]] * count_array[edge_array[:, 1]]):
    field.fail("problem.edges.costs", "each edge needs n_u * n_v costs")

  return StrategyGraph(
    node_costs=field.values(costs, "problem.nodes.costs", sum(counts), dtype),
    node_usages=field.values(usages, "problem.nodes.usages", sum(counts), dtype),
    node_offsets=offsets_from_counts(counts),
    intervals=interval_array,
    edges=edge_array,
    edge_costs=field.values(edge_costs, "problem.edges.costs", int(sum(sizes)), dtype),
    edge_offsets=offsets_from_counts(sizes),
    usage_limit=limit,
    name=str(problem.get("name", path.name)),
  )


def write_solution(path: str | Path, choice: Sequence[int] | np.ndarray) -> None:
  """Writes a solution as the contest prints it: `[0, 0, 2, 1, 0]`."""
  Path(path).write_text(format_solution(choice) + "\n")


def format_solution(choice: Sequence[int] | np.ndarray) -> str:
  return "[" + ", ".join(str(int(s)) for s in choice) + "]"


def read_solution(path: str | Path) -> list[int]:
  """Reads a solution: the last non-empty line, a JSON list of integers."""
  lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
  try:
    choice = json.loads(lines[-1]) if lines else None
  except json.JSONDecodeError:
    choice = None
  if not isinstance(choice, list) or not all(
    isinstance(s, int) and not isinstance(s, bool) for s in choice
  ):
    raise ValueError(f"{path}: the last line must be a list of strategy indices like [0, 2, 1]")
  return choice


def evaluate(graph: StrategyGraph, choice: Sequence[int] | np.ndarray) -> Evaluation:
  """Scores a solution as the contest does, with the reason for any rejection."""
  array = np.asarray(choice)
  if array.ndim != 1 or len(array) != graph.num_nodes:
    return Evaluation(None, False, None, REASON_SIZE)
  if len(array) and (
    array.dtype.kind not in "iu" or np.any((array < 0) | (array >= graph.num_strategies))
  ):
    return Evaluation(None, False, None, REASON_INDEX)
  cost = plan_cost(graph, array)
  peak = peak_usage(graph, array)
  if graph.usage_limit is not None and peak > graph.usage_limit:
    return Evaluation(cost, False, peak, REASON_USAGE)
  nodes, edges = forbidden_parts(graph, array)
  if len(nodes) or len(edges):
    return Evaluation(cost, False, peak, REASON_FORBIDDEN)
  return Evaluation(cost, True, peak, None)


class _Fields:
  """Field access on parsed JSON with one-line errors naming file and field."""

  def __init__(self, path: Path):
    self.path = path

  def fail(self, name: str, problem: str):
    raise ValueError(f"{self.path}: field {name} {problem}")

  def get(self, obj: Any, key: str, kind: type, prefix: str = "") -> Any:
    if not isinstance(obj, dict) or key not in obj:
      self.fail(prefix + key, "is missing")
    if not isinstance(obj[key], kind):
      self.fail(prefix + key, f"must be a JSON {'object' if kind is dict else 'list'}")
    return obj[key]

  def lengths(self, rows: list, name: str, count: int) -> list[int]:
    if len(rows) != count:
      self.fail(name, f"has {len(rows)} entries, expected {count}")
    if not all(isinstance(row, list) for row in rows):
      self.fail(name, "must be a list of lists")
    return [len(row) for row in rows]

  def pairs(self, rows: list, name: str) -> np.ndarray:
    try:
      array = np.array(rows, dtype=np.int64).reshape(len(rows), 2)
    except (TypeError, ValueError, OverflowError):
      self.fail(name, "must be a list of [int, int] pairs")
    return array

  def values(self, rows: list, name: str, count: int, dtype: type) -> np.ndarray:
    flat = itertools.chain.from_iterable(rows)
    try:
      return np.fromiter(flat, dtype=dtype, count=count)
    except (TypeError, ValueError, OverflowError):
      self.fail(name, "must hold numbers within 64 bits")
