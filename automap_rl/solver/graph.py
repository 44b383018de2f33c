"""Strategy graphs: the intra-operator sharding problem as plain arrays.

A `StrategyGraph` has one node per op (or tensor). Each node offers a few
strategies (ways to shard it), each with a cost and a memory usage; the usage
counts during the node's live interval [start, end) (half-open, as in the IOPDDL
contest). Each edge (u, v) has a cost for every pair of strategies of u and v.
A plan picks one strategy per node; its cost is the sum of the chosen node costs
and edge costs, and it is feasible when at every time t the usages of the nodes
live at t sum to at most `usage_limit`.

Costs at or above `FORBIDDEN` (the contest's "infinite", 1e18), or infinite
floats, mark strategies and strategy pairs that must not be chosen. Integer
inputs are summed exactly (as Python ints, the contest's 128-bit totals); float
inputs are summed as floats, so graphs built from a cost model work as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = [
  "FORBIDDEN",
  "StrategyGraph",
  "forbidden_parts",
  "is_feasible",
  "is_forbidden",
  "offsets_from_counts",
  "peak_usage",
  "plan_cost",
  "separable_lower_bound",
  "tile",
  "usage_profile",
]

FORBIDDEN = 10**18


@dataclasses.dataclass(frozen=True, eq=False)
class StrategyGraph:
  """Nodes with strategies, pairwise edge costs and a memory limit.

  Ragged per-node and per-edge data are stored flat with offsets, so node i's
  strategies are `node_costs[node_offsets[i]:node_offsets[i + 1]]` and edge
  e's cost matrix is `edge_matrix(e)`. Let N nodes, S = sum of strategy counts,
  E edges and C = sum over edges of n_u * n_v.

  Attributes:
    node_costs: [S] int64 or float64, cost of each strategy of each node.
    node_usages: [S] int64 or float64, memory of each strategy while live.
    node_offsets: [N + 1] int64, start of each node's strategies in the above.
    intervals: [N, 2] int64, live range [start, end) of each node; start >= end
      means the node never holds memory.
    edges: [E, 2] int64, the (u, v) node pair of each edge.
    edge_costs: [C] int64 or float64, each edge's [n_u, n_v] matrix row-major.
    edge_offsets: [E + 1] int64, start of each edge's matrix in `edge_costs`.
    usage_limit: Memory limit at every time, or None for no limit.
    name: Free-form label (the instance name).
  """

  node_costs: np.ndarray
  node_usages: np.ndarray
  node_offsets: np.ndarray
  intervals: np.ndarray
  edges: np.ndarray
  edge_costs: np.ndarray
  edge_offsets: np.ndarray
  usage_limit: int | float | None
  name: str = ""

  def __post_init__(self):
    n = len(self.node_offsets) - 1
    counts = np.diff(self.node_offsets)
    _check(n >= 0 and self.node_offsets[0] == 0, "node_offsets must start at 0")
    _check(bool(np.all(counts >= 1)), "every node needs at least one strategy")
    _check(
      len(self.node_costs) == self.node_offsets[-1], "node_costs length differs from node_offsets"
    )
    _check(
      len(self.node_usages) == len(self.node_costs), "node_usages length differs from node_costs"
    )
    _check(self.intervals.shape == (n, 2), "intervals must have shape [num_nodes, 2]")
    _check(bool(np.all(self.intervals >= 0)), "intervals must be non-negative")
    e = len(self.edge_offsets) - 1
    _check(self.edges.shape == (e, 2), "edges must have shape [num_edges, 2]")
    _check(
      bool(np.all((self.edges >= 0) & (self.edges < n))), "edge endpoints must be node indices"
    )
    sizes = counts[self.edges[:, 0]] * counts[self.edges[:, 1]] if e else np.zeros(0, np.int64)
    _check(
      bool(np.array_equal(np.diff(self.edge_offsets), sizes)), "edge cost counts must be n_u * n_v"
    )
    _check(
      len(self.edge_costs) == self.edge_offsets[-1], "edge_costs length differs from edge_offsets"
    )

  @classmethod
  def from_lists(
    cls,
    node_costs: Sequence[Sequence[float]],
    node_usages: Sequence[Sequence[float]],
    intervals: Sequence[Sequence[int]],
    edges: Sequence[Sequence[int]],
    edge_costs: Sequence[Sequence[float]],
    usage_limit: float | None,
    name: str = "",
  ) -> StrategyGraph:
    """Builds a graph from nested lists (one list per node or edge)."""
    counts = [len(c) for c in node_costs]
    if [len(u) for u in node_usages] != counts:
      raise ValueError("node_usages must have one entry per strategy in node_costs")
    edge_sizes = [len(c) for c in edge_costs]
    if len(edge_sizes) != len(edges):
      raise ValueError("edge_costs must have one list per edge")
    return cls(
      node_costs=_flat(node_costs),
      node_usages=_flat(node_usages),
      node_offsets=offsets_from_counts(counts),
      intervals=np.asarray(intervals, dtype=np.int64).reshape(len(counts), 2),
      edges=np.asarray(edges, dtype=np.int64).reshape(len(edge_sizes), 2),
      edge_costs=_flat(edge_costs),
      edge_offsets=offsets_from_counts(edge_sizes),
      usage_limit=usage_limit,
      name=name,
    )

  @property
  def num_nodes(self) -> int:
    return len(self.node_offsets) - 1

  @property
  def num_edges(self) -> int:
    return len(self.edge_offsets) - 1

  @property
  def num_strategies(self) -> np.ndarray:
    """[N] int64, how many strategies each node has."""
    return np.diff(self.node_offsets)

  def edge_matrix(self, e: int) -> np.ndarray:
    """[n_u, n_v] view of edge e's costs."""
    u, v = self.edges[e]
    counts = self.num_strategies
    return self.edge_costs[self.edge_offsets[e] : self.edge_offsets[e + 1]].reshape(
      counts[u], counts[v]
    )


def is_forbidden(costs: np.ndarray) -> np.ndarray:
  """Elementwise: is this cost 'infinite' (>= FORBIDDEN, inf or NaN)?"""
  costs = np.asarray(costs)
  if costs.dtype.kind == "f":
    return ~(costs < FORBIDDEN)
  return costs >= FORBIDDEN


def plan_cost(graph: StrategyGraph, choice: Sequence[int] | np.ndarray) -> int | float:
  """Total cost of a plan: chosen node costs plus chosen edge costs.

  Exact for integer graphs (a Python int; forbidden entries are summed like any
  other, as the contest's evaluator does); a float for float graphs.
  """
  node_idx, edge_idx = _chosen_indices(graph, _as_choice(graph, choice))
  return _exact_sum(graph.node_costs[node_idx]) + _exact_sum(graph.edge_costs[edge_idx])


def separable_lower_bound(graph: StrategyGraph) -> float:
  """A lower bound on the cost of every plan without a forbidden cost: each node's cheapest
  allowed strategy plus each edge's cheapest allowed pair, chosen apart (memory ignored).

  Weak but needs no reduction, so it bounds graphs too large to solve. Raises ValueError
  when some node or edge allows nothing (no plan is allowed)."""
  parts = []
  for costs, offsets in (
    (graph.node_costs, graph.node_offsets),
    (graph.edge_costs, graph.edge_offsets),
  ):
    if len(offsets) < 2:
      continue
    allowed = np.where(is_forbidden(costs), np.inf, costs.astype(np.float64))
    cheapest = np.minimum.reduceat(allowed, offsets[:-1])
    if not np.all(np.isfinite(cheapest)):
      raise ValueError(f"{graph.name or 'the graph'}: some node or edge allows no strategy")
    parts.append(float(cheapest.sum()))
  return sum(parts)


def forbidden_parts(
  graph: StrategyGraph, choice: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """(nodes, edges): indices of nodes and edges whose chosen cost is forbidden."""
  node_idx, edge_idx = _chosen_indices(graph, _as_choice(graph, choice))
  return (
    np.flatnonzero(is_forbidden(graph.node_costs[node_idx])),
    np.flatnonzero(is_forbidden(graph.edge_costs[edge_idx])),
  )


def usage_profile(graph: StrategyGraph, choice: Sequence[int] | np.ndarray) -> np.ndarray:
  """[T] total usage at each time 0 <= t < T, T = the latest interval end."""
  choice = _as_choice(graph, choice)
  usage = graph.node_usages[graph.node_offsets[:-1] + choice]
  start, end = graph.intervals[:, 0], graph.intervals[:, 1]
  live = start < end
  horizon = int(end.max(initial=0))
  if usage.dtype.kind == "i" and not _fits_int64(usage[live]):
    usage = usage.astype(object)
  delta = np.zeros(horizon + 1, dtype=usage.dtype)
  np.add.at(delta, start[live], usage[live])
  np.add.at(delta, end[live], -usage[live])
  return np.cumsum(delta[:-1])


def peak_usage(graph: StrategyGraph, choice: Sequence[int] | np.ndarray) -> int | float:
  """Largest total usage over time (0 when no node is ever live)."""
  profile = usage_profile(graph, choice)
  peak = profile.max(initial=0)
  return int(peak) if profile.dtype.kind in "iO" else float(peak)


def is_feasible(graph: StrategyGraph, choice: Sequence[int] | np.ndarray) -> bool:
  """Valid indices, nothing forbidden, and never above the usage limit."""
  try:
    nodes, edges = forbidden_parts(graph, choice)
  except ValueError:
    return False
  if len(nodes) or len(edges):
    return False
  return graph.usage_limit is None or peak_usage(graph, choice) <= graph.usage_limit


def _as_choice(graph: StrategyGraph, choice: Sequence[int] | np.ndarray) -> np.ndarray:
  """Validated [N] int64 strategy indices (ValueError on a wrong length or index)."""
  array = np.asarray(choice)
  if array.ndim != 1 or len(array) != graph.num_nodes:
    raise ValueError(
      f"a plan needs one strategy per node: got {array.shape}, expected ({graph.num_nodes},)"
    )
  if len(array) and array.dtype.kind not in "iu":
    raise ValueError("strategy indices must be integers")
  array = array.astype(np.int64)
  if np.any((array < 0) | (array >= graph.num_strategies)):
    raise ValueError("strategy index out of range")
  return array


def _chosen_indices(graph: StrategyGraph, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """([N], [E]) flat indices of the chosen node costs and edge costs."""
  counts = graph.num_strategies
  u, v = graph.edges[:, 0], graph.edges[:, 1]
  return graph.node_offsets[:-1] + choice, graph.edge_offsets[:-1] + choice[u] * counts[v] + choice[
    v
  ]


def _fits_int64(values: np.ndarray) -> bool:
  """Can the sum of these int64 values not overflow?"""
  return len(values) == 0 or int(np.abs(values).max()) < (2**63 - 1) // len(values)


def _exact_sum(values: np.ndarray) -> int | float:
  if values.dtype.kind == "f":
    return float(values.sum())
  if _fits_int64(values):
    return int(values.sum())
  return sum(values.tolist())


def _flat(lists: Sequence[Sequence[float]]) -> np.ndarray:
  values = [x for row in lists for x in row]
  if not values:
    return np.zeros(0, np.int64)
  array = np.asarray(values)
  if array.dtype.kind not in "iuf":
    raise ValueError("StrategyGraph: costs and usages must be numbers within int64 or float64")
  return array.astype(np.float64 if array.dtype.kind == "f" else np.int64)


def tile(graph: StrategyGraph, copies: int) -> StrategyGraph:
  """`copies` independent copies of `graph` one after another in time (copy i's intervals
  shifted by i times the horizon), under the same usage limit: a problem `copies` times
  larger whose optimum is exactly `copies` times the graph's (a synthetic instance for
  measuring how a solver degrades with size).

  Raises:
    ValueError: if `copies` < 1.
  """
  if copies < 1:
    raise ValueError(f"tile: copies must be at least 1, got {copies}")
  horizon = int(graph.intervals.max(initial=0))
  shift = np.repeat(np.arange(copies, dtype=np.int64) * horizon, graph.num_nodes)[:, None]
  live = np.tile(graph.intervals[:, 0] < graph.intervals[:, 1], copies)[:, None]
  return StrategyGraph(
    node_costs=np.tile(graph.node_costs, copies),
    node_usages=np.tile(graph.node_usages, copies),
    node_offsets=offsets_from_counts(np.tile(graph.num_strategies, copies)),
    intervals=np.where(live, np.tile(graph.intervals, (copies, 1)) + shift, 0),
    edges=(
      np.tile(graph.edges, (copies, 1))
      + np.repeat(np.arange(copies, dtype=np.int64) * graph.num_nodes, graph.num_edges)[:, None]
    ),
    edge_costs=np.tile(graph.edge_costs, copies),
    edge_offsets=offsets_from_counts(np.tile(np.diff(graph.edge_offsets), copies)),
    usage_limit=graph.usage_limit,
    name=f"{graph.name} x{copies}" if copies > 1 else graph.name,
  )


def offsets_from_counts(counts: Sequence[int] | np.ndarray) -> np.ndarray:
  """[len(counts) + 1] int64 offsets of consecutive runs of these lengths."""
  offsets = np.zeros(len(counts) + 1, dtype=np.int64)
  np.cumsum(counts, out=offsets[1:])
  return offsets


def _check(condition: bool, message: str) -> None:
  if not condition:
    raise ValueError(f"StrategyGraph: {message}")
