"""Search agents: random search, greedy one-step lookahead and UCT Monte Carlo tree search.

Every agent is `search(problem, config, seed, budget, progress=None) -> SearchResult` with a
frozen config dataclass; `AGENTS` maps names to `(config class, search function)` and
`run_agent(name, problem, ...)` runs one by name with its default config.
"""

from __future__ import annotations

from collections.abc import Callable

from agents import greedy, mcts, random_search
from agents.base import Budget, Progress, SearchResult, TracePoint
from agents.greedy import GreedyConfig
from agents.mcts import MCTSConfig
from agents.random_search import RandomConfig
from automap_rl.problem import Problem

AGENTS: dict[str, tuple[type, Callable[..., SearchResult]]] = {
    "random": (RandomConfig, random_search.search),
    "greedy": (GreedyConfig, greedy.search),
    "mcts": (MCTSConfig, mcts.search),
}


def run_agent(name: str, problem: Problem, seed: int = 0, budget: Budget | int | float = 2000,
              config=None, progress: Progress | None = None) -> SearchResult:
  """Runs agent `name` (a key of `AGENTS`) with `config` (default: the agent's defaults)."""
  if name not in AGENTS:
    raise ValueError(f"Unknown agent {name!r}; valid: {', '.join(AGENTS)}.")
  config_cls, fn = AGENTS[name]
  return fn(problem, config_cls() if config is None else config, seed, budget, progress)


__all__ = ["AGENTS", "Budget", "GreedyConfig", "MCTSConfig", "RandomConfig", "SearchResult", "TracePoint",
           "run_agent"]
