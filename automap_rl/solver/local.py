"""Local search over group plans: incremental costs, descent, budgeted plans.

`GroupPlan` keeps a group plan together with, for every group strategy, the cost
of switching to it (its unary cost plus its pair costs against the current
strategies of the neighbours), and the usage in every segment. A switch costs
one small update per incident pair and one add over the switched group's time
span, so coordinate descent over thousands of groups runs in Python. Moves of
two joined groups at once (`GroupPlan.descend_pairs`) are priced for every pair in
one pass over the pair costs; they find what single switches cannot, where a
pair's cost matrix favours changing both ends together. `GroupPlan.repair` turns a
plan over the limit into one within it, switch by switch, each the cheapest
per unit of usage it frees in the segment most over the limit. `GroupPlanBuilder`
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

__all__ = ["GroupPlanBuilder", "Layout", "GroupPlan"]

# A group's switch that frees less than this share of the excess in the segment most over the
# limit is priced as if it freed that much, so repairs prefer switches that clear the excess.
_MIN_FREED_SHARE = 0.05


class Layout:
  """Per-group adjacency and usage tables, built once per problem."""

  def __init__(self, reduced: Reduced, memory: Memory):
    self.reduced, self.memory = reduced, memory
    groups = reduced.num_groups
    self.incident: list[list[tuple[int, int]]] = [[] for _ in range(groups)]
    for p, (g, h) in enumerate(reduced.pairs.tolist()):
      self.incident[g].append((p, 0))
      self.incident[h].append((p, 1))
    # Per group: the other group of each incident pair, in the order of `incident`.
    self.neighbours = [
      [int(reduced.pairs[p, 1 - side]) for p, side in incident] for incident in self.incident
    ]
    order = np.argsort(memory.member_group, kind="stable")
    bounds = np.searchsorted(memory.member_group[order], np.arange(groups + 1))
    # Per pair-cost entry: its pair and the local strategies of the pair's two groups.
    g, h = reduced.pairs[:, 0], reduced.pairs[:, 1]
    self.entry_pair = np.repeat(np.arange(len(reduced.pairs)), np.diff(reduced.pair_offsets))
    k_h = reduced.counts[h][self.entry_pair]
    local_entry = np.arange(len(self.entry_pair)) - reduced.pair_offsets[self.entry_pair]
    self.entry_row, self.entry_col = local_entry // k_h, local_entry % k_h
    self.entry_row_var = reduced.offsets[g][self.entry_pair] + self.entry_row
    self.entry_col_var = reduced.offsets[h][self.entry_pair] + self.entry_col
    self.cuts: list[np.ndarray] = []  # per group: sorted segment cuts of its pieces
    self.usage: list[np.ndarray] = []  # per group: [pieces, k] usage per strategy
    self.lowest: list[np.ndarray] = []  # per group: [pieces] sum of its members' least usages
    for g in range(groups):
      members = order[bounds[g] : bounds[g + 1]]
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


class GroupPlan:
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
    local = self.local[offsets[g] : offsets[g + 1]]
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
    slack = self.layout.memory.capacity[cuts[0] : cuts[-1]] - self.profile[cuts[0] : cuts[-1]]
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
      self.profile[cuts[0] : cuts[-1]] += np.repeat(usage[:, s] - usage[:, old], np.diff(cuts))
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

  def move_fits(self, moves: list[tuple[int, int]]) -> bool:
    """Whether switching each (group, strategy) of `moves` together keeps every segment within
    capacity (or, in segments already over it, adds no usage)."""
    cuts_of = self.layout.cuts
    spanned = [g for g, _ in moves if len(self.layout.usage[g])]
    if not spanned:
      return True
    lo = min(int(cuts_of[g][0]) for g in spanned)
    hi = max(int(cuts_of[g][-1]) for g in spanned)
    change = np.zeros(hi - lo, self.profile.dtype)
    for g, s in moves:
      cuts, usage = cuts_of[g], self.layout.usage[g]
      if len(usage):
        change[cuts[0] - lo : cuts[-1] - lo] += np.repeat(
          usage[:, s] - usage[:, self.choice[g]], np.diff(cuts)
        )
    slack = self.layout.memory.capacity[lo:hi] - self.profile[lo:hi]
    return bool(np.all(change <= np.maximum(slack, 0)))

  def descend_pairs(self, min_gain: float = 0.0) -> int:
    """One pass of two-group moves: for every pair (g, h) the joint switch (s, t) that lowers
    the cost most, priced over all pairs' cost entries at once; then, best first, each
    still improving and within the limit is made. Returns the number of moves made."""
    layout, reduced = self.layout, self.layout.reduced
    if not len(reduced.pairs):
      return 0
    g, h = reduced.pairs[:, 0], reduced.pairs[:, 1]
    k_h = reduced.counts[h]
    pair, row, col = layout.entry_pair, layout.entry_row, layout.entry_col
    base = reduced.pair_offsets[pair]
    with np.errstate(invalid="ignore"):  # inf - inf: a forbidden entry, priced inf below
      # Group g at s with h at its current t0 is in g's switch cost; replace that pair term by (s,
      # t).
      joint = (
        self.local[layout.entry_row_var]
        - reduced.pair_costs[base + row * k_h[pair] + self.choice[h][pair]]
        + self.local[layout.entry_col_var]
        - reduced.pair_costs[base + self.choice[g][pair] * k_h[pair] + col]
        + reduced.pair_costs
      )
    joint = np.where(np.isnan(joint), np.inf, joint)
    current = joint[reduced.pair_offsets[:-1] + self.choice[g] * k_h + self.choice[h]]
    with np.errstate(invalid="ignore"):  # inf - inf: a forbidden current pair, no move
      gain = current[pair] - joint
    gain = np.where(np.isnan(gain), -np.inf, gain)
    gain[
      (row == self.choice[g][pair]) | (col == self.choice[h][pair])
    ] = -np.inf  # single switches: `descend`
    best_entry = reduced.pair_offsets[:-1] + _segment_argmax(gain, reduced.pair_offsets)
    best_gain = gain[best_entry]
    moves = 0
    for p in np.argsort(-best_gain, kind="stable")[: int(np.sum(best_gain > min_gain))].tolist():
      e = int(best_entry[p] - reduced.pair_offsets[p])
      gp, hp, sp, tp = int(g[p]), int(h[p]), e // int(k_h[p]), e % int(k_h[p])
      if sp == self.choice[gp] or tp == self.choice[hp]:
        continue  # An earlier move switched one of them there already.
      now = self.switch_costs(gp)[sp] + self.switch_costs(hp)[tp]
      matrix = reduced.pair_matrix(p)
      exact = (
        now
        - matrix[sp, self.choice[hp]]
        - matrix[self.choice[gp], tp]
        + matrix[sp, tp]
        + matrix[self.choice[gp], self.choice[hp]]
      )
      if exact < -min_gain and self.move_fits([(gp, sp), (hp, tp)]):
        self.switch(gp, sp)
        self.switch(hp, tp)
        moves += 1
    return moves

  def repair(self, max_switches: int) -> bool:
    """Switches groups until the plan is within the limit, each time the cheapest switch
    per unit of usage freed in the segment most over it that adds no usage where there is
    no room. True if the plan ends within the limit (at most `max_switches` switches)."""
    memory, reduced = self.layout.memory, self.layout.reduced
    member_var = np.repeat(np.arange(len(memory.member_group)), np.diff(memory.member_offsets))
    var = (
      reduced.offsets[memory.member_group[member_var]]
      + np.arange(len(member_var))
      - memory.member_offsets[member_var]
    )
    for _ in range(max_switches):
      excess = self.excess()
      worst = int(np.argmax(excess)) if len(excess) else 0
      if not len(excess) or excess[worst] <= 0:
        return True
      live = (memory.member_first <= worst) & (memory.member_last > worst)
      use = np.bincount(
        var[live[member_var]],
        weights=memory.member_usage[live[member_var]],
        minlength=len(self.local),
      )
      current = self.choice[reduced.var_group] + reduced.offsets[:-1][reduced.var_group]
      freed = use[current] - use
      raise_cost = self.local - self.local[current]
      price = np.where(
        freed > 0, raise_cost / np.maximum(freed, _MIN_FREED_SHARE * excess[worst]), np.inf
      )
      for v in np.argsort(price, kind="stable")[: int(np.sum(np.isfinite(price)))].tolist():
        group = int(reduced.var_group[v])
        if self.move_fits([(group, v - int(reduced.offsets[group]))]):
          self.switch(group, v - int(reduced.offsets[group]))
          break
      else:
        return False
    return bool(np.all(self.excess() <= 0))


def _segment_argmax(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
  """[len(offsets) - 1] index within each segment [offsets[i], offsets[i + 1]) of its largest value
  (first on ties;
  NaN, an undefined gain such as inf - inf, counts as -inf)."""
  values = np.where(np.isnan(values), -np.inf, values)
  lengths = np.diff(offsets)
  is_max = values == np.repeat(np.maximum.reduceat(values, offsets[:-1]), lengths)
  hits = np.flatnonzero(is_max)
  return hits[np.searchsorted(hits, offsets[:-1])] - offsets[:-1]


class GroupPlanBuilder:
  """Builds a plan group by group within the usage limit.

  Groups not yet chosen are counted at their members' least usages (a lower
  bound), so as long as that is within the limit every choice that fits keeps
  a completion within the limit possible.
  """

  def __init__(self, layout: Layout):
    self.layout = layout
    memory = layout.memory
    lowest = (
      np.minimum.reduceat(memory.member_usage, memory.member_offsets[:-1])
      if len(memory.member_usage)
      else memory.member_usage
    )
    self.profile = memory.profile_of(lowest)

  def pick(self, g: int, values: np.ndarray) -> int:
    """Commits group g to its cheapest strategy (by `values`) that fits, or
    to the one that overshoots least if none does."""
    cuts, usage, lowest = self.layout.cuts[g], self.layout.usage[g], self.layout.lowest[g]
    if not len(usage):
      return int(np.argmin(values))
    slack = self.layout.memory.capacity[cuts[0] : cuts[-1]] - self.profile[cuts[0] : cuts[-1]]
    slack = np.minimum.reduceat(slack, cuts[:-1] - cuts[0])
    over = np.max(usage - lowest[:, None] - slack[:, None], axis=0)
    fits = over <= 0
    s = int(np.argmin(np.where(fits, values, np.inf))) if fits.any() else int(np.argmin(over))
    self.profile[cuts[0] : cuts[-1]] += np.repeat(usage[:, s] - lowest, np.diff(cuts))
    return s
