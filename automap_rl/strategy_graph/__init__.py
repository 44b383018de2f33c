"""The strategy graph of a program on a mesh: Alpa's intra-op problem, from the simulator's terms.

Our plans are class decisions, so the graph's choices are made where decisions are made
and the per-op strategies follow from them:

* A *class node* per named dimension that some value dim or op factor carries: its
  strategies are "unsharded", each mesh axis that divides one of its dims, and (with
  `max_axes=2`) each ordered pair of distinct axes (a, b) whose product divides one of
  its dims: the dimension sharded over a, then b, as FSDP x TP plans shard a batch or a
  stored weight over two data axes. A plan is an *assignment*: a tuple of at most
  `max_axes` axes per class.
* The assignment becomes a decision list by a fixed decision *order* (`build`'s `order`):
  each class's k-th axis is decided at its k-th *slot* (`decision_slots`; by default a
  class's axes side by side; `order_from` keeps a plan's places, so that an FSDP x TP
  expert, which decides a weight's dim on the model axis early and on a data axis late, is
  a plan of the graph). Earlier decisions win conflicts (two classes of one op on one
  axis), as in every decision list. Pair strategies are handed out to class nodes in the
  order of their first slots while every site's assignments stay within
  `MAX_SITE_ASSIGNMENTS`; the other nodes keep single axes.
* A *site node* per op signature and per value signature (the units the simulator costs):
  its strategies are the distinct ways the assignment of its classes resolves it. An op
  site covers the op's factors, the values of its edges and, for a linear combination of
  partial sums, the reduction factors of the op it reduces for; a value site its dims.
  Each strategy's cost and memory come from `simulator.terms` on a resolution that sets
  exactly those masks: an op site costs its compute plus the collectives of its edges
  (all-gather, all-to-all, reduce-scatter, all-reduce) and holds its gathered operand
  copies at every time; a value site costs the compute of the ops that follow it.
* A *consistency edge* joins each site to each of its classes: cost 0 for a strategy the
  class's choice allows, `FORBIDDEN` otherwise. A site's strategy is the set of
  assignments of its classes that resolve it alike, kept only when that set is a product
  of per-class sets (else split into single assignments), so pairwise consistency is
  exact: every graph plan within the limits is an assignment, and its site strategies are
  what resolving its decision list gives.
* *Memory nodes*: each value signature's live bytes over the simulator's probe rows (time
  = row, in program order) are cut into constant intervals, each a node that mirrors its
  value site (a diagonal edge) with usage bytes / shards.

Hence for every assignment the graph's cost is the simulator's step time and its peak
usage the simulator's peak memory (`tests/test_strategy_graph.py`), but for operand copies
gathered for one read alone: the simulator adds the largest of them to the peak, the graph
each of them (a bound above, so a graph plan within the limit fits). The usage limit is
the device's memory. Resolution runs per *row* (a value signature's dims or an op
signature's factors): a row's masks depend only on the decisions of its own classes, in
order, so every joint assignment of a row's classes is resolved once, by the one rule
(`sharding.apply_decision`, decision by decision), and shared by every site that holds
the row. Axes do not resolve independently once a dim can take two: whether a dim takes
its second axis depends on the product with its first, and which of two dims of one
class (seq x seq) takes which axis on the order of the pair. A site with k classes of
domain sizes d_i enumerates prod(d_i) assignments.

*Tied layers* (`tied_classes`, `build(tie=...)`): the classes of a structural group whose
classes are the per-layer dims of an unrolled layer stack (`ir.stacks.layer_stacks`) can
share one class node, so every layer takes the same axes (as PyTorch AutoParallel and
Colossal-Auto tie repeated layers). Sites whose rows have the same classes (up to the
tie) and sizes resolve alike for every assignment, so they share one site node whose
cost is the sum of theirs: a stack of L layers then costs about one layer's nodes and
edges, and its resolutions are computed once. Without a tie, sites still share a node
when their rows are alike.

Building checks a `solver.Limits` (deadline and memory ceiling) between batches and
sites, and stops with `solver.LimitReached` past either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from automap_rl.problem import Problem
from automap_rl.solver import FORBIDDEN, Limits, StrategyGraph, offsets_from_counts
from automap_rl.strategy_graph.costs import live_pieces, local_costs, site_terms
from automap_rl.strategy_graph.domains import (
  MAX_SITE_ASSIGNMENTS,
  capped_domains,
  class_domains,
  decision_slots,
  order_from,
  site_specs,
  tied_classes,
  tied_domains,
)
from automap_rl.strategy_graph.graph import Axes, ProgramGraph, Site
from automap_rl.strategy_graph.sites import build_site, resolve_rows

__all__ = [
  "MAX_SITE_ASSIGNMENTS",
  "Axes",
  "ProgramGraph",
  "Site",
  "build",
  "decision_slots",
  "live_pieces",
  "local_costs",
  "order_from",
  "tied_classes",
]


def build(
  problem: Problem,
  order: Sequence[int] | None = None,
  tie: np.ndarray | None = None,
  limits: Limits = Limits(),
  max_axes: int = 2,
) -> ProgramGraph:
  """The strategy graph of `problem` with class order `order` (default: by id; see
  `order_from` to keep an expert plan's order), costed without collective combining
  (`local_costs`).

  Args:
    problem: the problem.
    order: the decision order of classes: a class's k-th appearance is where its k-th
      axis is decided (`decision_slots`); a class listed fewer times than its axes
      decides the others right after its last appearance. Each class once (the default,
      by id) decides a class's axes side by side.
    tie: each class's class node, int [num_classes] (`tied_classes`; a class node is the
      first class of its tie); default: a node per class.
    limits: checked between batches and sites.
    max_axes: the most mesh axes one class takes: 1 (single axes) or 2 (also ordered
      pairs, as far as `MAX_SITE_ASSIGNMENTS` allows; see the module docstring).

  Raises:
    ValueError: a bad order, tie or `max_axes`, or a site with too many assignments to
      enumerate even with single axes.
    solver.LimitReached: past the deadline or the memory ceiling of `limits`.
  """
  if max_axes not in (1, 2):
    raise ValueError(f"max_axes must be 1 or 2, not {max_axes}")
  problem = local_costs(problem)
  order, tie = _checked(problem, order, tie, max_axes)
  slots = decision_slots(order, max_axes)
  position = {slot: i for i, slot in enumerate(slots)}
  rank = {c: position[c, 0] for c in range(len(problem.named.classes))}
  domains_of_classes = class_domains(problem, max_axes)
  domains = tied_domains(domains_of_classes, tie)
  classes = tuple(sorted(domains, key=rank.__getitem__))
  members = {c: [] for c in classes}
  for cls in sorted(domains_of_classes, key=rank.__getitem__):
    members[int(tie[cls])].append(cls)

  specs, same = [], {}  # One spec per distinct key; the signatures of each.
  for spec in site_specs(problem, rank, tie, position):
    key = spec.key(problem)
    if key not in same:
      specs.append(spec)
      same[key] = []
    same[key].append(spec.index)
  limits.check("grouping the strategy graph's sites")
  domains = capped_domains(domains, specs, classes)
  rows = resolve_rows(problem, specs, domains, rank, tie, position, limits)
  sites = []
  for spec in specs:
    sites.append(build_site(problem, spec, same[spec.key(problem)], domains, rows))
    limits.check("enumerating the strategy graph's site strategies")
  del rows
  graph, memory_site = _lay_out(problem, classes, domains, sites, limits)
  return ProgramGraph(
    problem=problem,
    graph=graph,
    order=order,
    slots=slots,
    classes=classes,
    members=tuple(tuple(members[c]) for c in classes),
    domains=tuple(domains[c] for c in classes),
    sites=tuple(sites),
    memory_site=np.array(memory_site, np.int64),
  )


def _checked(
  problem: Problem, order: Sequence[int] | None, tie: np.ndarray | None, max_axes: int
) -> tuple[tuple[int, ...], np.ndarray]:
  """`build`'s order and tie, the defaults filled in (by id; a node per class).

  Raises:
    ValueError: an order that does not list each class 1 to `max_axes` times, or a tie
      that does not give each class a class that ties to itself.
  """
  num_classes = len(problem.named.classes)
  order = tuple(range(num_classes)) if order is None else tuple(int(c) for c in order)
  counts = (
    np.bincount(np.asarray(order, np.int64), minlength=num_classes)
    if order and min(order) >= 0
    else None
  )
  if counts is None or len(counts) != num_classes or counts.min() < 1 or counts.max() > max_axes:
    raise ValueError(f"order must list each of the {num_classes} classes 1 to {max_axes} times")
  tie = np.arange(num_classes, dtype=np.int64) if tie is None else np.asarray(tie, np.int64)
  if tie.shape != (num_classes,) or np.any(tie[tie] != tie):
    raise ValueError(f"tie must give each of the {num_classes} classes a class that ties to itself")
  return order, tie


def _lay_out(
  problem: Problem,
  classes: Sequence[int],
  domains: Mapping[int, tuple[Axes, ...]],
  sites: Sequence[Site],
  limits: Limits,
) -> tuple[StrategyGraph, list[int]]:
  """The graph's nodes and edges: a class node per class of `classes` (its axes
  `domains[c]`), the site nodes (costed by `site_terms`) with their consistency edges,
  then the memory nodes (`_memory_nodes`); and the site each memory node mirrors, [M]."""
  site_cost, site_usage = site_terms(problem, sites, limits)
  num_nodes = len(classes)
  class_node = {c: i for i, c in enumerate(classes)}
  node_costs = [np.zeros(len(domains[c])) for c in classes]
  node_usages = [np.zeros(len(domains[c])) for c in classes]
  live_rows = problem.tables.live_bytes.shape[0]
  intervals = [(0, 0)] * num_nodes
  edges, edge_costs = [], []
  for s, (site, cost, usage) in enumerate(zip(sites, site_cost, site_usage)):
    node = num_nodes + s
    node_costs.append(cost)
    node_usages.append(usage if site.kind == "op" else np.zeros(site.num_strategies))
    intervals.append((0, live_rows) if site.kind == "op" else (0, 0))
    for cls, allowed in zip(site.classes.tolist(), site.allowed):
      edges.append((node, class_node[cls]))
      edge_costs.append(np.where(allowed, 0.0, float(FORBIDDEN)).ravel())
  nodes = (node_costs, node_usages, intervals, edges, edge_costs)
  memory_site = _memory_nodes(problem, sites, site_usage, num_nodes, nodes, limits)
  counts = [len(c) for c in node_costs]
  limits.check(
    "laying out the strategy graph's edges", allocating=8 * sum(len(c) for c in edge_costs)
  )
  graph = StrategyGraph(
    node_costs=np.concatenate(node_costs).astype(np.float64),
    node_usages=np.concatenate(node_usages).astype(np.float64),
    node_offsets=offsets_from_counts(counts),
    intervals=np.array(intervals, np.int64).reshape(-1, 2),
    edges=np.array(edges, np.int64).reshape(-1, 2),
    edge_costs=np.concatenate(edge_costs) if edge_costs else np.zeros(0),
    edge_offsets=offsets_from_counts([len(c) for c in edge_costs]),
    usage_limit=float(problem.tables.hbm_bytes),
    name="program",
  )
  return graph, memory_site


def _memory_nodes(
  problem: Problem,
  sites: Sequence[Site],
  site_usage: Sequence[np.ndarray],
  num_nodes: int,
  nodes: tuple[list, list, list, list, list],
  limits: Limits,
) -> list[int]:
  """Appends to `nodes` (node costs, node usages, intervals, edges, edge costs) a memory
  node per constant piece of each value site's live bytes (`live_pieces` of its
  `live_bytes` column), with usage bytes / shards and a diagonal edge to the site (node
  `num_nodes + s`); returns the site each mirrors, [M]."""
  node_costs, node_usages, intervals, edges, edge_costs = nodes
  memory_site = []
  for s, site in enumerate(sites):
    if site.kind != "value":
      continue
    limits.check("laying out the strategy graph's memory nodes")
    diagonal = np.where(np.eye(site.num_strategies, dtype=bool), 0.0, float(FORBIDDEN)).ravel()
    for v in site.indices:
      for start, end, amount in live_pieces(problem.tables.live_bytes[:, v].astype(np.float64)):
        memory_site.append(s)
        node_costs.append(np.zeros(site.num_strategies))
        node_usages.append(amount / site_usage[s])
        intervals.append((start, end))
        edges.append((len(node_costs) - 1, num_nodes + s))
        edge_costs.append(diagonal)
  return memory_site
