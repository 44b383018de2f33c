"""Agents by name: `AGENTS` maps a name to `(config class, search function)`."""

from __future__ import annotations

from collections.abc import Callable

from agents import alpa, greedy, gumbel, ilp, learned, mcts, random_search
from agents.alpa import AlpaConfig
from agents.base import Budget, Progress, SearchResult
from agents.greedy import GreedyConfig
from agents.gumbel import GumbelConfig
from agents.ilp import ILPConfig
from agents.learned import LearnedConfig
from agents.mcts import MCTSConfig
from agents.random_search import RandomConfig
from automap_rl.problem import Problem

AGENTS: dict[str, tuple[type, Callable[..., SearchResult]]] = {
  "random": (RandomConfig, random_search.search),
  "greedy": (GreedyConfig, greedy.search),
  "mcts": (MCTSConfig, mcts.search),
  "gumbel": (GumbelConfig, gumbel.search),
  "ilp": (ILPConfig, ilp.search),
  "learned": (LearnedConfig, learned.search),
  "alpa": (AlpaConfig, alpa.search),
}


def run_agent(
  name: str,
  problem: Problem,
  seed: int = 0,
  budget: Budget | int | str = 2000,
  config=None,
  progress: Progress | None = None,
) -> SearchResult:
  """Runs agent `name` (a key of `AGENTS`) with `config` (default: the agent's defaults)."""
  if name not in AGENTS:
    raise ValueError(f"Unknown agent {name!r}; valid: {', '.join(AGENTS)}.")
  config_cls, fn = AGENTS[name]
  return fn(problem, config_cls() if config is None else config, seed, budget, progress)
