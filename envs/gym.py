"""A Gymnasium-style wrapper around one `Env` for ordinary Python agents."""

from __future__ import annotations

from typing import Any

import gymnasium
import jax
import jraph
import numpy as np

from envs.env import Env


class GymEnv:
  """`reset(seed) -> (obs, info)`, `step(action) -> (obs, reward, terminated, truncated, info)`.

  Observations are `jraph.GraphsTuple`s of numpy arrays (see `envs.observe`); `info` has
  `action_mask` (bool [A]), `objective`, `step_time`, `peak_memory` and `num_decisions`.
  `action_space` is a `gymnasium.spaces.Discrete` seeded by `reset`, so
  `action_space.sample(info["action_mask"].astype(np.int8))` is a seeded random agent.
  """

  def __init__(self, env: Env):
    self.env = env
    self.action_space = gymnasium.spaces.Discrete(env.num_actions)
    self._init = jax.jit(env.init)
    self._step = jax.jit(env.step)
    self._observe = jax.jit(env.observe)
    self.state = None

  def _out(self) -> tuple[jraph.GraphsTuple, dict[str, Any]]:
    state = jax.device_get(self.state)
    info = {
      "action_mask": np.asarray(state.legal_action_mask),
      "objective": float(state.objective),
      "step_time": float(state.step_time),
      "peak_memory": float(state.peak_memory),
      "num_decisions": int(state.num_decisions),
    }
    return jax.device_get(self._observe(self.state)), info

  def reset(self, seed: int | None = None, options: dict | None = None):
    del options
    self.action_space.seed(seed)
    self.state = self._init(jax.random.key(0 if seed is None else seed))
    return self._out()

  def step(self, action: int):
    if self.state is None:
      raise RuntimeError("Call reset() before step().")
    self.state = self._step(self.state, np.int32(action))
    obs, info = self._out()
    return (
      obs,
      float(self.state.reward),
      bool(self.state.terminated),
      bool(self.state.truncated),
      info,
    )
