"""The strategy graph of a program on a mesh: Alpa's intra-op problem, from the simulator's terms.

Our plans are class decisions, so the graph's choices are made where decisions are made
and the per-op strategies follow from them:

* A *class node* per named dimension that some value dim or op factor carries: its
  strategies are "unsharded" and each mesh axis that divides one of its dims. A plan is
  an *assignment*: at most one axis per class.
* The assignment becomes a decision list by a fixed class *order* (`ProgramGraph.order`):
  `[Decision(c, axis of c) for c in order if c has an axis]`. Earlier decisions win
  conflicts (two classes of one op on one axis), as in every decision list.
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
usage the simulator's peak memory (`tests/test_strategy_graph.py`), and the usage limit is
the device's memory. Resolution runs per mesh axis (with at most one axis per class, a dim
takes at most one axis, so axes resolve independently): per site and axis, every subset of
its classes on that axis is resolved by `sharding.resolve` itself, and an assignment's
masks are the OR over axes. A site with k classes and X axes enumerates at most
(X + 1)**k assignments.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import simulator
from automap_rl.problem import Problem
from automap_rl.sharding import Decision, Resolution
from automap_rl.solver import FORBIDDEN, StrategyGraph

_CHUNK = 256  # Plans per jitted resolve / terms call (one compile per problem).
MAX_SITE_ASSIGNMENTS = 1 << 18  # A site with more assignments than this is refused.


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
  """One op or value signature's node.

  Let k classes, A = prod of their domain sizes (assignments), n strategies, L mask entries.

  Attributes:
    kind: "op" or "value".
    index: the signature.
    classes: its classes in the graph's order, [k].
    radix: domain size of each class, [k]; assignment a has index sum_i a_i * prod(radix[i+1:]).
    lookup: the strategy of each assignment index, int64 [A].
    allowed: per class, which domain entries each strategy allows, bool [n, d_i] each.
    masks: each strategy's resolved axis bit masks, int8 [n, L]: the op's factors [Rf], then
      one [Rv] row per edge value, then (combinations) the source op's factors [Rf].
  """

  kind: str
  index: int
  classes: np.ndarray
  radix: np.ndarray
  lookup: np.ndarray
  allowed: tuple[np.ndarray, ...]
  masks: np.ndarray

  @property
  def num_strategies(self) -> int:
    return len(self.masks)


@dataclasses.dataclass(frozen=True, eq=False)
class ProgramGraph:
  """A `solver.StrategyGraph` of a problem, with the maps between its plans and decisions.

  Nodes: class nodes [0, C), then op sites, value sites, then memory nodes.

  Attributes:
    problem: the problem.
    graph: the strategy graph; costs in seconds, usages in bytes per device, the limit the
      device's memory.
    order: class ids in decision order; `classes` sorted by it.
    classes: the class of each class node, [C].
    domains: each class node's axes per strategy (-1: unsharded), a tuple per class node.
    sites: the site nodes, in node order from C.
    memory_site: the site index each memory node mirrors, [M].
  """

  problem: Problem
  graph: StrategyGraph
  order: tuple[int, ...]
  classes: tuple[int, ...]
  domains: tuple[tuple[int, ...], ...]
  sites: tuple[Site, ...]
  memory_site: np.ndarray

  def choice(self, assignment: Mapping[int, int]) -> np.ndarray:
    """The graph plan of an assignment (class -> axis index; absent classes unsharded), [N].
    Raises ValueError for an axis outside a class's domain."""
    picks = np.zeros(len(self.classes), np.int64)
    axis_of = {}
    for node, (cls, domain) in enumerate(zip(self.classes, self.domains)):
      axis = assignment.get(cls, -1)
      if axis not in domain:
        raise ValueError(f"class {cls} cannot take axis {axis} (its axes: {domain[1:]})")
      picks[node] = domain.index(axis)
      axis_of[cls] = picks[node]
    site_choice = np.array([_site_strategy(site, axis_of) for site in self.sites], np.int64)
    return np.concatenate([picks, site_choice, site_choice[self.memory_site]])

  def assignment(self, choice: Sequence[int] | np.ndarray) -> dict[int, int]:
    """The assignment (class -> axis index) of a graph plan's class nodes."""
    return {cls: domain[int(choice[node])] for node, (cls, domain) in enumerate(zip(self.classes, self.domains))
            if domain[int(choice[node])] >= 0}

  def decisions(self, choice: Sequence[int] | np.ndarray) -> list[Decision]:
    """The decision list of a graph plan: its classes' axes in the graph's order."""
    assignment = self.assignment(choice)
    names = self.problem.mesh.axis_names
    return [Decision(cls, names[assignment[cls]]) for cls in self.order if cls in assignment]

  def assignment_of(self, decisions: Sequence[Decision]) -> dict[int, int] | None:
    """The assignment whose decision list (in the graph's order) resolves like `decisions`,
    or None when there is none: a class decided on two axes, or two classes decided in an
    order other than the graph's (only first decisions of a (class, axis) count)."""
    dec_class, dec_axis = self.problem.encode(decisions)
    assignment: dict[int, int] = {}
    for cls, axis in zip(dec_class.tolist(), dec_axis.tolist()):
      if assignment.setdefault(cls, axis) != axis:
        return None
    rank = {cls: i for i, cls in enumerate(self.order)}
    firsts = list(assignment)
    if [rank[c] for c in firsts] != sorted(rank[c] for c in firsts):
      return None
    domain = dict(zip(self.classes, self.domains))
    return {c: a for c, a in assignment.items() if a in domain.get(c, ())}


def _site_strategy(site: Site, axis_of: Mapping[int, int]) -> int:
  index = 0
  for cls, size in zip(site.classes.tolist(), site.radix.tolist()):
    index = index * size + int(axis_of[cls])
  return int(site.lookup[index])


def order_from(problem: Problem, decisions: Sequence[Decision] = ()) -> tuple[int, ...]:
  """A class order that keeps the first decisions' order: their classes first, then the
  rest by id."""
  dec_class, _ = problem.encode(decisions)
  first = list(dict.fromkeys(int(c) for c in dec_class))
  seen = set(first)
  return tuple(first + [c for c in range(len(problem.named.classes)) if c not in seen])


def _class_domains(problem: Problem) -> dict[int, tuple[int, ...]]:
  """Class -> (-1, axes that divide some dim or factor of the class), for classes that some
  value-signature dim or op-signature factor carries."""
  sigs, sizes = problem.sigs, problem.mesh.axis_sizes
  domains: dict[int, set[int]] = {}
  for classes, dims in ((sigs.value_class, sigs.value_size), (sigs.op_class, sigs.op_size)):
    for cls, size in zip(classes.ravel().tolist(), dims.ravel().tolist()):
      if cls >= 0:
        domains.setdefault(cls, set()).update(x for x, n in enumerate(sizes) if size % n == 0)
  return {cls: (-1, *sorted(axes)) for cls, axes in domains.items()}


@dataclasses.dataclass(frozen=True)
class _SiteSpec:
  """What a site reads: the rows of the resolution ("op"/"value", signature) and its classes."""

  kind: str
  index: int
  rows: tuple[tuple[str, int], ...]
  classes: tuple[int, ...]


def _site_specs(problem: Problem, rank: Mapping[int, int]) -> list[_SiteSpec]:
  sigs, tables = problem.sigs, problem.tables
  specs = []
  for o in range(len(sigs.op_keys)):
    rows = [("op", o)] + [("value", int(v)) for v in tables.edge_value[tables.edge_op == o]]
    source = int(tables.op_reduction_source[o])
    if source != o:
      rows.append(("op", source))
    specs.append(_SiteSpec("op", o, tuple(rows), _classes_of(problem, rows, rank)))
  for v in range(len(sigs.value_keys)):
    rows = [("value", v)]
    specs.append(_SiteSpec("value", v, tuple(rows), _classes_of(problem, rows, rank)))
  return specs


def _classes_of(problem: Problem, rows: Sequence[tuple[str, int]], rank: Mapping[int, int]) -> tuple[int, ...]:
  sigs = problem.sigs
  found = set()
  for kind, i in rows:
    found.update(int(c) for c in (sigs.op_class[i] if kind == "op" else sigs.value_class[i]) if c >= 0)
  return tuple(sorted(found, key=rank.__getitem__))


def _resolved_rows(problem: Problem, dec_class: np.ndarray, dec_axis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`sharding.resolve` of a batch of decision lists [B, K]: value masks int8 [B, Uv, Rv]
  and op masks int8 [B, Uo, Rf]."""
  fn = _resolve_batch(problem)
  value_parts, op_parts = [], []
  for start in range(0, len(dec_class), _CHUNK):
    part_class, part_axis = (_pad_rows(x[start:start + _CHUNK], _CHUNK) for x in (dec_class, dec_axis))
    resolution = jax.device_get(fn(part_class, part_axis))
    n = min(_CHUNK, len(dec_class) - start)
    value_parts.append(np.asarray(resolution.value_mask[:n], np.int8))
    op_parts.append(np.asarray(resolution.op_mask[:n], np.int8))
  return np.concatenate(value_parts), np.concatenate(op_parts)


@functools.lru_cache(maxsize=8)
def _resolve_batch(problem: Problem):
  return jax.jit(jax.vmap(problem.resolve))


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return np.concatenate([x, np.full((rows - len(x), *x.shape[1:]), -1, x.dtype)]) if len(x) < rows else x


def _axis_features(problem: Problem, specs: Sequence[_SiteSpec], domains: Mapping[int, tuple[int, ...]]):
  """Per site and axis, the resolved masks of every subset of its classes that can take
  the axis, decided on that axis alone (in order): int8 [2**k_x, L] per (site, axis)."""
  num_axes = len(problem.mesh.axis_sizes)
  width = max([len(s.classes) for s in specs] + [1])
  lists, where = [], []
  for spec in specs:
    for axis in range(num_axes):
      able = [c for c in spec.classes if axis in domains[c]]
      if 1 << len(able) > MAX_SITE_ASSIGNMENTS:
        raise ValueError(f"{spec.kind} signature {spec.index} has {len(able)} classes that can take axis {axis}: "
                         "too many to enumerate")
      where.append(len(lists))
      for subset in range(1 << len(able)):
        lists.append([c for i, c in enumerate(able) if subset >> i & 1])
  dec_class = np.full((len(lists), width), -1, np.int32)
  for i, classes in enumerate(lists):
    dec_class[i, :len(classes)] = classes
  dec_axis = np.zeros_like(dec_class)
  site_axis = np.repeat(np.arange(len(specs) * num_axes), np.diff(where + [len(lists)]))
  dec_axis[:] = (site_axis % num_axes)[:, None]
  dec_axis[dec_class < 0] = -1
  value_mask, op_mask = _resolved_rows(problem, dec_class, dec_axis)
  out = []
  for s, spec in enumerate(specs):
    per_axis = []
    for axis in range(num_axes):
      start = where[s * num_axes + axis]
      count = 1 << sum(axis in domains[c] for c in spec.classes)
      rows = slice(start, start + count)
      per_axis.append(np.concatenate([op_mask[rows, i] if kind == "op" else value_mask[rows, i]
                                      for kind, i in spec.rows], axis=1))
    out.append(per_axis)
  return out


def _build_site(spec: _SiteSpec, domains: Mapping[int, tuple[int, ...]], per_axis: Sequence[np.ndarray]) -> Site:
  """Enumerates a site's assignments, groups those that resolve alike into strategies
  (product sets only, see the module docstring)."""
  radix = np.array([len(domains[c]) for c in spec.classes], np.int64)
  total = int(np.prod(radix))
  if total > MAX_SITE_ASSIGNMENTS:
    raise ValueError(f"{spec.kind} signature {spec.index} has {total} assignments of its classes: too many")
  digits = np.stack(np.unravel_index(np.arange(total), tuple(radix.tolist())), axis=1) if len(radix) else \
      np.zeros((1, 0), np.int64)  # [A, k]: each class's domain index.
  axis = np.stack([np.array(domains[c])[digits[:, i]] for i, c in enumerate(spec.classes)], axis=1) \
      if len(radix) else digits  # [A, k]: each class's axis.
  masks = np.zeros((total, per_axis[0].shape[1]), np.int8)
  for x, features in enumerate(per_axis):
    able = [i for i, c in enumerate(spec.classes) if x in domains[c]]
    subset = np.zeros(total, np.int64)
    for bit, i in enumerate(able):
      subset |= (axis[:, i] == x).astype(np.int64) << bit
    masks |= features[subset]
  _, inverse = np.unique(masks, axis=0, return_inverse=True)
  inverse = inverse.reshape(-1)
  groups = int(inverse.max()) + 1
  product = np.ones(groups, np.int64)
  for i, size in enumerate(radix.tolist()):
    present = np.zeros((groups, size), bool)
    present[inverse, digits[:, i]] = True
    product *= present.sum(axis=1)
  whole = product == np.bincount(inverse, minlength=groups)
  # A product set is one strategy; any other group splits into single assignments.
  key = np.where(whole[inverse], inverse, groups + np.arange(total))
  _, first, lookup = np.unique(key, return_index=True, return_inverse=True)
  rank = np.empty(len(first), np.int64)
  rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # Strategies by first assignment.
  lookup = rank[lookup.reshape(-1)]
  allowed = []
  for i, size in enumerate(radix.tolist()):
    table = np.zeros((len(first), size), bool)
    table[lookup, digits[:, i]] = True
    allowed.append(table)
  return Site(kind=spec.kind, index=spec.index, classes=np.array(spec.classes, np.int64), radix=radix,
              lookup=lookup, allowed=tuple(allowed), masks=masks[np.sort(first)])


def _site_terms(problem: Problem, sites: Sequence[Site]) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each site's strategy costs (seconds) and usages (bytes: gathered operands of an op
  site; for a value site, the shard count its memory nodes divide by), [n] each."""
  tables = problem.tables
  op_sites = [s for s in sites if s.kind == "op"]
  value_sites = [s for s in sites if s.kind == "value"]
  cost: dict[int, np.ndarray] = {}
  usage: dict[int, np.ndarray] = {}

  # Op sites: every edge gets a private value signature and every combination of partial
  # sums a private copy of its source op, so that one batch of resolutions sets each op
  # site's masks independently of the others'.
  num_ops, num_edges = len(tables.op_compute_s), len(tables.edge_op)
  combos = [s.index for s in op_sites if int(tables.op_reduction_source[s.index]) != s.index]
  copy_of = {o: num_ops + j for j, o in enumerate(combos)}
  sources = [int(tables.op_reduction_source[o]) for o in combos]
  source = np.concatenate([np.arange(num_ops), np.arange(num_ops, num_ops + len(combos))]).astype(np.int32)
  source[combos] = [copy_of[o] for o in combos]
  private = tables.replace(
      value_bytes=tables.value_bytes[tables.edge_value],
      value_compute_s=np.zeros(num_edges, np.float32), value_memory_s=np.zeros(num_edges, np.float32),
      edge_value=np.arange(num_edges, dtype=np.int32), live_bytes=np.zeros((1, num_edges), np.float32),
      op_compute_s=np.concatenate([tables.op_compute_s, np.zeros(len(combos), np.float32)]),
      op_memory_s=np.concatenate([tables.op_memory_s, np.zeros(len(combos), np.float32)]),
      op_reduction=np.concatenate([tables.op_reduction, tables.op_reduction[sources]]),
      op_reduction_source=source,
      op_deferred=np.concatenate([tables.op_deferred, np.zeros(len(combos), bool)]),
      op_dense_factor=np.concatenate([tables.op_dense_factor, np.full(len(combos), -1, np.int32)]))
  rf, rv = problem.sigs.op_class.shape[1], problem.sigs.value_class.shape[1]
  edges_of = [np.flatnonzero(tables.edge_op == o) for o in range(num_ops)]
  batch = max([s.num_strategies for s in op_sites] + [1])
  op_mask = np.zeros((batch, num_ops + len(combos), rf), np.int32)
  value_mask = np.zeros((batch, num_edges, rv), np.int32)
  for site in op_sites:
    pick = site.masks[np.minimum(np.arange(batch), site.num_strategies - 1)]  # [B, L]
    o, edges = site.index, edges_of[site.index]
    op_mask[:, o] = pick[:, :rf]
    value_mask[:, edges] = pick[:, rf:rf + rv * len(edges)].reshape(batch, len(edges), rv)
    if o in copy_of:
      op_mask[:, copy_of[o]] = pick[:, rf + rv * len(edges):]
  terms = _terms_batch(private, value_mask, op_mask)
  edge_seconds = terms.gather.seconds + terms.all_to_all.seconds  # [B, E]
  reduction_seconds = terms.reduce_scatter.seconds + terms.all_reduce.seconds  # [B, R]
  per_op = terms.op_compute_s[:, :num_ops].astype(np.float64)
  np.add.at(per_op.T, tables.edge_op, edge_seconds.T)
  np.add.at(per_op.T, tables.edge_op[tables.reduction_edge], reduction_seconds.T)
  gathered = np.zeros((batch, num_ops))
  np.add.at(gathered.T, tables.edge_op, terms.gathered_bytes.T)
  for site in op_sites:
    cost[id(site)] = per_op[:site.num_strategies, site.index]
    usage[id(site)] = gathered[:site.num_strategies, site.index]

  batch = max([s.num_strategies for s in value_sites] + [1])
  value_mask = np.zeros((batch, len(tables.value_bytes), rv), np.int32)
  for site in value_sites:
    value_mask[:, site.index] = site.masks[np.minimum(np.arange(batch), site.num_strategies - 1)]
  terms = _terms_batch(tables, value_mask, np.zeros((batch, num_ops, rf), np.int32))
  for site in value_sites:
    cost[id(site)] = terms.value_compute_s[:site.num_strategies, site.index].astype(np.float64)
    usage[id(site)] = terms.value_shards[:site.num_strategies, site.index].astype(np.float64)
  return [cost[id(s)] for s in sites], [usage[id(s)] for s in sites]


def _terms_batch(tables: simulator.CostTables, value_mask: np.ndarray, op_mask: np.ndarray) -> simulator.CostTerms:
  """`simulator.terms` of a batch of resolutions (masks [B, ...]), as numpy [B, ...]."""
  fn = jax.jit(jax.vmap(lambda v, o: simulator.terms(tables, Resolution(value_mask=v, op_mask=o))))
  parts = []
  for start in range(0, len(value_mask), _CHUNK):
    v, o = (jnp.asarray(x[start:start + _CHUNK]) for x in (value_mask, op_mask))
    parts.append(jax.device_get(fn(v, o)))
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def live_pieces(profile: np.ndarray) -> list[tuple[int, int, float]]:
  """A non-negative profile [T] as constant pieces `(start, end, amount)` whose sum at every
  t in [start, end) is `profile[t]`: at most 2T pieces (a stack of open layers)."""
  pieces, stack = [], []  # Stack of (start, top level of the layer).
  for t, level in enumerate([*profile.tolist(), 0.0]):
    while stack and stack[-1][1] > level:
      start, top = stack.pop()
      below = stack[-1][1] if stack else 0.0
      pieces.append((start, t, top - max(below, level)))
      if below < level:
        stack.append((start, level))
    if level > (stack[-1][1] if stack else 0.0):
      stack.append((t, level))
  return pieces


def without_combining(problem: Problem) -> Problem:
  """`problem` with no reduction combined by XLA's combiners (`CostTables.reduction_combines`
  off): every reduction then pays its own latency, a cost local to its edge. A graph's
  costs are sums of per-node and per-edge terms, so the graph is built on this problem;
  the plan cost it gives is exactly this problem's and an upper bound on `problem`'s
  (combining only merges latencies)."""
  tables = dataclasses.replace(problem.tables, reduction_combines=np.zeros_like(problem.tables.reduction_combines))
  return Problem(problem.program, problem.named, problem.mesh, problem.sigs, tables)


def build(problem: Problem, order: Sequence[int] | None = None) -> ProgramGraph:
  """The strategy graph of `problem` with class order `order` (default: by id; see
  `order_from` to keep an expert plan's order), costed without collective combining
  (`without_combining`)."""
  problem = without_combining(problem)
  order = tuple(range(len(problem.named.classes))) if order is None else tuple(int(c) for c in order)
  if sorted(order) != list(range(len(problem.named.classes))):
    raise ValueError(f"order must list each of the {len(problem.named.classes)} classes once")
  rank = {c: i for i, c in enumerate(order)}
  domains = _class_domains(problem)
  classes = tuple(c for c in order if c in domains)
  specs = _site_specs(problem, rank)
  sites = tuple(_build_site(spec, domains, per_axis)
                for spec, per_axis in zip(specs, _axis_features(problem, specs, domains)))
  site_cost, site_usage = _site_terms(problem, sites)

  num_classes = len(classes)
  class_node = {c: i for i, c in enumerate(classes)}
  node_costs = [[0.0] * len(domains[c]) for c in classes]
  node_usages = [[0.0] * len(domains[c]) for c in classes]
  live_rows = problem.tables.live_bytes.shape[0]
  intervals = [(0, 0)] * num_classes
  edges, edge_costs = [], []
  value_site = {}
  for s, (site, cost, usage) in enumerate(zip(sites, site_cost, site_usage)):
    node = num_classes + s
    node_costs.append(cost.tolist())
    if site.kind == "op":
      node_usages.append(usage.tolist())
      intervals.append((0, live_rows))
    else:
      node_usages.append([0.0] * site.num_strategies)
      intervals.append((0, 0))
      value_site[site.index] = s
    for cls, allowed in zip(site.classes.tolist(), site.allowed):
      edges.append((node, class_node[cls]))
      edge_costs.append(np.where(allowed, 0.0, float(FORBIDDEN)).ravel().tolist())
  memory_site = []
  for v, s in sorted(value_site.items()):
    shards = site_usage[s]
    for start, end, amount in live_pieces(problem.tables.live_bytes[:, v].astype(np.float64)):
      node = len(node_costs)
      memory_site.append(s)
      node_costs.append([0.0] * len(shards))
      node_usages.append((amount / shards).tolist())
      intervals.append((start, end))
      edges.append((node, num_classes + s))
      edge_costs.append(np.where(np.eye(len(shards), dtype=bool), 0.0, float(FORBIDDEN)).ravel().tolist())
  graph = StrategyGraph.from_lists(node_costs, node_usages, intervals, edges, edge_costs,
                                   usage_limit=float(problem.tables.hbm_bytes), name="program")
  return ProgramGraph(problem=problem, graph=graph, order=order, classes=classes,
                      domains=tuple(domains[c] for c in classes), sites=sites,
                      memory_site=np.array(memory_site, np.int64))
