"""Exact reductions: a strategy graph becomes a smaller problem over groups.

Four rules, applied until nothing changes, none of which loses an optimum:

* Forbidden strategies go: a node strategy with a forbidden cost, or one for
  which some edge leaves no allowed partner (arc consistency).
* Determined nodes merge: when every allowed strategy of group g has exactly
  one allowed partner across an edge to group h, h's strategy is a function of
  g's, so h joins g (its members' strategies become functions of g's). Nodes
  with one allowed strategy and resharding edges that allow only matching
  shardings (the bulk of the IOPDDL instances) disappear this way.
* Parallel edges between two groups add up into one cost matrix; edges inside
  a group become costs of the group's strategies.
* Dominated strategies go (neighbourhood substitutability): strategy s of a group
  goes when another strategy t of it costs no more on its own, no more against
  every strategy of every neighbouring group, and uses no more memory in each of
  its nodes. Any plan picking s is then at most matched by the same plan with t,
  within the limit as well. Of strategies equal in all of these, the first stays.
  A group left with one strategy is then determined, and merges into its
  neighbours by the rule above. (Contest instance N: 63% of the strategies of its
  27,257 groups are dominated; 19,446 groups touch no other group, cost nothing
  whatever they pick, and differ only in memory.)

Internally costs are float64 with +inf for forbidden entries; integer costs up
to 2**53 (all contest instances) stay exact. Memory is not modelled here: every
original node keeps its interval and its usage, now a function of its group's
strategy (see `memory.py`); dominance compares usages node by node.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap_rl.solver.graph import StrategyGraph, is_forbidden, offsets_from_counts
from automap_rl.solver.limits import Limits

__all__ = ["GraphTooLarge", "Reduced", "reduce_graph"]


class GraphTooLarge(RuntimeError):
  """The problem has more pair-cost entries than the solver can handle (see `reduce_graph`
  and `solve.MAX_PAIR_ENTRIES`)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Reduced:
  """A strategy graph after exact reductions, over groups of nodes.

  Group strategies are numbered flat ("variables"): group g's strategy s is
  variable `offsets[g] + s`. Let G groups, V variables, P group pairs and N
  original nodes.

  Attributes:
    counts: [G] int64, strategies per group.
    offsets: [G + 1] int64, first variable of each group.
    unary: [V] float64, cost of each group strategy: its members' node costs
      and the edges inside the group (finite: forbidden ones were removed).
    pairs: [P, 2] int64, group pairs (g, h) with g < h joined by edges.
    pair_offsets: [P + 1] int64, start of each pair's matrix in `pair_costs`.
    pair_costs: [sum k_g * k_h] float64, each pair's [k_g, k_h] cost matrix
      row-major (the sum of the original edges between them), inf = forbidden.
    node_group: [N] int64, the group of each original node.
    node_map_offsets: [N + 1] int64, where each node's map starts.
    node_map: [sum over nodes of k_group] int64, node n's strategy when its
      group picks s is `node_map[node_map_offsets[n] + s]`.
  """

  counts: np.ndarray
  offsets: np.ndarray
  unary: np.ndarray
  pairs: np.ndarray
  pair_offsets: np.ndarray
  pair_costs: np.ndarray
  node_group: np.ndarray
  node_map_offsets: np.ndarray
  node_map: np.ndarray

  @property
  def num_groups(self) -> int:
    return len(self.counts)

  @property
  def var_group(self) -> np.ndarray:
    """[V] int64, the group of each variable."""
    return np.repeat(np.arange(self.num_groups), self.counts)

  def pair_matrix(self, p: int) -> np.ndarray:
    """[k_g, k_h] view of pair p's costs."""
    g, h = self.pairs[p]
    return self.pair_costs[self.pair_offsets[p] : self.pair_offsets[p + 1]].reshape(
      self.counts[g], self.counts[h]
    )

  def expand(self, group_choice: np.ndarray) -> np.ndarray:
    """[N] original strategy per node from [G] group strategies."""
    return self.node_map[self.node_map_offsets[:-1] + group_choice[self.node_group]]

  def node_choice_to_group(self, choice: np.ndarray) -> np.ndarray | None:
    """[G] group strategies that expand to `choice`, or None if none does."""
    group_choice = np.zeros(self.num_groups, dtype=np.int64)
    entry_node = np.repeat(np.arange(len(self.node_group)), np.diff(self.node_map_offsets))
    local = np.arange(len(self.node_map)) - self.node_map_offsets[entry_node]
    match = self.node_map == choice[entry_node]
    # A group strategy fits when it maps every member to the chosen strategy.
    var = self.offsets[self.node_group[entry_node]] + local
    fits = np.bincount(var, weights=~match, minlength=len(self.unary)) == 0
    for g in range(self.num_groups):
      hits = np.flatnonzero(fits[self.offsets[g] : self.offsets[g + 1]])
      if not len(hits):
        return None
      group_choice[g] = hits[0]
    return group_choice


@dataclasses.dataclass
class _Grouping:
  """Mutable state of the reduction: which group each node is in, and how."""

  root: np.ndarray  # [N] root node of each node's group
  maps: list[np.ndarray]  # per node: group strategy -> node strategy
  members: dict[int, list[int]]  # root -> nodes of its group


def reduce_graph(
  graph: StrategyGraph, max_entries: int | None = None, limits: Limits = Limits()
) -> Reduced:
  """Applies the exact reductions until none applies.

  Merging a node into a group with many strategies can grow the pair-cost matrices of its
  edges (wresnet-6.8b on 2x4x8: 3.8 million entries in the graph, 186 million after
  reduction); the reduction's arrays take about 100 bytes per entry.

  Args:
    graph: the strategy graph.
    max_entries: refuse (`GraphTooLarge`) a grouping whose edges between groups hold more
      entries than this, before allocating them; None: no limit.
    limits: checked once a round.

  Raises:
    ValueError: if every plan picks a forbidden cost somewhere.
    GraphTooLarge: see `max_entries`.
    LimitReached: past `limits`.
  """
  node_costs = _as_cost(graph.node_costs)
  edge_costs = _as_cost(graph.edge_costs)
  n = graph.num_nodes
  state = _Grouping(
    root=np.arange(n),
    maps=[np.arange(c) for c in graph.num_strategies],
    members={i: [i] for i in range(n)},
  )
  while True:
    limits.check("reducing the graph")
    reduced = _build(graph, node_costs, edge_costs, state, max_entries)
    entries = _Entries(reduced)
    allowed = _arc_consistent(reduced, entries)
    keep = {
      int(r): allowed[reduced.offsets[g] : reduced.offsets[g + 1]]
      for g, r in enumerate(np.unique(state.root))
    }
    merged = _merge_determined(reduced, entries, allowed, state, keep)
    if not merged and np.all(allowed):
      dominated = _dominated(graph, reduced)
      if not np.any(dominated):
        return reduced
      keep = {
        int(r): ~dominated[reduced.offsets[g] : reduced.offsets[g + 1]]
        for g, r in enumerate(np.unique(state.root))
      }
    _restrict(state, keep)


def _as_cost(costs: np.ndarray) -> np.ndarray:
  out = costs.astype(np.float64)
  out[is_forbidden(costs)] = np.inf
  return out


def _build(
  graph: StrategyGraph,
  node_costs: np.ndarray,
  edge_costs: np.ndarray,
  state: _Grouping,
  max_entries: int | None,
) -> Reduced:
  """The group problem for the current grouping (vectorised over all edges)."""
  roots = np.unique(state.root)
  group_of_root = np.full(graph.num_nodes, -1)
  group_of_root[roots] = np.arange(len(roots))
  node_group = group_of_root[state.root]
  counts = np.array([len(state.maps[r]) for r in roots], dtype=np.int64)
  if np.any(counts == 0):
    raise ValueError("StrategyGraph: every plan picks a forbidden (infinite) cost")
  offsets = offsets_from_counts(counts)
  node_map = np.concatenate(state.maps) if graph.num_nodes else np.zeros(0, np.int64)
  map_offsets = offsets_from_counts([len(m) for m in state.maps])
  entry_node = np.repeat(np.arange(graph.num_nodes), np.diff(map_offsets))
  local = np.arange(len(node_map)) - map_offsets[entry_node]
  unary_var = offsets[node_group[entry_node]] + local
  unary = np.bincount(
    unary_var, weights=node_costs[graph.node_offsets[entry_node] + node_map], minlength=offsets[-1]
  ).astype(np.float64)

  u, v = graph.edges[:, 0], graph.edges[:, 1]
  gu, gv = node_group[u], node_group[v]
  n_v = graph.num_strategies[v]
  inside = gu == gv
  # Edges inside a group: one cost per group strategy.
  e_in = np.repeat(np.flatnonzero(inside), counts[gu[inside]])
  s_in = np.arange(len(e_in)) - np.repeat(
    offsets_from_counts(counts[gu[inside]])[:-1], counts[gu[inside]]
  )
  cost_in = edge_costs[
    graph.edge_offsets[e_in]
    + node_map[map_offsets[u[e_in]] + s_in] * n_v[e_in]
    + node_map[map_offsets[v[e_in]] + s_in]
  ]
  unary += np.bincount(offsets[gu[e_in]] + s_in, weights=cost_in, minlength=offsets[-1])
  unary[np.isnan(unary)] = np.inf

  # Edges between groups, oriented to (low group, high group) and summed.
  out = np.flatnonzero(~inside)
  lo, hi = np.minimum(gu[out], gv[out]), np.maximum(gu[out], gv[out])
  keys, pair_of_edge = np.unique(lo * len(roots) + hi, return_inverse=True)
  pairs = np.stack([keys // max(len(roots), 1), keys % max(len(roots), 1)], axis=1).astype(np.int64)
  pair_offsets = offsets_from_counts(counts[pairs[:, 0]] * counts[pairs[:, 1]])
  sizes = counts[gu[out]] * counts[gv[out]]
  if max_entries is not None and sizes.sum() > max_entries:
    raise GraphTooLarge(
      f"solver: {graph.name or 'the graph'} groups into {int(sizes.sum()):,} pair-cost entries, "
      f"more than the {max_entries:,} the solver can set up within a time limit"
    )
  e = np.repeat(out, sizes)
  k = np.arange(len(e)) - np.repeat(offsets_from_counts(sizes)[:-1], sizes)
  kv = counts[gv[e]]
  a, b = k // kv, k % kv  # strategies of u's group and v's group
  cost = edge_costs[
    graph.edge_offsets[e]
    + node_map[map_offsets[u[e]] + a] * n_v[e]
    + node_map[map_offsets[v[e]] + b]
  ]
  flip = gu[e] > gv[e]
  row, col = np.where(flip, b, a), np.where(flip, a, b)
  p = np.repeat(pair_of_edge, sizes)
  slot = pair_offsets[p] + row * counts[pairs[p, 1]] + col
  pair_costs = np.bincount(slot, weights=cost, minlength=pair_offsets[-1]).astype(np.float64)
  pair_costs[np.isnan(pair_costs)] = np.inf
  return Reduced(
    counts=counts,
    offsets=offsets,
    unary=unary,
    pairs=pairs,
    pair_offsets=pair_offsets,
    pair_costs=pair_costs,
    node_group=node_group,
    node_map_offsets=map_offsets,
    node_map=node_map,
  )


class _Entries:
  """Per pair-cost entry: its pair, row and column variables and slots.

  A slot is (pair, strategy of one side): rows are side 0, columns side 1.
  """

  def __init__(self, reduced: Reduced):
    counts, pairs = reduced.counts, reduced.pairs
    sizes = np.diff(reduced.pair_offsets)
    self.pair = np.repeat(np.arange(len(pairs)), sizes)
    k = np.arange(len(self.pair)) - reduced.pair_offsets[self.pair]
    k_h = counts[pairs[self.pair, 1]]
    self.row_local, self.col_local = k // k_h, k % k_h
    self.slot_offsets = (
      offsets_from_counts(counts[pairs[:, 0]]),
      offsets_from_counts(counts[pairs[:, 1]]),
    )
    self.row_slot = self.slot_offsets[0][self.pair] + self.row_local
    self.col_slot = self.slot_offsets[1][self.pair] + self.col_local
    self.row = reduced.offsets[pairs[self.pair, 0]] + self.row_local
    self.col = reduced.offsets[pairs[self.pair, 1]] + self.col_local
    self.slot_var = tuple(
      _ranges(reduced.offsets[pairs[:, side]], counts[pairs[:, side]]) for side in (0, 1)
    )
    self.slot_pair = tuple(
      np.repeat(np.arange(len(pairs)), counts[pairs[:, side]]) for side in (0, 1)
    )
    self.finite = np.isfinite(reduced.pair_costs)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Concatenation of arange(start, start + length) for each pair."""
  return (
    np.repeat(starts, lengths)
    + np.arange(lengths.sum())
    - np.repeat(np.cumsum(lengths) - lengths, lengths)
  )


def _arc_consistent(reduced: Reduced, e: _Entries) -> np.ndarray:
  """[V] bool: variables that survive arc consistency."""
  allowed = np.isfinite(reduced.unary)
  while True:
    ok = e.finite & allowed[e.row] & allowed[e.col]
    dead = np.zeros(len(allowed), bool)
    for side, slot in ((0, e.row_slot), (1, e.col_slot)):
      support = np.bincount(slot, weights=ok, minlength=len(e.slot_var[side])) > 0
      dead[e.slot_var[side][~support]] = True
    new = allowed & ~dead
    if np.array_equal(new, allowed):
      return allowed
    allowed = new


def _dominated(graph: StrategyGraph, reduced: Reduced) -> np.ndarray:
  """[V] bool: strategies another strategy of their group dominates (see the module's
  docstring), the first of equal ones kept; every group keeps at least one strategy.

  For group g with k strategies the features are its unary costs [k], the usage [k] of each
  of its nodes that holds memory and whose usage varies with g's strategy, and the rows [k,
  k_h] of its pair matrices; t dominates s when every feature of t is at most s's."""
  counts, offsets = reduced.counts, reduced.offsets
  num_groups = reduced.num_groups
  usage_columns: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
  if graph.usage_limit is not None:
    map_offsets = reduced.node_map_offsets
    entry_node = np.repeat(np.arange(graph.num_nodes), np.diff(map_offsets))
    usage = graph.node_usages[graph.node_offsets[entry_node] + reduced.node_map].astype(np.float64)
    live = graph.intervals[:, 0] < graph.intervals[:, 1]
    starts = map_offsets[:-1]
    varies = live & (np.maximum.reduceat(usage, starts) > np.minimum.reduceat(usage, starts))
    for n in np.flatnonzero(varies & (counts[reduced.node_group] > 1)).tolist():
      usage_columns[reduced.node_group[n]].append(usage[map_offsets[n] : map_offsets[n + 1]])
  by_group: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
  for p, (g, h) in enumerate(reduced.pairs.tolist()):
    if counts[g] > 1 or counts[h] > 1:
      matrix = reduced.pair_matrix(p)
      by_group[g].append(matrix)
      by_group[h].append(matrix.T)
  dominated = np.zeros(len(reduced.unary), bool)
  for g in np.flatnonzero(counts > 1).tolist():
    k = int(counts[g])
    features = np.concatenate(
      [reduced.unary[offsets[g] : offsets[g + 1], None]]
      + [column[:, None] for column in usage_columns[g]]
      + by_group[g],
      axis=1,
    )  # [k, F]
    at_most = np.all(features[:, None, :] <= features[None, :, :], axis=-1)  # [t, s]
    equal = at_most & at_most.T
    first = np.arange(k)[:, None] < np.arange(k)[None, :]
    dominated[offsets[g] : offsets[g + 1]] = np.any(at_most & (~equal | first), axis=0)
  return dominated


def _restrict(state: _Grouping, keep: dict[int, np.ndarray]) -> None:
  """Drops the strategies `keep` rules out (per root) from every member's map."""
  for root, mask in keep.items():
    if not mask.all():
      for m in state.members[root]:
        state.maps[m] = state.maps[m][mask]


def _merge_determined(
  reduced: Reduced, e: _Entries, allowed: np.ndarray, state: _Grouping, keep: dict[int, np.ndarray]
) -> bool:
  """Merges groups determined by a neighbour across one pair; True if any.

  Only allowed strategies count; `keep` (allowed strategies per root) is
  updated for the merged groups.
  """
  ok = e.finite & allowed[e.row] & allowed[e.col]
  num_pairs = len(reduced.pairs)
  decides, partner = [], []
  for side, slot, other_local in ((0, e.row_slot, e.col_local), (1, e.col_slot, e.row_local)):
    count = np.bincount(slot, weights=ok, minlength=len(e.slot_var[side]))
    bad = (count != 1) & allowed[e.slot_var[side]]
    decides.append(np.bincount(e.slot_pair[side], weights=bad, minlength=num_pairs) == 0)
    unique = np.zeros(len(count), np.int64)
    unique[slot[ok]] = other_local[ok]
    partner.append(unique)

  roots = np.unique(state.root)
  size = [len(state.members[int(r)]) for r in roots]
  # Within this pass: the group each group now belongs to, the groups each one
  # absorbed, and for absorbed ones the map from their owner's strategies.
  owner = np.arange(len(roots))
  absorbed = [[] for _ in roots]
  via = {}
  merged = False
  for q in np.flatnonzero(decides[0] | decides[1]).tolist():
    g, h = (int(x) for x in reduced.pairs[q])
    options = []
    for side, (decider, decided) in enumerate(((g, h), (h, g))):
      if decides[side][q]:
        options.append(
          (decider, decided, partner[side][e.slot_offsets[side][q] : e.slot_offsets[side][q + 1]])
        )
    options.sort(key=lambda o: -size[owner[o[0]]])
    for decider, decided, choice in options:
      top = owner[decider]
      if owner[decided] != decided or top == decided:
        continue
      new_map = choice if decider == top else choice[via[decider]]
      top_root, decided_root = int(roots[top]), int(roots[decided])
      keep[top_root] = keep[top_root] & keep.pop(decided_root)[new_map]
      _absorb(state, top_root, decided_root, new_map)
      for child in absorbed[decided]:
        via[child] = via[child][new_map]
        owner[child] = top
      via[decided] = new_map
      owner[decided] = top
      absorbed[top] += [decided] + absorbed[decided]
      size[top] += size[decided]
      merged = True
      break
  return merged


def _absorb(state: _Grouping, top: int, decided: int, new_map: np.ndarray) -> None:
  """Group `decided` joins group `top`; new_map: top's strategy -> decided's."""
  for m in state.members[decided]:
    state.maps[m] = state.maps[m][new_map]
    state.root[m] = top
  state.members[top].extend(state.members.pop(decided))
