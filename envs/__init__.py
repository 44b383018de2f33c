"""Partitioning environments: a pure JAX core in the PGX style, graph observations,
batches across models, and a Gymnasium-style wrapper."""

from envs.actions import Target, targets
from envs.config import EnvConfig
from envs.core import State, init, legal_actions, step
from envs.env import Env
from envs.observe import observe

__all__ = [
  "Env",
  "EnvConfig",
  "State",
  "Target",
  "init",
  "legal_actions",
  "observe",
  "step",
  "targets",
]
