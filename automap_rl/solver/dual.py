"""Lagrangian relaxation of the usage limit, solved by message passing (TRW-S).

Pricing usage at lambda_j >= 0 per segment leaves pairwise costs only: group
strategy s of g costs unary + sum over its members of usage * (sum of lambda
over the member's segments). That relaxation is solved with sequential
tree-reweighted message passing (TRW-S, Kolmogorov 2006) in the order of a
greedy colouring: groups of one colour share no pair, so a whole colour
sends its messages at once (numpy over all its pairs' cost entries), which is
exactly TRW-S with the groups sorted by colour. Plans are decoded in that
order, each group taking its cheapest strategy given the pair costs to groups
already decoded and the messages from the rest.

On these graphs the relaxation is nearly tight: for contest instance A without
its usage rows the LP is integral and decoding reaches that optimum in ~20
sweeps.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from automap_rl.solver.graph import offsets_from_counts
from automap_rl.solver.memory import Memory
from automap_rl.solver.reduce import Reduced

__all__ = ["Dual"]


class Dual:
  """Messages, colouring and prices of the relaxation."""

  def __init__(self, reduced: Reduced, memory: Memory):
    self.reduced, self.memory = reduced, memory
    counts, pairs = reduced.counts, reduced.pairs
    g, h = pairs[:, 0], pairs[:, 1]
    k_h = counts[h]
    entry_pair = np.repeat(np.arange(len(pairs)), counts[g] * k_h)
    k = np.arange(len(entry_pair)) - reduced.pair_offsets[entry_pair]
    self._slot_offsets = (offsets_from_counts(counts[g]), offsets_from_counts(k_h))
    # A "slot" is (pair, strategy of one side); messages live on slots, entries are row-major.
    slot = (
      self._slot_offsets[0][entry_pair] + k // k_h[entry_pair],
      self._slot_offsets[1][entry_pair] + k % k_h[entry_pair],
    )
    self.slot_var = (_ranges(reduced.offsets[g], counts[g]), _ranges(reduced.offsets[h], k_h))
    self._entry_slot = slot
    self.messages = [np.zeros(len(self.slot_var[0])), np.zeros(len(self.slot_var[1]))]
    self.color = _greedy_coloring(reduced)
    self.num_colors = int(self.color.max(initial=-1)) + 1
    color_g, color_h = self.color[g], self.color[h]
    groups = reduced.num_groups
    earlier = np.bincount(
      np.concatenate([g[color_g > color_h], h[color_h > color_g]]), minlength=groups
    )
    later = np.bincount(
      np.concatenate([g[color_g < color_h], h[color_h < color_g]]), minlength=groups
    )
    self._var_weight = (1.0 / np.maximum(np.maximum(earlier, later), 1))[reduced.var_group]
    self._steps = {}
    by_column = np.argsort(slot[1], kind="stable")
    row_major = np.arange(len(entry_pair))
    # Each entry's colours on both sides, in both orders, gathered once (not per colour).
    color_type = np.min_scalar_type(max(self.num_colors, 1))
    pair_color = self.color[pairs].astype(color_type)  # [P, 2]
    orders = {}
    for side, order in ((0, by_column), (1, row_major)):
      of_pair = entry_pair[order]
      orders[side] = (order, pair_color[of_pair, side], pair_color[of_pair, 1 - side])
    del by_column, row_major
    for forward in (True, False):
      for c in range(self.num_colors):
        steps = []
        # The colour-c group is on `side`; its message goes to the other side,
        # minimising over its own strategies, so entries are grouped by the
        # receiving slot.
        for side in (0, 1):
          order, mine, theirs = orders[side]
          entries = order[(mine == c) & ((theirs > c) if forward else (theirs < c))]
          if len(entries):
            receiving = slot[1 - side][entries]
            starts = np.flatnonzero(np.r_[True, receiving[1:] != receiving[:-1]])
            slots = receiving[starts]
            pair_of_slot = entry_pair[entries[starts]]
            pair_starts = np.flatnonzero(np.r_[True, pair_of_slot[1:] != pair_of_slot[:-1]])
            own_slot = slot[side][entries]
            steps.append(
              (
                side,
                reduced.pair_costs[entries],
                own_slot,
                self.slot_var[side][own_slot],
                starts,
                slots,
                self.slot_var[1 - side][slots],
                pair_starts,
                np.diff(np.r_[pair_starts, len(slots)]),
              )
            )
        self._steps[forward, c] = steps
    self.unary = reduced.unary.copy()
    member_entry = np.repeat(np.arange(len(memory.member_group)), np.diff(memory.member_offsets))
    self._usage_var = (
      reduced.offsets[memory.member_group[member_entry]]
      + np.arange(len(member_entry))
      - memory.member_offsets[member_entry]
    )
    self._usage_member = member_entry

  def set_prices(self, prices: np.ndarray) -> None:
    """Prices usage at `prices` ([S], >= 0) per segment."""
    memory = self.memory
    cumulative = np.concatenate([[0.0], np.cumsum(prices)])
    per_member = cumulative[memory.member_last] - cumulative[memory.member_first]
    weights = memory.member_usage * per_member[self._usage_member]
    self.unary = self.reduced.unary + np.bincount(
      self._usage_var, weights=weights, minlength=len(self.reduced.unary)
    )

  def sweep(self, forward: bool = True) -> None:
    """One TRW-S pass over the colours, forward or backward."""
    colors = range(self.num_colors) if forward else range(self.num_colors - 1, -1, -1)
    incoming = self._incoming()
    for c in colors:
      weighted = (self.unary + incoming) * self._var_weight
      for (
        side,
        costs,
        own_slot,
        own_var,
        starts,
        slots,
        slot_var,
        pair_starts,
        pair_sizes,
      ) in self._steps[forward, c]:
        values = costs + weighted[own_var] - self.messages[side][own_slot]
        message = np.minimum.reduceat(values, starts)
        message -= np.repeat(np.minimum.reduceat(message, pair_starts), pair_sizes)
        incoming += np.bincount(
          slot_var, weights=message - self.messages[1 - side][slots], minlength=len(incoming)
        )
        self.messages[1 - side][slots] = message

  def _incoming(self) -> np.ndarray:
    """[V] sum of the messages into each variable."""
    total = np.zeros(len(self.unary))
    for side in (0, 1):
      total += np.bincount(self.slot_var[side], weights=self.messages[side], minlength=len(total))
    return total

  def reparametrized_unary(self) -> np.ndarray:
    """[V] priced unary costs plus incoming messages."""
    return self.unary + self._incoming()

  def lower_bound(self, prices: np.ndarray) -> float:
    """A lower bound on the cost of every plan within the limit, for the prices last set
    (`set_prices(prices)`) and the current messages. The messages move cost between the
    groups and their pairs and keep the sum, so the priced cost of a plan is the sum over
    pairs of its reparametrized pair cost plus 1/degree of each end's reparametrized
    strategy cost (plus the costs of groups in no pair): at least the sum of those terms'
    minima, which the sweeps drive up to the relaxation's optimum. A plan within the
    limit costs at least its priced cost less the prices times the capacity (weak
    duality)."""
    reduced = self.reduced
    unary = self.reparametrized_unary()
    degree = np.bincount(reduced.pairs.ravel(), minlength=reduced.num_groups)
    share = unary / np.maximum(degree, 1)[reduced.var_group]
    total = (
      float(np.minimum.reduceat(unary, reduced.offsets[:-1])[degree == 0].sum())
      if reduced.num_groups
      else 0.0
    )
    if len(reduced.pairs):
      row, col = (self.slot_var[side][self._entry_slot[side]] for side in (0, 1))
      entries = (
        reduced.pair_costs
        - self.messages[0][self._entry_slot[0]]
        - self.messages[1][self._entry_slot[1]]
        + share[row]
        + share[col]
      )
      total += float(np.minimum.reduceat(entries, reduced.pair_offsets[:-1]).sum())
    return total - float(np.dot(prices, self.memory.capacity.astype(np.float64)))

  def decode(self, pick: Callable[[int, np.ndarray], int] | None = None) -> np.ndarray:
    """[G] plan: colour by colour, each group's cheapest strategy given the
    pair costs to groups already decoded and the messages from the others.

    `pick(g, values)`, if given, chooses group g's strategy from its [k]
    values instead (e.g. the cheapest one that fits a usage budget).
    """
    reduced = self.reduced
    counts, offsets, pairs = reduced.counts, reduced.offsets, reduced.pairs
    k_h = counts[pairs[:, 1]]
    values = self.reparametrized_unary()
    choice = np.full(reduced.num_groups, -1)
    for c in range(self.num_colors):
      for side in (0, 1):
        mine, other = pairs[:, side], pairs[:, 1 - side]
        known = np.flatnonzero((self.color[mine] == c) & (self.color[other] < c))
        k = counts[mine[known]]
        p = np.repeat(known, k)
        s = np.arange(len(p)) - np.repeat(np.cumsum(k) - k, k)
        fixed = choice[other[p]]
        entry = reduced.pair_offsets[p] + (s * k_h[p] + fixed if side == 0 else fixed * k_h[p] + s)
        slot = self._slot_offsets[side][p] + s
        values += np.bincount(
          offsets[mine[p]] + s,
          weights=reduced.pair_costs[entry] - self.messages[side][slot],
          minlength=len(values),
        )
      groups = np.flatnonzero(self.color == c)
      if pick is None:
        choice[groups] = _segment_argmin(values, offsets, groups)
      else:
        for g in groups.tolist():
          choice[g] = pick(g, values[offsets[g] : offsets[g + 1]])
    return choice


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Concatenation of arange(start, start + length) for each pair."""
  return (
    np.repeat(starts, lengths)
    + np.arange(lengths.sum())
    - np.repeat(np.cumsum(lengths) - lengths, lengths)
  )


def _segment_argmin(values: np.ndarray, offsets: np.ndarray, groups: np.ndarray) -> np.ndarray:
  """[len(groups)] argmin (first on ties) of values within [offsets[g], offsets[g + 1]) per
  group."""
  lengths = offsets[groups + 1] - offsets[groups]
  index = _ranges(offsets[groups], lengths)
  starts = offsets_from_counts(lengths)[:-1]
  local = values[index]
  is_min = local == np.repeat(np.minimum.reduceat(local, starts), lengths)
  hits = np.flatnonzero(is_min)
  return hits[np.searchsorted(hits, starts)] - starts


def _greedy_coloring(reduced: Reduced) -> np.ndarray:
  """[G] colour per group such that no pair joins two groups of one colour."""
  groups = reduced.num_groups
  neighbours = [[] for _ in range(groups)]
  for g, h in reduced.pairs.tolist():
    neighbours[g].append(h)
    neighbours[h].append(g)
  color = np.full(groups, -1)
  for g in np.argsort([-len(n) for n in neighbours], kind="stable").tolist():
    used = {int(color[h]) for h in neighbours[g]}
    c = 0
    while c in used:
      c += 1
    color[g] = c
  return color
