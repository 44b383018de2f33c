"""Greedy one-step lookahead: evaluate every legal action, take the best, until none improves."""

from __future__ import annotations

import dataclasses

import numpy as np

from agents.base import Budget, Progress, SearchResult, row, start
from automap_rl.problem import Problem


@dataclasses.dataclass(frozen=True)
class GreedyConfig:
  """Greedy search.

  Attributes:
    action_space: the environment's action space.
    max_decisions: the environment's capacity in class decisions.
    min_improvement: stop when the best action improves the objective by less than this
      fraction.
  """

  action_space: str = "groups"
  max_decisions: int = 256
  min_improvement: float = 1e-4


def search(
  problem: Problem,
  config: GreedyConfig = GreedyConfig(),
  seed: int = 0,
  budget: Budget | int | str = 1000,
  progress: Progress | None = None,
) -> SearchResult:
  """Hill-climbs from the replicated plan, one vmapped evaluation of all legal actions per
  step. The seed orders the actions (it breaks ties and picks the subset evaluated when
  fewer simulations are left than legal actions)."""
  search_, track, _ = start(problem, config.action_space, config.max_decisions, budget, progress)
  rng = np.random.default_rng(seed)
  state, path, objective = search_.root, [], 1.0
  while not track.done:
    legal = rng.permutation(search_.legal(state))[: track.left]
    if len(legal) == 0:
      break
    children = search_.children(state, legal)
    track.count(len(legal))
    best = int(np.argmin(children.objective))
    if not children.objective[best] < objective * (1 - config.min_improvement):
      break
    state = row(children, best)
    objective = float(state.objective)
    path.append(int(legal[best]))
    track.offer(objective, float(state.step_time), path)
  return track.result()
