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

*Tied layers* (`tied_classes`, `build(tie=...)`): the classes of a structural group whose
classes are the per-layer dims of an unrolled layer stack (`ir.stacks.layer_stacks`) can
share one class node, so every layer takes the same axis (as PyTorch AutoParallel and
Colossal-Auto tie repeated layers). Sites whose rows have the same classes (up to the
tie) and sizes resolve alike for every assignment, so they share one site node whose
cost is the sum of theirs: a stack of L layers then costs about one layer's nodes and
edges, and its resolutions are computed once. Without a tie, sites still share a node
when their rows are alike.

Building checks a `solver.Limits` (deadline and memory ceiling) between batches and
sites, and stops with `solver.LimitReached` past either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import simulator
from automap_rl.ir import stacks
from automap_rl.problem import Problem
from automap_rl.sharding import Decision, Resolution
from automap_rl.solver import FORBIDDEN, Limits, StrategyGraph, offsets_from_counts

_CHUNK = 256  # Plans per jitted resolve / terms call (one compile per problem).
MAX_SITE_ASSIGNMENTS = 1 << 18  # A site with more assignments than this is refused.


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
  """One node standing for op or value signatures that resolve alike.

  Let k class nodes, A = prod of their domain sizes (assignments), n strategies, L mask
  entries.

  Attributes:
    kind: "op" or "value".
    indices: the signatures it stands for (several when their rows resolve alike: the
      same op in every tied layer).
    classes: its class nodes' classes in the graph's order, [k].
    radix: domain size of each class node, [k]; assignment a has index
      sum_i a_i * prod(radix[i+1:]).
    lookup: the strategy of each assignment index, int64 [A].
    allowed: per class node, which domain entries each strategy allows, bool [n, d_i] each.
    masks: each strategy's resolved axis bit masks, int8 [n, L]: the op's factors [Rf], then
      one [Rv] row per edge value, then (combinations) the source op's factors [Rf] (of
      its first signature; the others' are alike).
  """

  kind: str
  indices: tuple[int, ...]
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

  Nodes: class nodes [0, C), then sites, then memory nodes.

  Attributes:
    problem: the problem.
    graph: the strategy graph; costs in seconds, usages in bytes per device, the limit the
      device's memory.
    order: class ids in decision order; `classes` sorted by it.
    classes: the class of each class node (the first of its tied classes), [C].
    members: the classes each class node decides (itself and the classes tied to it).
    domains: each class node's axes per strategy (-1: unsharded), a tuple per class node.
    sites: the site nodes, in node order from C.
    memory_site: the site index each memory node mirrors, [M].
  """

  problem: Problem
  graph: StrategyGraph
  order: tuple[int, ...]
  classes: tuple[int, ...]
  members: tuple[tuple[int, ...], ...]
  domains: tuple[tuple[int, ...], ...]
  sites: tuple[Site, ...]
  memory_site: np.ndarray

  @property
  def tied(self) -> bool:
    """Whether some class node decides several classes."""
    return any(len(m) > 1 for m in self.members)

  def choice(self, assignment: Mapping[int, int]) -> np.ndarray:
    """The graph plan of an assignment (class -> axis index; absent classes unsharded), [N].
    Raises ValueError for an axis outside a class's domain or tied classes that differ."""
    picks = np.zeros(len(self.classes), np.int64)
    axis_of = {}
    for node, (cls, members, domain) in enumerate(zip(self.classes, self.members, self.domains)):
      axes = {assignment.get(m, -1) for m in members}
      if len(axes) > 1:
        raise ValueError(f"classes {members} are tied but the assignment gives them the axes {sorted(axes)}")
      axis = axes.pop()
      if axis not in domain:
        raise ValueError(f"class {cls} cannot take axis {axis} (its axes: {domain[1:]})")
      picks[node] = domain.index(axis)
      axis_of[cls] = picks[node]
    site_choice = np.array([_site_strategy(site, axis_of) for site in self.sites], np.int64)
    return np.concatenate([picks, site_choice, site_choice[self.memory_site]])

  def assignment(self, choice: Sequence[int] | np.ndarray) -> dict[int, int]:
    """The assignment (class -> axis index) of a graph plan's class nodes."""
    return {m: domain[int(choice[node])] for node, (members, domain) in enumerate(zip(self.members, self.domains))
            if domain[int(choice[node])] >= 0 for m in members}

  def decisions(self, choice: Sequence[int] | np.ndarray) -> list[Decision]:
    """The decision list of a graph plan: its classes' axes in the graph's order."""
    assignment = self.assignment(choice)
    names = self.problem.mesh.axis_names
    return [Decision(cls, names[assignment[cls]]) for cls in self.order if cls in assignment]

  def assignment_of(self, decisions: Sequence[Decision]) -> dict[int, int] | None:
    """The assignment whose decision list (in the graph's order) resolves like `decisions`,
    or None when there is none: a class decided on two axes, two classes decided in an
    order other than the graph's (only first decisions of a (class, axis) count), or tied
    classes decided differently."""
    dec_class, dec_axis = self.problem.encode(decisions)
    assignment: dict[int, int] = {}
    for cls, axis in zip(dec_class.tolist(), dec_axis.tolist()):
      if assignment.setdefault(cls, axis) != axis:
        return None
    rank = {cls: i for i, cls in enumerate(self.order)}
    firsts = list(assignment)
    if [rank[c] for c in firsts] != sorted(rank[c] for c in firsts):
      return None
    domain = {m: d for members, d in zip(self.members, self.domains) for m in members}
    assignment = {c: a for c, a in assignment.items() if a in domain.get(c, ())}
    if any(len({assignment.get(m, -1) for m in members}) > 1 for members in self.members):
      return None
    return assignment


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


def tied_classes(problem: Problem) -> np.ndarray:
  """Each class's tie, int64 [num_classes]: the first class of its structural group
  (`NamedDims.groups`) when that group's classes are per-layer dims of an unrolled layer
  stack (one class per layer: the same dim of the same weight in every layer), else the
  class itself. A scanned stack needs no tie: its loop body is one op for every layer."""
  tie = np.arange(len(problem.named.classes), dtype=np.int64)
  layered = {c for stack in stacks.layer_stacks(problem.program, problem.named) if not stack.scanned
             for c in stack.layer_classes}
  for group in problem.named.groups:
    if len(group) > 1 and layered.issuperset(group):
      tie[list(group)] = min(group)
  return tie


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


def _tied_domains(domains: Mapping[int, tuple[int, ...]], tie: np.ndarray) -> dict[int, tuple[int, ...]]:
  """Class node -> the axes every one of its classes can take (the first class of the tie
  that some signature carries names the node)."""
  axes: dict[int, set[int]] = {}
  for cls in sorted(domains):
    axes.setdefault(int(tie[cls]), set(domains[cls][1:])).intersection_update(domains[cls][1:])
  return {node: (-1, *sorted(a)) for node, a in axes.items()}


@dataclasses.dataclass(frozen=True)
class _SiteSpec:
  """What a site reads: the rows of the resolution ("op"/"value", signature), its classes
  in the graph's order and their class nodes (`nodes[i]` decides `classes[i]`)."""

  kind: str
  index: int
  rows: tuple[tuple[str, int], ...]
  classes: tuple[int, ...]
  nodes: tuple[int, ...]

  @property
  def variables(self) -> tuple[int, ...]:
    """Its class nodes, each once, in the order of their first class."""
    return tuple(dict.fromkeys(self.nodes))

  def key(self, problem: Problem) -> tuple:
    """Alike for sites that resolve alike under every assignment: the classes and sizes
    of each row, classes numbered by their place in the site, and the class nodes."""
    sigs = self.problem_rows(problem)
    local = {c: i for i, c in enumerate(self.classes)}
    rows = tuple((kind, tuple(local.get(int(c), -1) for c in classes), tuple(int(n) for n in sizes))
                 for kind, classes, sizes in sigs)
    return self.kind, rows, self.nodes

  def problem_rows(self, problem: Problem) -> list[tuple[str, np.ndarray, np.ndarray]]:
    sigs = problem.sigs
    return [(kind, sigs.op_class[i], sigs.op_size[i]) if kind == "op" else (kind, sigs.value_class[i],
                                                                            sigs.value_size[i])
            for kind, i in self.rows]


def _site_specs(problem: Problem, rank: Mapping[int, int], node_of: np.ndarray) -> list[_SiteSpec]:
  sigs, tables = problem.sigs, problem.tables
  specs = []
  for o in range(len(sigs.op_keys)):
    rows = [("op", o)] + [("value", int(v)) for v in tables.edge_value[tables.edge_op == o]]
    source = int(tables.op_reduction_source[o])
    if source != o:
      rows.append(("op", source))
    classes = _classes_of(problem, rows, rank)
    specs.append(_SiteSpec("op", o, tuple(rows), classes, tuple(int(node_of[c]) for c in classes)))
  for v in range(len(sigs.value_keys)):
    rows = [("value", v)]
    classes = _classes_of(problem, rows, rank)
    specs.append(_SiteSpec("value", v, tuple(rows), classes, tuple(int(node_of[c]) for c in classes)))
  return specs


def _classes_of(problem: Problem, rows: Sequence[tuple[str, int]], rank: Mapping[int, int]) -> tuple[int, ...]:
  sigs = problem.sigs
  found = set()
  for kind, i in rows:
    found.update(int(c) for c in (sigs.op_class[i] if kind == "op" else sigs.value_class[i]) if c >= 0)
  return tuple(sorted(found, key=rank.__getitem__))


@functools.lru_cache(maxsize=8)
def _resolve_batch(problem: Problem):
  return jax.jit(jax.vmap(problem.resolve))


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return np.concatenate([x, np.full((rows - len(x), *x.shape[1:]), -1, x.dtype)]) if len(x) < rows else x


def _axis_features(problem: Problem, specs: Sequence[_SiteSpec], domains: Mapping[int, tuple[int, ...]],
                   limits: Limits) -> list[list[np.ndarray]]:
  """Per site and axis, the resolved masks of every subset of its class nodes that can
  take the axis, their classes decided on that axis alone (in order): int8 [2**k_x, L] per
  (site, axis). Only the site's own rows of each resolution are kept."""
  num_axes = len(problem.mesh.axis_sizes)
  width = max([len(s.classes) for s in specs] + [1])
  lists, blocks = [], []  # blocks: (site, axis, first list) in list order.
  for s, spec in enumerate(specs):
    for axis in range(num_axes):
      able = [n for n in spec.variables if axis in domains[n]]
      if 1 << len(able) > MAX_SITE_ASSIGNMENTS:
        raise ValueError(f"{spec.kind} signature {spec.index} has {len(able)} classes that can take axis {axis}: "
                         "too many to enumerate")
      blocks.append((s, axis, len(lists)))
      for subset in range(1 << len(able)):
        chosen = {n for i, n in enumerate(able) if subset >> i & 1}
        lists.append([c for c, n in zip(spec.classes, spec.nodes) if n in chosen])
    limits.check("listing the strategy graph's site assignments")
  dec_class = np.full((len(lists), width), -1, np.int32)
  for i, classes in enumerate(lists):
    dec_class[i, :len(classes)] = classes
  list_axis = np.repeat([a for _, a, _ in blocks], np.diff([b for _, _, b in blocks] + [len(lists)]))
  dec_axis = np.where(dec_class >= 0, list_axis[:, None], -1).astype(np.int32)
  del lists
  out = [[np.zeros((0, 0), np.int8)] * num_axes for _ in specs]
  starts = np.array([b for _, _, b in blocks] + [len(dec_class)])
  fn = _resolve_batch(problem)
  for start in range(0, len(dec_class), _CHUNK):
    limits.check("resolving the strategy graph's sites")
    end = min(start + _CHUNK, len(dec_class))
    resolution = jax.device_get(fn(_pad_rows(dec_class[start:end], _CHUNK), _pad_rows(dec_axis[start:end], _CHUNK)))
    value_mask, op_mask = np.asarray(resolution.value_mask, np.int8), np.asarray(resolution.op_mask, np.int8)
    for b in range(np.searchsorted(starts, start, side="right") - 1, np.searchsorted(starts, end)):
      s, axis, first = blocks[b]
      lo, hi = max(first, start), min(starts[b + 1], end)
      if lo >= hi:
        continue
      rows = slice(lo - start, hi - start)
      part = np.concatenate([op_mask[rows, i] if kind == "op" else value_mask[rows, i]
                             for kind, i in specs[s].rows], axis=1)
      if not out[s][axis].size:
        out[s][axis] = np.zeros((starts[b + 1] - first, part.shape[1]), np.int8)
      out[s][axis][lo - first:hi - first] = part
  return out


def _build_site(spec: _SiteSpec, indices: Sequence[int], domains: Mapping[int, tuple[int, ...]],
                per_axis: Sequence[np.ndarray]) -> Site:
  """Enumerates a site's assignments, groups those that resolve alike into strategies
  (product sets only, see the module docstring)."""
  variables = spec.variables
  radix = np.array([len(domains[n]) for n in variables], np.int64)
  total = int(np.prod(radix))
  if total > MAX_SITE_ASSIGNMENTS:
    raise ValueError(f"{spec.kind} signature {spec.index} has {total} assignments of its classes: too many")
  digits = np.stack(np.unravel_index(np.arange(total), tuple(radix.tolist())), axis=1) if len(radix) else \
      np.zeros((1, 0), np.int64)  # [A, k]: each class node's domain index.
  axis = np.stack([np.array(domains[n])[digits[:, i]] for i, n in enumerate(variables)], axis=1) \
      if len(radix) else digits  # [A, k]: each class node's axis.
  masks = np.zeros((total, per_axis[0].shape[1]), np.int8)
  for x, features in enumerate(per_axis):
    able = [i for i, n in enumerate(variables) if x in domains[n]]
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
  return Site(kind=spec.kind, indices=tuple(indices), classes=np.array(variables, np.int64), radix=radix,
              lookup=lookup, allowed=tuple(allowed), masks=masks[np.sort(first)])


def _site_terms(problem: Problem, sites: Sequence[Site], limits: Limits) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each site's strategy costs (seconds, summed over its signatures) and usages (bytes:
  gathered operands of an op site; for a value site, the shard count its memory nodes
  divide by), [n] each."""
  tables = problem.tables
  op_sites = [(site, o) for site in sites if site.kind == "op" for o in site.indices]
  value_sites = [(site, v) for site in sites if site.kind == "value" for v in site.indices]
  cost = {id(site): np.zeros(site.num_strategies) for site in sites}
  usage = {id(site): np.zeros(site.num_strategies) for site in sites}

  # Op sites: every edge gets a private value signature and every combination of partial
  # sums a private copy of its source op, so that one batch of resolutions sets each op
  # signature's masks independently of the others'.
  num_ops, num_edges = len(tables.op_compute_s), len(tables.edge_op)
  combos = [o for _, o in op_sites if int(tables.op_reduction_source[o]) != o]
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

  def op_masks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    op_mask = np.zeros((len(rows), num_ops + len(combos), rf), np.int32)
    value_mask = np.zeros((len(rows), num_edges, rv), np.int32)
    for site, o in op_sites:
      pick = site.masks[np.minimum(rows, site.num_strategies - 1)]  # [B, L]
      edges = edges_of[o]
      op_mask[:, o] = pick[:, :rf]
      value_mask[:, edges] = pick[:, rf:rf + rv * len(edges)].reshape(len(rows), len(edges), rv)
      if o in copy_of:
        op_mask[:, copy_of[o]] = pick[:, rf + rv * len(edges):]
    return value_mask, op_mask

  batch = max([site.num_strategies for site, _ in op_sites] + [1])
  for rows, terms in _terms_batches(private, op_masks, batch, limits):
    edge_seconds = terms.gather.seconds + terms.all_to_all.seconds  # [B, E]
    reduction_seconds = terms.reduce_scatter.seconds + terms.all_reduce.seconds  # [B, R]
    per_op = terms.op_compute_s[:, :num_ops].astype(np.float64)
    np.add.at(per_op.T, tables.edge_op, edge_seconds.T)
    np.add.at(per_op.T, tables.edge_op[tables.reduction_edge], reduction_seconds.T)
    gathered = np.zeros((len(rows), num_ops))
    np.add.at(gathered.T, tables.edge_op, terms.gathered_bytes.T)
    for site, o in op_sites:
      mine = rows < site.num_strategies
      cost[id(site)][rows[mine]] += per_op[mine, o]
      usage[id(site)][rows[mine]] += gathered[mine, o]

  def value_masks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    value_mask = np.zeros((len(rows), len(tables.value_bytes), rv), np.int32)
    for site, v in value_sites:
      value_mask[:, v] = site.masks[np.minimum(rows, site.num_strategies - 1)]
    return value_mask, np.zeros((len(rows), num_ops, rf), np.int32)

  value_shards = {}
  batch = max([site.num_strategies for site, _ in value_sites] + [1])
  for rows, terms in _terms_batches(tables, value_masks, batch, limits):
    for site, v in value_sites:
      mine = rows < site.num_strategies
      cost[id(site)][rows[mine]] += terms.value_compute_s[mine, v]
      value_shards.setdefault(v, np.zeros(site.num_strategies))[rows[mine]] = terms.value_shards[mine, v]
  for site in sites:
    if site.kind == "value":  # Alike rows: every signature of the site has the same shards.
      usage[id(site)] = value_shards[site.indices[0]]
  return [cost[id(s)] for s in sites], [usage[id(s)] for s in sites]


def _terms_batches(tables: simulator.CostTables, masks, batch: int, limits: Limits):
  """Yields (rows, `simulator.terms`) of plans 0..batch-1 in chunks, `masks(rows)` giving
  each chunk's value and op masks [B, ...]; terms as numpy [B, ...]."""
  fn = jax.jit(jax.vmap(lambda v, o: simulator.terms(tables, Resolution(value_mask=v, op_mask=o))))
  for start in range(0, batch, _CHUNK):
    limits.check("costing the strategy graph's sites")
    rows = np.arange(start, min(start + _CHUNK, batch))
    value_mask, op_mask = masks(np.arange(start, start + _CHUNK))
    terms = jax.device_get(fn(jnp.asarray(value_mask), jnp.asarray(op_mask)))
    yield rows, jax.tree.map(lambda x: np.asarray(x)[:len(rows)], terms)


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


def build(problem: Problem, order: Sequence[int] | None = None, tie: np.ndarray | None = None,
          limits: Limits = Limits()) -> ProgramGraph:
  """The strategy graph of `problem` with class order `order` (default: by id; see
  `order_from` to keep an expert plan's order), costed without collective combining
  (`without_combining`).

  Args:
    problem: the problem.
    order: the class order of decision lists.
    tie: each class's class node, int [num_classes] (`tied_classes`; a class node is the
      first class of its tie); default: a node per class.
    limits: checked between batches and sites.

  Raises:
    ValueError: a bad order or tie, or a site with too many assignments to enumerate.
    solver.LimitReached: past the deadline or the memory ceiling of `limits`.
  """
  problem = without_combining(problem)
  num_classes = len(problem.named.classes)
  order = tuple(range(num_classes)) if order is None else tuple(int(c) for c in order)
  if sorted(order) != list(range(num_classes)):
    raise ValueError(f"order must list each of the {num_classes} classes once")
  tie = np.arange(num_classes, dtype=np.int64) if tie is None else np.asarray(tie, np.int64)
  if tie.shape != (num_classes,) or np.any(tie[tie] != tie):
    raise ValueError(f"tie must give each of the {num_classes} classes a class that ties to itself")
  rank = {c: i for i, c in enumerate(order)}
  class_domains = _class_domains(problem)
  domains = _tied_domains(class_domains, tie)
  classes = tuple(c for c in order if c in domains)
  members = {c: [] for c in classes}
  for cls in order:
    if cls in class_domains:
      members[int(tie[cls])].append(cls)

  specs, same = [], {}  # One spec per distinct key; the signatures of each.
  for spec in _site_specs(problem, rank, tie):
    key = spec.key(problem)
    if key not in same:
      specs.append(spec)
      same[key] = []
    same[key].append(spec.index)
  limits.check("grouping the strategy graph's sites")
  features = _axis_features(problem, specs, domains, limits)
  sites = []
  for spec, per_axis in zip(specs, features):
    sites.append(_build_site(spec, same[spec.key(problem)], domains, per_axis))
    limits.check("enumerating the strategy graph's site strategies")
  del features
  site_cost, site_usage = _site_terms(problem, sites, limits)

  num_nodes = len(classes)
  class_node = {c: i for i, c in enumerate(classes)}
  node_costs = [np.zeros(len(domains[c])) for c in classes]
  node_usages = [np.zeros(len(domains[c])) for c in classes]
  live_rows = problem.tables.live_bytes.shape[0]
  intervals = [(0, 0)] * num_nodes
  edges, edge_costs = [], []
  memory_site = []
  for s, (site, cost, usage) in enumerate(zip(sites, site_cost, site_usage)):
    node = num_nodes + s
    node_costs.append(cost)
    node_usages.append(usage if site.kind == "op" else np.zeros(site.num_strategies))
    intervals.append((0, live_rows) if site.kind == "op" else (0, 0))
    for cls, allowed in zip(site.classes.tolist(), site.allowed):
      edges.append((node, class_node[cls]))
      edge_costs.append(np.where(allowed, 0.0, float(FORBIDDEN)).ravel())
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
  counts = [len(c) for c in node_costs]
  graph = StrategyGraph(
      node_costs=np.concatenate(node_costs).astype(np.float64), node_usages=np.concatenate(node_usages).astype(np.float64),
      node_offsets=offsets_from_counts(counts), intervals=np.array(intervals, np.int64).reshape(-1, 2),
      edges=np.array(edges, np.int64).reshape(-1, 2),
      edge_costs=np.concatenate(edge_costs) if edge_costs else np.zeros(0),
      edge_offsets=offsets_from_counts([len(c) for c in edge_costs]),
      usage_limit=float(problem.tables.hbm_bytes), name="program")
  return ProgramGraph(problem=problem, graph=graph, order=order, classes=classes,
                      members=tuple(tuple(members[c]) for c in classes),
                      domains=tuple(domains[c] for c in classes), sites=tuple(sites),
                      memory_site=np.array(memory_site, np.int64))
