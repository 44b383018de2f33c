"""UCT Monte Carlo tree search over the partitioning environment, in the style of Automap.

Each iteration selects a path by UCB1 from the root (the replicated plan) to a leaf,
expands the leaf by evaluating every legal action in one vmapped environment step (the
children's own plans seed their values), runs `rollouts` uniformly random episodes from
the leaf in one vmapped call, and backs the leaf's value up the path.

A plan's value is `-log(objective)` of the best plan on its path (the agent may stop at
any depth, so a stop child at every node is implicit). Values are normalised to [0, 1]
by the smallest and largest seen before UCB1 adds its exploration term, so the
exploration constant does not depend on the model's scale. With `transpositions`, action
orders that resolve to the same shardings share one node (the tree is a DAG: every
legal action adds an axis somewhere, so no path returns to a state).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import numpy as np

from agents.base import Budget, Progress, Searcher, SearchResult, Tracker, row, start, value
from automap_rl.problem import Problem


@dataclasses.dataclass(frozen=True)
class MCTSConfig:
  """UCT search.

  Attributes:
    action_space: the environment's action space (`groups`, `arg_dims`, `named_dims`).
    max_decisions: the environment's capacity in class decisions.
    exploration: UCB1's constant on values normalised to [0, 1].
    rollouts: random episodes from every expanded leaf (vmapped); 0 for none.
    depth: the longest rollout, in actions.
    stop_probability: after a rollout's first action, its chance of stopping per step.
    backup: a node's value for selection: `max` (best plan below it, as suits
      single-player optimisation) or `mean` (classic UCT).
    transpositions: merge nodes with equal shardings (and pipelines).
    pipelines: the environment's pipeline options (`EnvConfig.pipelines`; 0: none).
  """

  action_space: str = "groups"
  max_decisions: int = 256
  exploration: float = 0.5
  rollouts: int = 2
  depth: int = 6
  stop_probability: float = 0.15
  backup: Literal["max", "mean"] = "max"
  transpositions: bool = True
  pipelines: int = 0


class _Node:
  __slots__ = (
    "state",
    "actions",
    "objective",
    "children",
    "visits",
    "total",
    "best",
    "expanded",
    "exhausted",
  )

  def __init__(self, state, actions: list[int]):
    self.state = state
    self.actions = actions
    self.objective = float(state.objective)
    self.children: dict[int, _Node] = {}
    self.visits = 1
    self.total = self.best = value(self.objective)
    self.expanded = False
    self.exhausted = False


def _key(state) -> bytes:
  return b"".join(
    np.ascontiguousarray(x).tobytes()
    for x in (state.value_mask, state.op_mask, state.num_decisions, state.pipeline)
  )


class _Tree:
  def __init__(self, search: Searcher, track: Tracker, config: MCTSConfig, seed: int):
    self.search, self.track, self.config = search, track, config
    self.rng = np.random.default_rng(seed)
    self.key = jax.random.key(seed)
    self.root = _Node(search.root, [])
    self.table: dict[bytes, _Node] = {_key(search.root): self.root}
    self.low, self.high = 0.0, 1e-9

  def q(self, node: _Node) -> float:
    q = node.best if self.config.backup == "max" else node.total / node.visits
    return (q - self.low) / max(self.high - self.low, 1e-12)

  def select(self, parent: _Node, children: list[_Node]) -> _Node:
    log_n = math.log(max(parent.visits, 1))
    scores = [self.q(c) + self.config.exploration * math.sqrt(log_n / c.visits) for c in children]
    return children[int(np.argmax(scores))]

  def child(self, state, actions: list[int]) -> _Node:
    key = _key(state) if self.config.transpositions else None
    node = self.table.get(key) if key is not None else None
    if node is None:
      node = _Node(state, actions)
      self.track.offer(node.objective, float(state.step_time), actions)
      self.see(node.best)
      if key is not None:
        self.table[key] = node
    return node

  def see(self, v: float) -> None:
    self.low, self.high = min(self.low, v), max(self.high, v)

  def expand(self, node: _Node) -> float:
    """Evaluates the leaf's children and rollouts from it; returns the leaf's value."""
    node.expanded = True
    legal = self.rng.permutation(self.search.legal(node.state))[: self.track.left]
    if len(legal) == 0:
      node.exhausted = True
      return node.best
    batch = self.search.children(node.state, legal)
    self.track.count(len(legal))
    best = node.best
    for i, action in enumerate(legal):
      child = self.child(row(batch, i), node.actions + [int(action)])
      node.children[int(action)] = child
      best = max(best, child.best)
    r = min(self.config.rollouts, -(-self.track.left // self.config.depth))
    if r > 0:
      self.key, sub = jax.random.split(self.key)
      limits = np.clip(self.track.left - np.arange(r) * self.config.depth, 0, self.config.depth)
      actions, objectives, step_times, evaluated = self.search.rollouts(
        node.state,
        jax.random.split(sub, r),
        limits,
        self.config.depth,
        self.config.stop_probability,
      )
      self.track.count(int(evaluated.sum()))
      for e in range(r):
        n = int(evaluated[e].sum())
        if n:
          i = int(np.argmin(objectives[e, :n]))
          self.track.offer(
            objectives[e, i], step_times[e, i], node.actions + [int(a) for a in actions[e, : i + 1]]
          )
          v = value(objectives[e, i])
          self.see(v)
          best = max(best, v)
    return best

  def iterate(self) -> bool:
    """One selection, expansion, rollout and backup; False when the tree is exhausted."""
    path, node = [self.root], self.root
    while node.expanded:
      open_children = [c for c in node.children.values() if not c.exhausted]
      if not open_children:
        node.exhausted = True
        break
      node = self.select(node, open_children)
      path.append(node)
    if node.exhausted:
      if node is self.root:
        return False
      leaf_value = node.best
    else:
      leaf_value = self.expand(node)
    for n in path:
      n.visits += 1
      n.total += leaf_value
      n.best = max(n.best, leaf_value)
    return True


def search(
  problem: Problem,
  config: MCTSConfig = MCTSConfig(),
  seed: int = 0,
  budget: Budget | int | str = 2000,
  progress: Progress | None = None,
) -> SearchResult:
  """Runs UCT until the budget is spent or the tree is exhausted; returns the best plan seen.

  Deterministic for a given seed and a simulations budget."""
  search_, track, _ = start(
    problem, config.action_space, config.max_decisions, budget, progress, config.pipelines
  )
  tree = _Tree(search_, track, config, seed)
  while not track.done and tree.iterate():
    pass
  return track.result()
