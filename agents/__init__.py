"""Search agents, and `partition`, the facade that runs one on a user's function.

Every agent is `search(problem, config, seed, budget, progress=None) -> SearchResult` with a
frozen config dataclass; `AGENTS` maps names to `(config class, search function)` and
`run_agent(name, problem, ...)` runs one by name with its default config.
"""

from agents.alpa import AlpaConfig
from agents.base import Budget, Progress, SearchResult, Seconds, Simulations, TracePoint
from agents.greedy import GreedyConfig
from agents.gumbel import GumbelConfig, GumbelSettings
from agents.learned import LearnedConfig
from agents.mcts import MCTSConfig
from agents.partition import partition
from agents.random_search import RandomConfig
from agents.registry import AGENTS, run_agent
from automap_rl.plan import Plan

__all__ = [
  "AGENTS",
  "AlpaConfig",
  "Budget",
  "GreedyConfig",
  "GumbelConfig",
  "GumbelSettings",
  "LearnedConfig",
  "MCTSConfig",
  "Plan",
  "Progress",
  "RandomConfig",
  "SearchResult",
  "Seconds",
  "Simulations",
  "TracePoint",
  "partition",
  "run_agent",
]
