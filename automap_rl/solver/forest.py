"""Exact moves over induced forests of the pair graph (block coordinate descent).

A move draws groups in random order and keeps each one whose kept neighbours lie in distinct
trees (a union-find over the kept groups), so that the kept groups induce a forest of the
pair graph. With every other group fixed at its strategy, the pair costs to fixed groups
become unary costs, and the kept groups' best strategies are found exactly by min-sum
dynamic programming over each tree (messages from the leaves to the root, then the choices
back down): a move re-chooses most groups of the problem at once (on contest instance N,
6,600-6,850 of its 7,754 groups of more than one strategy), where a MIP neighbourhood
re-chooses hundreds. Memory is shared out before the move: each kept group's node draws a
random weight, each segment's slack under the limit is split among the nodes live in it in
proportion to their weights, and a node may use more than it does now by its weight times
the least of its segments' slack per unit of weight. The kept groups together never take
more than any segment's slack, so a plan within the limit stays within it (a segment
already over it gets no share); the random weights let a different few nodes grow at each
move (on N, from a plan at 1.106 of the contest's best, 30 moves reach 1.078-1.080, where
even shares reach 1.084 and no growth 1.103). A move never returns a costlier plan: the
current strategies are among those the dynamic programme minimises over, and it keeps them
where they tie.
"""

from __future__ import annotations

import time

import numpy as np

from automap_rl.solver.local import Layout
from automap_rl.solver.mip import group_cost

__all__ = ["ForestMoves"]


class ForestMoves:
  """Forest moves on one problem: its neighbour lists and usage tables, built once."""

  def __init__(self, layout: Layout):
    self.reduced, self.memory = layout.reduced, layout.memory
    reduced, memory = self.reduced, self.memory
    self.pair_of = [[p for p, _ in incident] for incident in layout.incident]
    self.neighbours = layout.neighbours
    self.sides = [[side for _, side in incident] for incident in layout.incident]
    self.movable = np.flatnonzero(reduced.counts > 1)
    self.member_entry = np.repeat(
      np.arange(len(memory.member_group)), np.diff(memory.member_offsets)
    )
    self.entry_var = (
      reduced.offsets[memory.member_group[self.member_entry]]
      + np.arange(len(self.member_entry))
      - memory.member_offsets[self.member_entry]
    )

  def move(self, choice: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[G] the best plan that differs from `choice` ([G]) only on one random induced forest's
    groups, each at a strategy whose nodes use at most their share of the slack more than
    now (ties keep `choice`)."""
    reduced, memory = self.reduced, self.memory
    counts, offsets = reduced.counts, reduced.offsets
    kept = self._random_forest(rng)
    excess = memory.excess(choice)
    allowed = memory.member_usages(choice) + self._slack_shares(excess, kept, rng)
    barred = (
      np.bincount(
        self.entry_var,
        weights=memory.member_usage > allowed[self.member_entry],
        minlength=offsets[-1],
      )
      > 0
    )
    unary = np.where(barred, np.inf, reduced.unary)
    # Pairs to fixed groups become unary costs of the kept end.
    g, h = reduced.pairs[:, 0], reduced.pairs[:, 1]
    for side, (mine, theirs) in enumerate(((g, h), (h, g))):
      to_fixed = np.flatnonzero(kept[mine] & ~kept[theirs])
      k = counts[mine[to_fixed]]
      local = np.arange(k.sum()) - np.repeat(np.cumsum(k) - k, k)
      pair = np.repeat(to_fixed, k)
      fixed = choice[theirs[pair]]
      entry = reduced.pair_offsets[pair] + (
        local * counts[h[pair]] + fixed if side == 0 else fixed * counts[h[pair]] + local
      )
      unary += np.bincount(
        offsets[mine[pair]] + local, weights=reduced.pair_costs[entry], minlength=offsets[-1]
      )
    # Min-sum over each tree, from the leaves up; `totals[v]` gathers v's subtree.
    totals = {v: unary[offsets[v] : offsets[v + 1]].copy() for v in np.flatnonzero(kept).tolist()}
    best = np.array(choice)
    seen = np.zeros(reduced.num_groups, bool)
    for root in totals:
      if seen[root]:
        continue
      seen[root] = True
      order, parent_of = [root], {}
      for v in order:  # breadth first: `order` grows while it is read
        for w, p, side in zip(self.neighbours[v], self.pair_of[v], self.sides[v]):
          if kept[w] and not seen[w]:
            seen[w] = True
            parent_of[w] = (v, p, side)
            order.append(w)
      argmin = {}
      for v in reversed(order[1:]):
        parent, p, side = parent_of[v]
        matrix = reduced.pair_matrix(p)
        through = (matrix if side == 0 else matrix.T) + totals[v][None, :]  # [k_parent, k_v]
        argmin[v] = _first_argmin(through, choice[v])
        totals[parent] += through[np.arange(len(through)), argmin[v]]
      best[root] = _first_argmin(totals[root][None, :], choice[root])[0]
      for v in order[1:]:
        best[v] = argmin[v][best[parent_of[v][0]]]
    # The shares add up to each segment's slack up to rounding (`_slack_shares`): a move that
    # rounding took past it is not made.
    if np.any(memory.excess(best) > np.maximum(excess, 0)):
      return np.array(choice)
    return best

  def descend(
    self,
    choice: np.ndarray,
    rng: np.random.Generator,
    patience: int,
    min_gain: float,
    until: float = np.inf,
  ) -> np.ndarray:
    """[G] moves from `choice` until `patience` in a row each gain less than `min_gain` of
    the cost (or the monotonic clock passes `until`); never costlier than `choice`, within
    the limit if it is."""
    cost = group_cost(self.reduced, choice)
    idle = 0
    while idle < patience and time.monotonic() < until:
      moved = self.move(choice, rng)
      moved_cost = group_cost(self.reduced, moved)
      idle = idle + 1 if cost - moved_cost <= min_gain * abs(cost) else 0
      if moved_cost <= cost:
        choice, cost = moved, moved_cost
    return choice

  def _slack_shares(
    self, excess: np.ndarray, kept: np.ndarray, rng: np.random.Generator
  ) -> np.ndarray:
    """[M] how much more each member may use: an exponential weight for each member of a
    `kept` ([G] bool) group, 0 for the others, times the least slack per unit of weight over
    the segments the member is live in. A segment's slack is -`excess` ([S], the plan's usage
    above capacity), 0 where the plan is over it. The share is a hair over that product, so that
    a member alone in its segments may take all of their slack though `w * (s / w)` rounds
    below `s`, then rounded down for integer usages."""
    memory = self.memory
    slack = np.maximum(-excess, 0).astype(np.float64)
    weights = rng.exponential(size=len(memory.member_group)) * kept[memory.member_group]
    per_weight = slack / np.maximum(memory.live_sum(weights), np.finfo(np.float64).tiny)
    least = _range_min(per_weight, memory.member_first, memory.member_last)
    share = np.where(weights > 0, weights * least * (1 + 1e-12), 0.0)
    return np.floor(share) if memory.capacity.dtype.kind == "i" else share

  def _random_forest(self, rng: np.random.Generator) -> np.ndarray:
    """[G] bool: groups of more than one strategy, drawn in random order, each kept when its
    kept neighbours are in distinct trees of the kept groups (so the kept groups induce a
    forest)."""
    kept = np.zeros(self.reduced.num_groups, bool)
    tree = np.arange(self.reduced.num_groups)

    def root(v: int) -> int:
      while tree[v] != v:
        tree[v] = tree[tree[v]]
        v = tree[v]
      return v

    for v in rng.permutation(self.movable).tolist():
      roots = [root(w) for w in self.neighbours[v] if kept[w]]
      if len(roots) == len(set(roots)):
        kept[v] = True
        tree[roots] = v
    return kept


def _range_min(values: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
  """[M] the least of `values` ([S]) over each range [first, last) ([M] each; inf where a
  range is empty), by a sparse table of minima over power-of-two spans."""
  table = [values]
  while 2 ** len(table) <= len(values):
    span = 2 ** (len(table) - 1)
    table.append(np.minimum(table[-1][:-span], table[-1][span:]))
  length = last - first
  least = np.full(len(first), np.inf)
  level = np.zeros(len(first), np.int64)
  nonempty = length > 0
  level[nonempty] = np.floor(np.log2(length[nonempty])).astype(np.int64)
  for lvl in np.unique(level[nonempty]).tolist():
    at = nonempty & (level == lvl)
    row = table[lvl]
    least[at] = np.minimum(row[first[at]], row[last[at] - 2**lvl])
  return least


def _first_argmin(values: np.ndarray, current: int) -> np.ndarray:
  """[rows] per row of `values` ([rows, k]) the column of its least value, `current` where it
  is among the least (a move changes a group only for a gain)."""
  lowest = values.min(axis=1)
  return np.where(values[:, current] <= lowest, current, values.argmin(axis=1))
