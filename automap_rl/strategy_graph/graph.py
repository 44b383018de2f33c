"""A program's strategy graph (`ProgramGraph`) and its site nodes (`Site`), with the maps
between the graph's plans, assignments of axes to classes and decision lists."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.solver import StrategyGraph

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


@functools.lru_cache(maxsize=8)
def _resolve_batch(problem: Problem):
  return jax.jit(jax.vmap(problem.resolve))
