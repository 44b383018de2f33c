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

import collections
import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import sharding, simulator
from automap_rl.problem import Problem
from automap_rl.sharding import Decision, Resolution
from automap_rl.solver import FORBIDDEN, Limits, StrategyGraph, offsets_from_counts

_CHUNK = 256  # Plans per jitted resolve / terms call (one compile per problem).
_ROW_CHUNK = 1 << 14  # Row assignments per jitted call of the decision-by-decision rule.
MAX_SITE_ASSIGNMENTS = 1 << 18  # A site with more assignments than this is refused.

Axes = tuple[int, ...]  # A class's mesh axes (indices), in decision order; () is unsharded.


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
    order: the decision order of classes (see `build`); `classes` sorted by their first
      appearance.
    slots: (class, k) in decision order: where each class's k-th axis is decided
      (`decision_slots`).
    classes: the class of each class node (the first of its tied classes), [C].
    members: the classes each class node decides (itself and the classes tied to it).
    domains: each class node's axes per strategy (`()`: unsharded, first), a tuple per
      class node.
    sites: the site nodes, in node order from C.
    memory_site: the site index each memory node mirrors, [M].
  """

  problem: Problem
  graph: StrategyGraph
  order: tuple[int, ...]
  slots: tuple[tuple[int, int], ...]
  classes: tuple[int, ...]
  members: tuple[tuple[int, ...], ...]
  domains: tuple[tuple[Axes, ...], ...]
  sites: tuple[Site, ...]
  memory_site: np.ndarray

  @property
  def tied(self) -> bool:
    """Whether some class node decides several classes."""
    return any(len(m) > 1 for m in self.members)

  def choice(self, assignment: Mapping[int, Axes]) -> np.ndarray:
    """The graph plan of an assignment (class -> axes; absent classes unsharded), [N].
    Raises ValueError for axes outside a class's domain or tied classes that differ."""
    picks = np.zeros(len(self.classes), np.int64)
    index_of = {}
    for node, (cls, members, domain) in enumerate(zip(self.classes, self.members, self.domains)):
      axes = {tuple(assignment.get(m, ())) for m in members}
      if len(axes) > 1:
        raise ValueError(
          f"classes {members} are tied but the assignment gives them the axes {sorted(axes)}"
        )
      axis = axes.pop()
      if axis not in domain:
        raise ValueError(f"class {cls} cannot take the axes {axis} (its axes: {domain[1:]})")
      picks[node] = domain.index(axis)
      index_of[cls] = picks[node]
    site_choice = np.array([_site_strategy(site, index_of) for site in self.sites], np.int64)
    return np.concatenate([picks, site_choice, site_choice[self.memory_site]])

  def assignment(self, choice: Sequence[int] | np.ndarray) -> dict[int, Axes]:
    """The assignment (class -> axes) of a graph plan's class nodes (sharded classes only)."""
    return {
      m: domain[int(choice[node])]
      for node, (members, domain) in enumerate(zip(self.members, self.domains))
      if domain[int(choice[node])]
      for m in members
    }

  def decisions_of(self, assignment: Mapping[int, Axes]) -> list[Decision]:
    """The decision list of an assignment: each class's k-th axis at its slot."""
    names = self.problem.mesh.axis_names
    return [
      Decision(cls, names[assignment[cls][k]])
      for cls, k in self.slots
      if k < len(assignment.get(cls, ()))
    ]

  def decisions(self, choice: Sequence[int] | np.ndarray) -> list[Decision]:
    """The decision list of a graph plan (`decisions_of` its assignment)."""
    return self.decisions_of(self.assignment(choice))

  def assignment_of(self, decisions: Sequence[Decision]) -> dict[int, Axes] | None:
    """The assignment whose decision list resolves like `decisions` (every value and op
    sharded alike), or None when there is none in the graph. The candidate gives each
    class the axes of its first decisions, in their order; it fails when a class takes
    axes outside its domain, tied classes differ, or its list (`decisions_of`, each axis
    at its slot) resolves otherwise (order effects)."""
    dec_class, dec_axis = self.problem.encode(decisions)
    firsts: dict[int, list[int]] = {}
    for cls, axis in zip(dec_class.tolist(), dec_axis.tolist()):
      if axis not in firsts.setdefault(cls, []):
        firsts[cls].append(axis)
    assignment = {cls: tuple(axes) for cls, axes in firsts.items()}
    try:
      self.choice(assignment)
    except ValueError:
      return None
    own_class, own_axis = self.problem.encode(self.decisions_of(assignment))
    length = max(len(dec_class), len(own_class), 1)
    pad = lambda x: np.concatenate([x, np.full(length - len(x), -1, np.int32)])
    resolution = jax.device_get(
      _resolve_batch(self.problem)(
        np.stack([pad(dec_class), pad(own_class)]), np.stack([pad(dec_axis), pad(own_axis)])
      )
    )
    same = all(np.array_equal(m[0], m[1]) for m in (resolution.value_mask, resolution.op_mask))
    return assignment if same else None


def _site_strategy(site: Site, index_of: Mapping[int, int]) -> int:
  index = 0
  for cls, size in zip(site.classes.tolist(), site.radix.tolist()):
    index = index * size + int(index_of[cls])
  return int(site.lookup[index])


def order_from(
  problem: Problem, decisions: Sequence[Decision] = (), max_axes: int = 2
) -> tuple[int, ...]:
  """A decision order (see `build`) that keeps the decisions' order: the class of each first
  decision of a (class, axis), up to `max_axes` per class, then the other classes by id."""
  dec_class, dec_axis = problem.encode(decisions)
  listed, counts = [], collections.Counter()
  for cls, _ in dict.fromkeys(zip(dec_class.tolist(), dec_axis.tolist())):
    if counts[cls] < max_axes:
      listed.append(cls)
      counts[cls] += 1
  return tuple(listed + [c for c in range(len(problem.named.classes)) if c not in counts])


def decision_slots(order: Sequence[int], max_axes: int) -> tuple[tuple[int, int], ...]:
  """Where each class's k-th axis is decided: (class, k) in decision order, its k-th
  appearance in `order` for each k it appears, the rest right after its last."""
  last = {c: i for i, c in enumerate(order)}
  seen: dict[int, int] = {}
  slots = []
  for i, c in enumerate(order):
    slots.append((c, seen.get(c, 0)))
    seen[c] = seen.get(c, 0) + 1
    if last[c] == i:
      slots.extend((c, k) for k in range(seen[c], max_axes))
  return tuple(slots)


def tied_classes(problem: Problem) -> np.ndarray:
  """Each class's tie, int64 [num_classes]: the first class of its structural group
  (`NamedDims.groups`) when that group's classes are per-layer dims of an unrolled layer
  stack (one class per layer: the same dim of the same weight in every layer), else the
  class itself. A scanned stack needs no tie: its loop body is one op for every layer."""
  tie = np.arange(len(problem.named.classes), dtype=np.int64)
  layered = {c for stack in problem.layer_stacks if not stack.scanned for c in stack.layer_classes}
  for group in problem.named.groups:
    if len(group) > 1 and layered.issuperset(group):
      tie[list(group)] = min(group)
  return tie


def _class_domains(problem: Problem, max_axes: int) -> dict[int, tuple[Axes, ...]]:
  """Class -> ((), the axes of up to `max_axes` distinct mesh axes whose product divides
  some dim or factor of the class: single axes, then ordered pairs), for classes that some
  value-signature dim or op-signature factor carries."""
  sigs, sizes = problem.sigs, problem.mesh.axis_sizes
  candidates = [
    axes for k in range(1, max_axes + 1) for axes in itertools.permutations(range(len(sizes)), k)
  ]
  domains: dict[int, set[Axes]] = {}
  for classes, dims in ((sigs.value_class, sigs.value_size), (sigs.op_class, sigs.op_size)):
    for cls, size in zip(classes.ravel().tolist(), dims.ravel().tolist()):
      if cls >= 0:
        domains.setdefault(cls, set()).update(
          a for a in candidates if size % math.prod(sizes[x] for x in a) == 0
        )
  return {cls: ((), *(a for a in candidates if a in axes)) for cls, axes in domains.items()}


def _tied_domains(
  domains: Mapping[int, tuple[Axes, ...]], tie: np.ndarray
) -> dict[int, tuple[Axes, ...]]:
  """Class node -> the axes every one of its classes can take (the first class of the tie
  that some signature carries names the node)."""
  axes: dict[int, tuple[Axes, ...]] = {}
  for cls in sorted(domains):
    node = int(tie[cls])
    axes[node] = tuple(a for a in axes.get(node, domains[cls]) if a in domains[cls])
  return axes


def _capped_domains(
  domains: Mapping[int, tuple[Axes, ...]], specs: Sequence[_SiteSpec], classes: Sequence[int]
) -> dict[int, tuple[Axes, ...]]:
  """`domains` with the pairs of axes kept for class nodes in the order of `classes` while
  every site's assignments (the product of its class nodes' domain sizes) stay within
  `MAX_SITE_ASSIGNMENTS`; the other nodes keep their single axes."""
  capped = {n: tuple(a for a in d if len(a) < 2) for n, d in domains.items()}
  sites_of: dict[int, list[int]] = {}
  for s, spec in enumerate(specs):
    for n in spec.variables:
      sites_of.setdefault(n, []).append(s)
  size = [math.prod(len(capped[n]) for n in spec.variables) for spec in specs]
  for n in classes:
    grown = [size[s] // len(capped[n]) * len(domains[n]) for s in sites_of.get(n, [])]
    if len(domains[n]) > len(capped[n]) and all(g <= MAX_SITE_ASSIGNMENTS for g in grown):
      for s, g in zip(sites_of.get(n, []), grown):
        size[s] = g
      capped[n] = domains[n]
  return capped


@dataclasses.dataclass(frozen=True)
class _SiteSpec:
  """What a site reads: the rows of the resolution ("op"/"value", signature), its classes
  in the graph's order, their class nodes (`nodes[i]` decides `classes[i]`) and their
  decision slots in order ((i, k): the k-th axis of `classes[i]`)."""

  kind: str
  index: int
  rows: tuple[tuple[str, int], ...]
  classes: tuple[int, ...]
  nodes: tuple[int, ...]
  slots: tuple[tuple[int, int], ...]

  @property
  def variables(self) -> tuple[int, ...]:
    """Its class nodes, each once, in the order of their first class."""
    return tuple(dict.fromkeys(self.nodes))

  def key(self, problem: Problem) -> tuple:
    """Alike for sites that resolve alike under every assignment: the classes and sizes
    of each row, classes numbered by their place in the site, the class nodes and the
    decision slots."""
    sigs = self.problem_rows(problem)
    local = {c: i for i, c in enumerate(self.classes)}
    rows = tuple(
      (kind, tuple(local.get(int(c), -1) for c in classes), tuple(int(n) for n in sizes))
      for kind, classes, sizes in sigs
    )
    return self.kind, rows, self.nodes, self.slots

  def problem_rows(self, problem: Problem) -> list[tuple[str, np.ndarray, np.ndarray]]:
    sigs = problem.sigs
    return [
      (kind, sigs.op_class[i], sigs.op_size[i])
      if kind == "op"
      else (kind, sigs.value_class[i], sigs.value_size[i])
      for kind, i in self.rows
    ]


def _site_specs(
  problem: Problem,
  rank: Mapping[int, int],
  node_of: np.ndarray,
  position: Mapping[tuple[int, int], int],
) -> list[_SiteSpec]:
  sigs, tables = problem.sigs, problem.tables
  max_axes = max(k for _, k in position) + 1

  def spec(kind: str, index: int, rows: list[tuple[str, int]]) -> _SiteSpec:
    classes = _classes_of(problem, rows, rank)
    slots = sorted(
      ((i, k) for i in range(len(classes)) for k in range(max_axes)),
      key=lambda slot: position[classes[slot[0]], slot[1]],
    )
    return _SiteSpec(
      kind, index, tuple(rows), classes, tuple(int(node_of[c]) for c in classes), tuple(slots)
    )

  specs = []
  for o in range(len(sigs.op_keys)):
    rows = [("op", o)] + [("value", int(v)) for v in tables.edge_value[tables.edge_op == o]]
    source = int(tables.op_reduction_source[o])
    if source != o:
      rows.append(("op", source))
    specs.append(spec("op", o, rows))
  for v in range(len(sigs.value_keys)):
    specs.append(spec("value", v, [("value", v)]))
  return specs


def _classes_of(
  problem: Problem, rows: Sequence[tuple[str, int]], rank: Mapping[int, int]
) -> tuple[int, ...]:
  sigs = problem.sigs
  found = set()
  for kind, i in rows:
    found.update(
      int(c) for c in (sigs.op_class[i] if kind == "op" else sigs.value_class[i]) if c >= 0
    )
  return tuple(sorted(found, key=rank.__getitem__))


@functools.lru_cache(maxsize=8)
def _resolve_batch(problem: Problem):
  return jax.jit(jax.vmap(problem.resolve))


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return (
    np.concatenate([x, np.full((rows - len(x), *x.shape[1:]), -1, x.dtype)]) if len(x) < rows else x
  )


@jax.jit
@jax.vmap
def _apply_in_order(
  divisible: jax.Array, classes: jax.Array, dec_class: jax.Array, dec_axis: jax.Array
) -> jax.Array:
  """Resolves rows decision by decision (`sharding.apply_decision`, the one rule), vmapped
  over a batch: `(divisible int32 [B, S], classes int32 [B, S], dec_class int32 [B, K],
  dec_axis int32 [B, K]) -> masks int8 [B, S]`; a decision with axis -1 is none."""

  def step(mask, decision):
    cls, axis = decision
    rank = jnp.where((classes == cls) & (cls >= 0) & (axis >= 0), 0, sharding.NO_SLOT_RANK).astype(
      jnp.int16
    )
    return sharding.apply_decision(divisible[None], mask[None], rank[None], jnp.maximum(axis, 0))[
      0
    ], None

  mask, _ = jax.lax.scan(step, jnp.zeros(classes.shape, jnp.int8), (dec_class, dec_axis))
  return mask


@dataclasses.dataclass(frozen=True, eq=False)
class _Row:
  """Every resolution of one row (a value signature's dims or an op signature's factors)
  under the joint assignments of its class nodes.

  Attributes:
    variables: its class nodes, in the order of their first class in the graph's order, [m].
    radix: their domain sizes, [m]; assignment indices as `Site.lookup`'s.
    masks: the row's axis bit masks under each assignment, int8 [prod(radix), W].
    ids: each assignment's resolution, numbered by first appearance, int64 [prod(radix)].
  """

  variables: tuple[int, ...]
  radix: np.ndarray
  masks: np.ndarray
  ids: np.ndarray


def _row_key(problem: Problem, row: tuple[str, int]) -> tuple:
  kind, i = row
  classes, sizes = (
    (problem.sigs.op_class[i], problem.sigs.op_size[i])
    if kind == "op"
    else (problem.sigs.value_class[i], problem.sigs.value_size[i])
  )
  return kind, tuple(classes.tolist()), tuple(sizes.tolist())


def _resolve_rows(
  problem: Problem,
  specs: Sequence[_SiteSpec],
  domains: Mapping[int, tuple[Axes, ...]],
  rank: Mapping[int, int],
  node_of: np.ndarray,
  position: Mapping[tuple[int, int], int],
  limits: Limits,
) -> dict[tuple, _Row]:
  """Each distinct row of the sites (by `_row_key`: rows alike resolve alike) resolved
  under every joint assignment of its class nodes: its classes' decisions at their
  decision slots (`position`), in order."""
  keys = list(dict.fromkeys(_row_key(problem, row) for spec in specs for row in spec.rows))
  width = max(problem.sigs.op_class.shape[1], problem.sigs.value_class.shape[1])
  max_axes = max(k for _, k in position) + 1
  steps = width * max_axes
  layout = []  # (key, variables, radix) per row.
  bits = np.ones((len(keys), width), np.int32)
  slot_class = np.full((len(keys), width), -1, np.int32)
  dec_class = np.full((len(keys), steps), -1, np.int32)
  owner, dec_axis = (
    [],
    [],
  )  # Per row assignment: its row, int32 [N]; its decisions' axes, int8 [N, K].
  for r, (kind, classes, sizes) in enumerate(keys):
    limits.check("listing the strategy graph's row assignments")
    ordered = sorted({c for c in classes if c >= 0}, key=rank.__getitem__)
    variables = tuple(dict.fromkeys(int(node_of[c]) for c in ordered))
    radix = np.array([len(domains[n]) for n in variables], np.int64)
    total = int(np.prod(radix))
    if total > MAX_SITE_ASSIGNMENTS:
      raise ValueError(f"an {kind} signature has {total} assignments of its classes: too many")
    digits = (
      np.stack(np.unravel_index(np.arange(total), tuple(radix.tolist())), axis=1)
      if len(radix)
      else np.zeros((1, 0), np.int64)
    )  # [A, m]
    axes = np.full((total, steps), -1, np.int8)
    slots = sorted(((c, k) for c in ordered for k in range(max_axes)), key=position.__getitem__)
    for j, (cls, k) in enumerate(slots):
      node = variables.index(int(node_of[cls]))
      table = np.array([a[k] if k < len(a) else -1 for a in domains[variables[node]]], np.int8)
      axes[:, j] = table[digits[:, node]]
      dec_class[r, j] = cls
    slot_class[r, : len(classes)] = classes
    bits[r, : len(sizes)] = sharding.divisibility_bits(
      np.array(sizes, np.int64), problem.mesh.axis_sizes
    )
    layout.append(((kind, classes, sizes), variables, radix))
    owner.append(np.full(total, r, np.int32))
    dec_axis.append(axes)
  owner = np.concatenate(owner) if owner else np.zeros(0, np.int32)
  dec_axis = np.concatenate(dec_axis) if dec_axis else np.zeros((0, steps), np.int8)
  masks = np.zeros((len(owner), width), np.int8)
  for start in range(0, len(owner), _ROW_CHUNK):
    limits.check("resolving the strategy graph's rows")
    end = min(start + _ROW_CHUNK, len(owner))
    mine = _pad_rows(owner[start:end], _ROW_CHUNK).clip(0)
    batch = _apply_in_order(
      bits[mine],
      slot_class[mine],
      dec_class[mine],
      _pad_rows(dec_axis[start:end].astype(np.int32), _ROW_CHUNK),
    )
    masks[start:end] = np.asarray(jax.device_get(batch))[: end - start]
  del owner, dec_axis
  rows, first = {}, 0
  for key, variables, radix in layout:
    total = int(np.prod(radix))
    own = masks[first : first + total, : len(key[1])]
    first += total
    _, index, ids = np.unique(own, axis=0, return_index=True, return_inverse=True)
    order = np.empty(len(index), np.int64)
    order[np.argsort(index, kind="stable")] = np.arange(len(index))
    rows[key] = _Row(variables=variables, radix=radix, masks=own, ids=order[ids.reshape(-1)])
  return rows


def _build_site(
  problem: Problem,
  spec: _SiteSpec,
  indices: Sequence[int],
  domains: Mapping[int, tuple[Axes, ...]],
  rows: Mapping[tuple, _Row],
) -> Site:
  """Enumerates a site's assignments, groups those that resolve alike (every row alike)
  into strategies (product sets only, see the module docstring)."""
  variables = spec.variables
  radix = np.array([len(domains[n]) for n in variables], np.int64)
  total = int(np.prod(radix))
  if total > MAX_SITE_ASSIGNMENTS:
    raise ValueError(
      f"{spec.kind} signature {spec.index} has {total} assignments of its classes: too many"
    )
  digits = (
    np.stack(np.unravel_index(np.arange(total), tuple(radix.tolist())), axis=1)
    if len(radix)
    else np.zeros((1, 0), np.int64)
  )  # [A, k]: each class node's domain index.
  row_index, inverse = [], np.zeros(total, np.int64)
  for row in spec.rows:
    table = rows[_row_key(problem, row)]
    places = [variables.index(n) for n in table.variables]
    index = (
      np.ravel_multi_index(tuple(digits[:, places].T), tuple(table.radix.tolist()))
      if places
      else np.zeros(total, np.int64)
    )
    row_index.append((table, index))
    # Mixed radix over the rows' resolutions, renumbered after each row to stay small.
    _, inverse = np.unique(
      inverse * (int(table.ids.max()) + 1) + table.ids[index], return_inverse=True
    )
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
  chosen = np.sort(first)
  masks = np.concatenate([table.masks[index[chosen]] for table, index in row_index], axis=1)
  return Site(
    kind=spec.kind,
    indices=tuple(indices),
    classes=np.array(variables, np.int64),
    radix=radix,
    lookup=lookup,
    allowed=tuple(allowed),
    masks=masks,
  )


def _site_terms(
  problem: Problem, sites: Sequence[Site], limits: Limits
) -> tuple[list[np.ndarray], list[np.ndarray]]:
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
  source = np.concatenate([np.arange(num_ops), np.arange(num_ops, num_ops + len(combos))]).astype(
    np.int32
  )
  source[combos] = [copy_of[o] for o in combos]
  private = tables.replace(
    value_bytes=tables.value_bytes[tables.edge_value],
    value_compute_s=np.zeros(num_edges, np.float32),
    value_memory_s=np.zeros(num_edges, np.float32),
    edge_value=np.arange(num_edges, dtype=np.int32),
    live_bytes=np.zeros((1, num_edges), np.float32),
    op_compute_s=np.concatenate([tables.op_compute_s, np.zeros(len(combos), np.float32)]),
    op_reduction=np.concatenate([tables.op_reduction, tables.op_reduction[sources]]),
    op_reduction_source=source,
    op_deferred=np.concatenate([tables.op_deferred, np.zeros(len(combos), bool)]),
    op_dense_factor=np.concatenate([tables.op_dense_factor, np.full(len(combos), -1, np.int32)]),
    op_dot_reduction=np.concatenate(
      [tables.op_dot_reduction, np.full(len(combos), len(tables.reduction_edge), np.int32)]
    ),
  )
  rf, rv = problem.sigs.op_class.shape[1], problem.sigs.value_class.shape[1]
  edges_of = [np.flatnonzero(tables.edge_op == o) for o in range(num_ops)]

  def op_masks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    op_mask = np.zeros((len(rows), num_ops + len(combos), rf), np.int32)
    value_mask = np.zeros((len(rows), num_edges, rv), np.int32)
    for site, o in op_sites:
      pick = site.masks[np.minimum(rows, site.num_strategies - 1)]  # [B, L]
      edges = edges_of[o]
      op_mask[:, o] = pick[:, :rf]
      value_mask[:, edges] = pick[:, rf : rf + rv * len(edges)].reshape(len(rows), len(edges), rv)
      if o in copy_of:
        op_mask[:, copy_of[o]] = pick[:, rf + rv * len(edges) :]
    return value_mask, op_mask

  batch = max([site.num_strategies for site, _ in op_sites] + [1])
  for rows, terms in _terms_batches(private, op_masks, batch, limits):
    edge_seconds = terms.gather.seconds + terms.all_to_all.seconds  # [B, E]
    reduction_seconds = terms.reduce_scatter.seconds + terms.all_reduce.seconds  # [B, R]
    per_op = terms.op_compute_s[:, :num_ops].astype(np.float64)
    np.add.at(per_op.T, tables.edge_op, edge_seconds.T)
    np.add.at(per_op.T, tables.edge_op[tables.reduction_edge], reduction_seconds.T)
    gathered = np.zeros((len(rows), num_ops))
    np.add.at(gathered.T, tables.edge_op, (terms.gathered_bytes + terms.transient_bytes).T)
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
      value_shards.setdefault(v, np.zeros(site.num_strategies))[rows[mine]] = terms.value_shards[
        mine, v
      ]
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
    yield rows, jax.tree.map(lambda x: np.asarray(x)[: len(rows)], terms)


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


def local_costs(problem: Problem) -> Problem:
  """`problem` with every cost local to a node or an edge of a graph, whose costs are
  sums of per-node and per-edge terms, so the graph is built on it; the plan cost the
  graph gives is exactly this problem's. Two costs of `problem` are not local:
  reductions combined by XLA's combiners (`CostTables.reduction_combines`), here each
  paying its own latency (an upper bound: combining only merges latencies); and reads
  of one value priced as sharing one resharding that resolve apart under a plan
  (`CostTables.shared_slot_edge`), here each paying its static share (a lower bound:
  those only add)."""
  tables = dataclasses.replace(
    problem.tables,
    reduction_combines=np.zeros_like(problem.tables.reduction_combines),
    shared_slot_runs=np.zeros_like(problem.tables.shared_slot_runs),
  )
  return Problem(problem.program, problem.named, problem.mesh, problem.sigs, tables)


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
  slots = decision_slots(order, max_axes)
  position = {slot: i for i, slot in enumerate(slots)}
  rank = {c: position[c, 0] for c in range(num_classes)}
  class_domains = _class_domains(problem, max_axes)
  domains = _tied_domains(class_domains, tie)
  classes = tuple(sorted(domains, key=rank.__getitem__))
  members = {c: [] for c in classes}
  for cls in sorted(class_domains, key=rank.__getitem__):
    members[int(tie[cls])].append(cls)

  specs, same = [], {}  # One spec per distinct key; the signatures of each.
  for spec in _site_specs(problem, rank, tie, position):
    key = spec.key(problem)
    if key not in same:
      specs.append(spec)
      same[key] = []
    same[key].append(spec.index)
  limits.check("grouping the strategy graph's sites")
  domains = _capped_domains(domains, specs, classes)
  rows = _resolve_rows(problem, specs, domains, rank, tie, position, limits)
  sites = []
  for spec in specs:
    sites.append(_build_site(problem, spec, same[spec.key(problem)], domains, rows))
    limits.check("enumerating the strategy graph's site strategies")
  del rows
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
