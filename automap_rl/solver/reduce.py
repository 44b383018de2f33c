"""Exact reductions: a strategy graph becomes a smaller problem over groups.

Three rules, applied until nothing changes, none of which loses an optimum:

* Forbidden strategies go: a node strategy with a forbidden cost, or one for
  which some edge leaves no allowed partner (arc consistency).
* Determined nodes merge: when every allowed strategy of group g has exactly
  one allowed partner across an edge to group h, h's strategy is a function of
  g's, so h joins g (its members' strategies become functions of g's). Nodes
  with one allowed strategy and resharding edges that allow only matching
  shardings (the bulk of the IOPDDL instances) disappear this way.
* Parallel edges between two groups add up into one cost matrix; edges inside
  a group become costs of the group's strategies.

Internally costs are float64 with +inf for forbidden entries; integer costs up
to 2**53 (all contest instances) stay exact. Memory is not touched here: every
original node keeps its interval and its usage, now a function of its group's
strategy (see `memory.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap_rl.solver.graph import StrategyGraph, is_forbidden, offsets_from_counts

__all__ = ["Reduced", "reduce_graph"]


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
    return self.pair_costs[self.pair_offsets[p]:self.pair_offsets[p + 1]].reshape(self.counts[g], self.counts[h])

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
      hits = np.flatnonzero(fits[self.offsets[g]:self.offsets[g + 1]])
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


def reduce_graph(graph: StrategyGraph) -> Reduced:
  """Applies the exact reductions until none applies.

  Raises:
    ValueError: if every plan picks a forbidden cost somewhere.
  """
  node_costs = _as_cost(graph.node_costs)
  edge_costs = _as_cost(graph.edge_costs)
  n = graph.num_nodes
  state = _Grouping(
      root=np.arange(n), maps=[np.arange(c) for c in graph.num_strategies],
      members={i: [i] for i in range(n)})
  while True:
    reduced = _build(graph, node_costs, edge_costs, state)
    allowed = _arc_consistent(reduced)
    if not np.all(allowed):
      _restrict(reduced, state, allowed)
      continue
    if not _merge_determined(reduced, state):
      return reduced


def _as_cost(costs: np.ndarray) -> np.ndarray:
  out = costs.astype(np.float64)
  out[is_forbidden(costs)] = np.inf
  return out


def _build(graph: StrategyGraph, node_costs: np.ndarray, edge_costs: np.ndarray, state: _Grouping) -> Reduced:
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
  unary = np.bincount(unary_var, weights=node_costs[graph.node_offsets[entry_node] + node_map],
                      minlength=offsets[-1])

  u, v = graph.edges[:, 0], graph.edges[:, 1]
  gu, gv = node_group[u], node_group[v]
  n_v = graph.num_strategies[v]
  inside = gu == gv
  # Edges inside a group: one cost per group strategy.
  e_in = np.repeat(np.flatnonzero(inside), counts[gu[inside]])
  s_in = np.arange(len(e_in)) - np.repeat(offsets_from_counts(counts[gu[inside]])[:-1], counts[gu[inside]])
  cost_in = edge_costs[graph.edge_offsets[e_in] + node_map[map_offsets[u[e_in]] + s_in] * n_v[e_in]
                       + node_map[map_offsets[v[e_in]] + s_in]]
  unary += np.bincount(offsets[gu[e_in]] + s_in, weights=cost_in, minlength=offsets[-1])
  unary[np.isnan(unary)] = np.inf

  # Edges between groups, oriented to (low group, high group) and summed.
  out = np.flatnonzero(~inside)
  lo, hi = np.minimum(gu[out], gv[out]), np.maximum(gu[out], gv[out])
  keys, pair_of_edge = np.unique(lo * len(roots) + hi, return_inverse=True)
  pairs = np.stack([keys // max(len(roots), 1), keys % max(len(roots), 1)], axis=1).astype(np.int64)
  pair_offsets = offsets_from_counts(counts[pairs[:, 0]] * counts[pairs[:, 1]])
  sizes = counts[gu[out]] * counts[gv[out]]
  e = np.repeat(out, sizes)
  k = np.arange(len(e)) - np.repeat(offsets_from_counts(sizes)[:-1], sizes)
  kv = counts[gv[e]]
  a, b = k // kv, k % kv  # strategies of u's group and v's group
  cost = edge_costs[graph.edge_offsets[e] + node_map[map_offsets[u[e]] + a] * n_v[e] + node_map[map_offsets[v[e]] + b]]
  flip = gu[e] > gv[e]
  row, col = np.where(flip, b, a), np.where(flip, a, b)
  p = np.repeat(pair_of_edge, sizes)
  slot = pair_offsets[p] + row * counts[pairs[p, 1]] + col
  pair_costs = np.bincount(slot, weights=cost, minlength=pair_offsets[-1])
  pair_costs[np.isnan(pair_costs)] = np.inf
  return Reduced(counts=counts, offsets=offsets, unary=unary, pairs=pairs, pair_offsets=pair_offsets,
                 pair_costs=pair_costs, node_group=node_group, node_map_offsets=map_offsets, node_map=node_map)


def _pair_entries(reduced: Reduced) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per pair-cost entry: (pair, row variable, column variable)."""
  sizes = np.diff(reduced.pair_offsets)
  p = np.repeat(np.arange(len(reduced.pairs)), sizes)
  k = np.arange(len(p)) - reduced.pair_offsets[p]
  g, h = reduced.pairs[p, 0], reduced.pairs[p, 1]
  kh = reduced.counts[h]
  return p, reduced.offsets[g] + k // kh, reduced.offsets[h] + k % kh


def _arc_consistent(reduced: Reduced) -> np.ndarray:
  """[V] bool: variables that survive arc consistency."""
  allowed = np.isfinite(reduced.unary)
  p, row, col = _pair_entries(reduced)
  finite = np.isfinite(reduced.pair_costs)
  row_slot = _slot(reduced, p, row, side=0)
  col_slot = _slot(reduced, p, col, side=1)
  while True:
    ok = finite & allowed[row] & allowed[col]
    row_support = np.bincount(row_slot, weights=ok, minlength=_slots(reduced, 0)[-1]) > 0
    col_support = np.bincount(col_slot, weights=ok, minlength=_slots(reduced, 1)[-1]) > 0
    dead = np.zeros(len(allowed), bool)
    dead[_slot_var(reduced, 0)[~row_support]] = True
    dead[_slot_var(reduced, 1)[~col_support]] = True
    new = allowed & ~dead
    if np.array_equal(new, allowed):
      return allowed
    allowed = new


def _slots(reduced: Reduced, side: int) -> np.ndarray:
  """Offsets of per-pair rows (side 0) or columns (side 1)."""
  return offsets_from_counts(reduced.counts[reduced.pairs[:, side]])


def _slot(reduced: Reduced, p: np.ndarray, var: np.ndarray, side: int) -> np.ndarray:
  """Index of (pair, strategy on `side`) for each entry."""
  group = reduced.pairs[p, side]
  return _slots(reduced, side)[p] + var - reduced.offsets[group]


def _slot_var(reduced: Reduced, side: int) -> np.ndarray:
  """Variable of each (pair, strategy on `side`) slot."""
  groups = reduced.pairs[:, side]
  sizes = reduced.counts[groups]
  first = np.repeat(reduced.offsets[groups], sizes)
  return first + np.arange(sizes.sum()) - np.repeat(offsets_from_counts(sizes)[:-1], sizes)


def _restrict(reduced: Reduced, state: _Grouping, allowed: np.ndarray) -> None:
  """Drops disallowed group strategies from every member's map."""
  roots = np.unique(state.root)
  for g, r in enumerate(roots):
    keep = allowed[reduced.offsets[g]:reduced.offsets[g + 1]]
    if not keep.all():
      for m in state.members[int(r)]:
        state.maps[m] = state.maps[m][keep]


def _merge_determined(reduced: Reduced, state: _Grouping) -> bool:
  """Merges groups determined by a neighbour across one pair; True if any."""
  p, row, col = _pair_entries(reduced)
  finite = np.isfinite(reduced.pair_costs)
  row_slot, col_slot = _slot(reduced, p, row, 0), _slot(reduced, p, col, 1)
  row_count = np.bincount(row_slot, weights=finite, minlength=_slots(reduced, 0)[-1])
  col_count = np.bincount(col_slot, weights=finite, minlength=_slots(reduced, 1)[-1])
  num_pairs = len(reduced.pairs)
  row_pair = np.repeat(np.arange(num_pairs), reduced.counts[reduced.pairs[:, 0]])
  col_pair = np.repeat(np.arange(num_pairs), reduced.counts[reduced.pairs[:, 1]])
  g_decides = np.bincount(row_pair, weights=row_count != 1, minlength=num_pairs) == 0
  h_decides = np.bincount(col_pair, weights=col_count != 1, minlength=num_pairs) == 0
  # The partner of each row (column) when it is unique.
  row_partner = np.zeros(len(row_count), np.int64)
  row_partner[row_slot[finite]] = (col - reduced.offsets[reduced.pairs[p, 1]])[finite]
  col_partner = np.zeros(len(col_count), np.int64)
  col_partner[col_slot[finite]] = (row - reduced.offsets[reduced.pairs[p, 0]])[finite]
  rows, cols = _slots(reduced, 0), _slots(reduced, 1)

  roots = np.unique(state.root)
  size = [len(state.members[int(r)]) for r in roots]
  # Within this pass: the group each group now belongs to, the groups each one
  # absorbed, and for absorbed ones the map from their owner's strategies.
  owner = np.arange(len(roots))
  absorbed = [[] for _ in roots]
  via = {}
  merged = False
  for q in np.flatnonzero(g_decides | h_decides):
    g, h = (int(x) for x in reduced.pairs[q])
    options = []
    if g_decides[q]:
      options.append((g, h, row_partner[rows[q]:rows[q + 1]]))
    if h_decides[q]:
      options.append((h, g, col_partner[cols[q]:cols[q + 1]]))
    options.sort(key=lambda o: -size[owner[o[0]]])
    for decider, decided, partner in options:
      top = owner[decider]
      if owner[decided] != decided or top == decided:
        continue
      new_map = partner if decider == top else partner[via[decider]]
      _absorb(state, int(roots[top]), int(roots[decided]), new_map)
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
