"""Random search: uniformly random legal episodes from the replicated plan, best prefix kept."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from agents.base import Budget, Progress, SearchResult, start
from automap_rl.problem import Problem


@dataclasses.dataclass(frozen=True)
class RandomConfig:
  """Random search.

  Attributes:
    action_space: the environment's action space (`groups`, `arg_dims`, `named_dims`).
    max_decisions: the environment's capacity in class decisions.
    depth: the longest episode, in actions.
    stop_probability: after the first action, the chance of stopping at each step.
    batch: episodes per (vmapped) call.
  """

  action_space: str = "groups"
  max_decisions: int = 256
  depth: int = 12
  stop_probability: float = 0.1
  batch: int = 16


def search(
  problem: Problem,
  config: RandomConfig = RandomConfig(),
  seed: int = 0,
  budget: Budget | int | str = 1000,
  progress: Progress | None = None,
) -> SearchResult:
  """Samples random episodes until the budget is spent; every prefix is a candidate plan.

  Deterministic for a given seed and a simulations budget: the last batch gets per-episode
  step limits so that the count never exceeds the budget.
  """
  search_, track, _ = start(problem, config.action_space, config.max_decisions, budget, progress)
  key = jax.random.key(seed)
  while not track.done:
    key, sub = jax.random.split(key)
    left = min(track.left, config.batch * config.depth)
    limits = np.clip(left - np.arange(config.batch) * config.depth, 0, config.depth)
    actions, objectives, step_times, evaluated = search_.rollouts(
      search_.root,
      jax.random.split(sub, config.batch),
      limits,
      config.depth,
      config.stop_probability,
    )
    used = int(evaluated.sum())
    if used == 0:  # Nothing is legal from the root.
      break
    base = track.simulations
    for e in range(config.batch):
      n = int(evaluated[e].sum())
      if n:
        i = int(np.argmin(objectives[e, :n]))
        track.offer(
          objectives[e, i],
          step_times[e, i],
          actions[e, : i + 1],
          base + int(evaluated[:e].sum()) + i + 1,
        )
    track.count(used)
  return track.result()
