"""The choices of a strategy graph: the decision order and slots of classes, the ties of
layer stacks, each class node's axes (its domain) and what each site reads (`SiteSpec`)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.strategy_graph.graph import Axes

MAX_SITE_ASSIGNMENTS = 1 << 18  # A site with more assignments than this is refused.


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


def class_domains(problem: Problem, max_axes: int) -> dict[int, tuple[Axes, ...]]:
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


def tied_domains(
  domains: Mapping[int, tuple[Axes, ...]], tie: np.ndarray
) -> dict[int, tuple[Axes, ...]]:
  """Class node -> the axes every one of its classes can take (the first class of the tie
  that some signature carries names the node)."""
  axes: dict[int, tuple[Axes, ...]] = {}
  for cls in sorted(domains):
    node = int(tie[cls])
    axes[node] = tuple(a for a in axes.get(node, domains[cls]) if a in domains[cls])
  return axes


def capped_domains(
  domains: Mapping[int, tuple[Axes, ...]], specs: Sequence[SiteSpec], classes: Sequence[int]
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
class SiteSpec:
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


def site_specs(
  problem: Problem,
  rank: Mapping[int, int],
  node_of: np.ndarray,
  position: Mapping[tuple[int, int], int],
) -> list[SiteSpec]:
  sigs, tables = problem.sigs, problem.tables
  max_axes = max(k for _, k in position) + 1

  def spec(kind: str, index: int, rows: list[tuple[str, int]]) -> SiteSpec:
    classes = classes_of(problem, rows, rank)
    slots = sorted(
      ((i, k) for i in range(len(classes)) for k in range(max_axes)),
      key=lambda slot: position[classes[slot[0]], slot[1]],
    )
    return SiteSpec(
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


def classes_of(
  problem: Problem, rows: Sequence[tuple[str, int]], rank: Mapping[int, int]
) -> tuple[int, ...]:
  sigs = problem.sigs
  found = set()
  for kind, i in rows:
    found.update(
      int(c) for c in (sigs.op_class[i] if kind == "op" else sigs.value_class[i]) if c >= 0
    )
  return tuple(sorted(found, key=rank.__getitem__))
