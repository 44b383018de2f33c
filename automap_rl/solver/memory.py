"""The usage limit over group strategies, on compressed time.

Only nodes whose usage depends on their group's strategy ("members") can
change the usage profile; every other node adds a fixed amount over its
interval. Time is cut into segments at the members' interval ends, so the set
of live members is constant inside a segment, and each segment's capacity is
the limit minus the largest fixed usage inside it. A plan is feasible iff in
every segment its live members' usages sum to at most the capacity.

A segment whose live members are a strict subset of a neighbour's, with at
least as much capacity, can never be the binding one (usages are
non-negative), so it is dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap_rl.solver.graph import StrategyGraph, offsets_from_counts
from automap_rl.solver.reduce import Reduced

__all__ = ["Memory", "build_memory"]


@dataclasses.dataclass(frozen=True, eq=False)
class Memory:
  """Members and segments of the usage constraint.

  Let M members (nodes whose usage depends on the strategy) and S segments.

  Attributes:
    capacity: [S] int64 or float64, usage allowed to members in each segment.
    member_group: [M] int64, the group of each member.
    member_first: [M] int64, first segment the member is live in.
    member_last: [M] int64, one past the last segment it is live in.
    member_offsets: [M + 1] int64, start of each member's usages.
    member_usage: [sum over members of k_group] usage of the member under
      each strategy of its group.
  """

  capacity: np.ndarray
  member_group: np.ndarray
  member_first: np.ndarray
  member_last: np.ndarray
  member_offsets: np.ndarray
  member_usage: np.ndarray

  @property
  def num_segments(self) -> int:
    return len(self.capacity)

  def member_usages(self, group_choice: np.ndarray) -> np.ndarray:
    """[M] usage of each member under a group plan."""
    return self.member_usage[self.member_offsets[:-1] + group_choice[self.member_group]]

  def profile(self, group_choice: np.ndarray) -> np.ndarray:
    """[S] members' total usage in each segment under a group plan."""
    return self.profile_of(self.member_usages(group_choice))

  def profile_of(self, usages: np.ndarray) -> np.ndarray:
    """[S] total usage per segment from [M] member usages."""
    total = self.live_sum(usages)
    return np.rint(total).astype(np.int64) if self.capacity.dtype.kind == "i" else total

  def live_sum(self, values: np.ndarray) -> np.ndarray:
    """[S] float64: per segment, the sum of `values` ([M], one per member) over the members
    live in it."""
    delta = np.bincount(self.member_first, weights=values, minlength=self.num_segments + 1)
    delta -= np.bincount(self.member_last, weights=values, minlength=self.num_segments + 1)
    return np.cumsum(delta[:-1])

  def excess(self, group_choice: np.ndarray) -> np.ndarray:
    """[S] usage above capacity per segment (<= 0 where within the limit)."""
    return self.profile(group_choice) - self.capacity


def build_memory(graph: StrategyGraph, reduced: Reduced) -> Memory:
  """The usage constraint of `graph` over `reduced`'s groups.

  Raises:
    ValueError: if the fixed usage alone exceeds the limit somewhere.
  """
  limit = graph.usage_limit
  start, end = graph.intervals[:, 0], graph.intervals[:, 1]
  map_offsets, node_map = reduced.node_map_offsets, reduced.node_map
  counts = np.diff(map_offsets)
  entry_node = np.repeat(np.arange(graph.num_nodes), counts)
  usage = graph.node_usages[graph.node_offsets[entry_node] + node_map]
  low = np.minimum.reduceat(usage, map_offsets[:-1]) if len(usage) else usage
  high = np.maximum.reduceat(usage, map_offsets[:-1]) if len(usage) else usage
  live = start < end
  varying = live & (low != high) if limit is not None else np.zeros_like(live)
  fixed = live & ~varying

  horizon = int(end.max(initial=0))
  delta = np.zeros(horizon + 1, dtype=usage.dtype)
  np.add.at(delta, start[fixed], low[fixed])
  np.add.at(delta, end[fixed], -low[fixed])
  base = np.cumsum(delta[:-1])
  if limit is not None and base.max(initial=0) > limit:
    raise ValueError(
      "StrategyGraph: the usage that no strategy choice changes already exceeds the limit"
    )

  members = np.flatnonzero(varying)
  cuts = np.unique(np.concatenate([start[members], end[members]]))
  capacity = (
    limit - np.maximum.reduceat(base[: cuts[-1]], cuts[:-1])
    if len(cuts) > 1
    else np.zeros(0, usage.dtype)
  )
  first = np.searchsorted(cuts, start[members])
  last = np.searchsorted(cuts, end[members])
  starts_at = np.bincount(first, minlength=len(cuts)) > 0
  ends_at = np.bincount(last, minlength=len(cuts)) > 0
  if len(usage) and usage.min() >= 0 and len(capacity):
    keep = _undominated(capacity, starts_at, ends_at)
    first, last, capacity = _compact(keep, first, last, capacity)
  entries = (
    np.concatenate([np.arange(map_offsets[m], map_offsets[m + 1]) for m in members])
    if len(members)
    else np.zeros(0, np.int64)
  )
  return Memory(
    capacity=capacity,
    member_group=reduced.node_group[members],
    member_first=first,
    member_last=last,
    member_offsets=offsets_from_counts(counts[members]),
    member_usage=usage[entries],
  )


def _undominated(capacity: np.ndarray, starts_at: np.ndarray, ends_at: np.ndarray) -> np.ndarray:
  """[S] bool: segments not dominated by a neighbour.

  Segment i spans cuts i..i+1. Across cut i+1 the live set only grows when
  members only start there, so segment i is dominated by i + 1 if it has no
  less capacity; symmetrically across cut i when members only end there.
  """
  only_starts = starts_at & ~ends_at
  only_ends = ends_at & ~starts_at
  keep = np.ones(len(capacity), bool)
  keep[:-1] &= ~(only_starts[1:-1] & (capacity[:-1] >= capacity[1:]))
  keep[1:] &= ~(only_ends[1:-1] & (capacity[1:] >= capacity[:-1]))
  return keep


def _compact(keep: np.ndarray, first: np.ndarray, last: np.ndarray, capacity: np.ndarray):
  """Renumbers member ranges onto the kept segments only."""
  rank = np.concatenate([[0], np.cumsum(keep)])
  return rank[first], rank[last], capacity[keep]
