"""Local search over group plans: incremental costs, descent, budgeted plans.

`Plan` keeps a group plan together with, for every group strategy, the cost
of switching to it (its unary cost plus its pair costs against the current
strategies of the neighbours), and the usage in every segment. A switch costs
one small update per incident pair and one add over the switched group's time
span, so coordinate descent over thousands of groups runs in Python. `Budget`
builds a plan group by group that stays within the limit by construction.

Usage checks are per "piece": the cuts between a group's members' first and
last segments split its span into pieces within which the group's own usage
is constant, so `[pieces, k]` tables of its usage per strategy (built once)
and the tightest slack of each piece decide every switch of that group.
"""

from __future__ import annotations

import numpy as np

from automap_rl.solver.memory import Memory
from automap_rl.solver.reduce import Reduced

__all__ = ["Budget", "Layout", "Plan"]


class Layout:
  """Per-group adjacency and usage tables, built once per problem."""

  def __init__(self, reduced: Reduced, memory: Memory):
    self.reduced, self.memory = reduced, memory
    groups = reduced.num_groups
    self.incident: list[list[tuple[int, int]]] = [[] for _ in range(groups)]
    for p, (g, h) in enumerate(reduced.pairs.tolist()):
      self.incident[g].append((p, 0))
      self.incident[h].append((p, 1))
    order = np.argsort(memory.member_group, kind="stable")
    bounds = np.searchsorted(memory.member_group[order], np.arange(groups + 1))
    self.cuts: list[np.ndarray] = []  # per group: sorted segment cuts of its pieces
    self.usage: list[np.ndarray] = []  # per group: [pieces, k] usage per strategy
    self.lowest: list[np.ndarray] = []  # per group: [pieces] sum of its members' least usages
    for g in range(groups):
      members = order[bounds[g]:bounds[g + 1]]
      k = int(reduced.counts[g])
      if not len(members):
        self.cuts.append(np.zeros(1, np.int64))
        self.usage.append(np.zeros((0, k), memory.member_usage.dtype))
        self.lowest.append(np.zeros(0, memory.member_usage.dtype))
        continue
      first, last = memory.member_first[members], memory.member_last[members]
      cuts = np.unique(np.concatenate([first, last]))
      rows = memory.member_usage[memory.member_offsets[members][:, None] + np.arange(k)]
      delta = np.zeros((len(cuts), k), rows.dtype)
      np.add.at(delta, np.searchsorted(cuts, first), rows)
      np.subtract.at(delta, np.searchsorted(cuts, last), rows)
      low = np.zeros(len(cuts), rows.dtype)
      np.add.at(low, np.searchsorted(cuts, first), rows.min(axis=1))
      np.subtract.at(low, np.searchsorted(cuts, last), rows.min(axis=1))
      self.cuts.append(cuts)
      self.usage.append(np.cumsum(delta[:-1], axis=0))
      self.lowest.append(np.cumsum(low[:-1]))


class Plan:
  """A group plan with incremental switch costs and usage profile."""

  def __init__(self, layout: Layout, choice: np.ndarray):
    self.layout = layout
    self.choice = np.array(choice, dtype=np.int64)
    self.profile = layout.memory.profile(self.choice)
    # Switch costs are kept as a finite part plus a count of forbidden
    # (infinite) terms, so that they can be updated by differences.
    self._finite, self._forbidden = self._local_costs()
    self.local = np.where(self._forbidden > 0, np.inf, self._finite)

  def _local_costs(self) -> tuple[np.ndarray, np.ndarray]:
    """[V] unary cost plus pair costs against the neighbours' current
    strategies: (sum of the finite terms, number of infinite terms)."""
    reduced, z = self.layout.reduced, self.choice
    finite = reduced.unary.copy()
    forbidden = np.zeros(len(finite))
    k_h = reduced.counts[reduced.pairs[:, 1]]
    for side in (0, 1):
      mine, other = reduced.pairs[:, side], reduced.pairs[:, 1 - side]
      k = reduced.counts[mine]
      p = np.repeat(np.arange(len(reduced.pairs)), k)
      s = np.arange(len(p)) - np.repeat(np.cumsum(k) - k, k)
      row, col = (s, z[other[p]]) if side == 0 else (z[other[p]], s)
      entry = reduced.pair_offsets[p] + row * k_h[p] + col
      cost, var = reduced.pair_costs[entry], reduced.offsets[mine[p]] + s
      blocked = np.isinf(cost)
      finite += np.bincount(var, weights=np.where(blocked, 0.0, cost), minlength=len(finite))
      forbidden += np.bincount(var, weights=blocked, minlength=len(finite))
    return finite, forbidden

  def excess(self) -> np.ndarray:
    """[S] usage above capacity per segment."""
    return self.profile - self.layout.memory.capacity

  def switch_costs(self, g: int) -> np.ndarray:
    """[k] cost change of switching group g to each strategy."""
    offsets = self.layout.reduced.offsets
    local = self.local[offsets[g]:offsets[g + 1]]
    current = local[self.choice[g]]
    if np.isinf(current):  # leaving a forbidden strategy: any finite one is better
      return np.where(np.isinf(local), 0.0, -np.inf)
    return local - current

  def usage_change(self, g: int) -> tuple[np.ndarray, np.ndarray]:
    """([pieces, k] usage change per piece and strategy, [pieces] slack of
    each piece: the smallest capacity minus usage inside it)."""
    cuts, usage = self.layout.cuts[g], self.layout.usage[g]
    if not len(usage):
      return usage, np.zeros(0)
    slack = self.layout.memory.capacity[cuts[0]:cuts[-1]] - self.profile[cuts[0]:cuts[-1]]
    slack = np.minimum.reduceat(slack, cuts[:-1] - cuts[0])
    return usage - usage[:, [self.choice[g]]], slack

  def feasible_switches(self, g: int) -> np.ndarray:
    """[k] bool: switches of g that keep every segment within capacity (or,
    in segments already over it, do not add usage)."""
    change, slack = self.usage_change(g)
    return np.all(change <= np.maximum(slack, 0)[:, None], axis=0)

  def switch(self, g: int, s: int) -> None:
    """Sets group g to strategy s, updating neighbours' switch costs and usage."""
    old = int(self.choice[g])
    if s == old:
      return
    reduced = self.layout.reduced
    offsets = reduced.offsets
    for p, side in self.layout.incident[g]:
      matrix = reduced.pair_matrix(p)
      other = int(reduced.pairs[p, 1 - side])
      new, before = (matrix[s], matrix[old]) if side == 0 else (matrix[:, s], matrix[:, old])
      span = slice(offsets[other], offsets[other + 1])
      new_blocked, old_blocked = np.isinf(new), np.isinf(before)
      self._finite[span] += np.where(new_blocked, 0.0, new) - np.where(old_blocked, 0.0, before)
      self._forbidden[span] += new_blocked.astype(np.float64) - old_blocked
      self.local[span] = np.where(self._forbidden[span] > 0, np.inf, self._finite[span])
    cuts, usage = self.layout.cuts[g], self.layout.usage[g]
    if len(usage):
      self.profile[cuts[0]:cuts[-1]] += np.repeat(usage[:, s] - usage[:, old], np.diff(cuts))
    self.choice[g] = s

  def descend(self, order: np.ndarray, min_gain: float = 0.0) -> int:
    """One pass of coordinate descent in `order` over the groups that had a
    cheaper strategy when it started; each takes its cheapest switch that
    keeps the plan within the limit. Returns the number of switches."""
    offsets = self.layout.reduced.offsets
    cheapest = np.minimum.reduceat(self.local, offsets[:-1]) if len(self.choice) else self.local
    hopeful = cheapest < self.local[offsets[:-1] + self.choice] - min_gain
    switches = 0
    for g in order[hopeful[order]].tolist():
      delta = self.switch_costs(g)
      better = delta < -min_gain
      if not better.any():
        continue
      ok = better & self.feasible_switches(g)
      if ok.any():
        s = int(np.argmin(np.where(ok, delta, np.inf)))
        self.switch(g, s)
        switches += 1
    return switches


class Budget:
  """Builds a plan group by group within the usage limit.

  Groups not yet chosen are counted at their members' least usages (a lower
  bound), so as long as that is within the limit every choice that fits keeps
  a completion within the limit possible.
  """

  def __init__(self, layout: Layout):
    self.layout = layout
    memory = layout.memory
    lowest = np.minimum.reduceat(memory.member_usage, memory.member_offsets[:-1]) \
        if len(memory.member_usage) else memory.member_usage
    self.profile = memory.profile_of(lowest)

  def pick(self, g: int, values: np.ndarray) -> int:
    """Commits group g to its cheapest strategy (by `values`) that fits, or
    to the one that overshoots least if none does."""
    cuts, usage, lowest = self.layout.cuts[g], self.layout.usage[g], self.layout.lowest[g]
    if not len(usage):
      return int(np.argmin(values))
    slack = self.layout.memory.capacity[cuts[0]:cuts[-1]] - self.profile[cuts[0]:cuts[-1]]
    slack = np.minimum.reduceat(slack, cuts[:-1] - cuts[0])
    over = np.max(usage - lowest[:, None] - slack[:, None], axis=0)
    fits = over <= 0
    s = int(np.argmin(np.where(fits, values, np.inf))) if fits.any() else int(np.argmin(over))
    self.profile[cuts[0]:cuts[-1]] += np.repeat(usage[:, s] - lowest, np.diff(cuts))
    return s
