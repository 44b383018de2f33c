"""The environment's configuration: action space, capacity and objective."""

from __future__ import annotations

import dataclasses
from typing import Literal

ActionSpace = Literal["arg_dims", "named_dims", "groups"]
Objective = Literal["time", "memory", "mix"]
Reward = Literal["shaped", "terminal"]


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """How decisions are offered and scored.

  Attributes:
    action_space: what an action targets, times a mesh axis: an argument dimension
      (Automap), a named dimension (TOAST) or a structural group of named dimensions.
      Targets that cover the same set of classes are offered once. One extra action stops.
    max_decisions: capacity of the encoded decision arrays (class decisions, so a group
      action takes one slot per class it covers).
    max_axes: mesh axes the tables are laid out for; meshes with fewer axes are padded
      (their missing axes are never legal), so one network serves all meshes.
    objective: `time` (step time, memory above the device's capacity penalised),
      `memory` (peak memory per device) or `mix` (a weighted sum of the two, each relative
      to the replicated program).
    memory_weight: weight of memory in `mix`.
    memory_penalty: the step time is multiplied by `1 + memory_penalty * overflow`, where
      overflow is the peak memory's relative excess over the device's memory.
    max_steps: episodes longer than this are truncated; None: only capacity ends them.
    reward: `shaped`: every step simulates its plan; the state carries its objective and
      the reward is the objective's decrease (what search agents that compare the plans of
      inner nodes need: greedy, UCT, random rollouts). `terminal`: a step only applies its
      decision; the plan is simulated once, on the step that ends the episode, whose reward
      is the whole decrease `1 - objective`; until then the state carries the replicated
      plan's figures (objective 1) and rewards 0. Both give every episode the same return,
      and `reward = before.objective - after.objective` holds in both.
    pipelines: pipeline options (`envs.pipelines`): with P > 0 an episode starts with a
      pipeline action, one of P options ("no pipeline" and pipelines of the largest layer
      stack whose stages take one mesh axis whole), then the intra-op actions without the
      stage axis; the chosen pipeline prices the plan (`simulator.pipeline_cost`). 0: no
      pipeline action at all.
  """

  action_space: ActionSpace = "groups"
  max_decisions: int = 64
  max_axes: int = 4
  objective: Objective = "time"
  memory_weight: float = 0.5
  memory_penalty: float = 1.0
  max_steps: int | None = None
  reward: Reward = "shaped"
  pipelines: int = 0

  def __post_init__(self):
    if self.action_space not in ("arg_dims", "named_dims", "groups"):
      raise ValueError(
        f"Unknown action space {self.action_space!r}; valid: arg_dims, named_dims, groups."
      )
    if self.objective not in ("time", "memory", "mix"):
      raise ValueError(f"Unknown objective {self.objective!r}; valid: time, memory, mix.")
    if self.reward not in ("shaped", "terminal"):
      raise ValueError(f"Unknown reward {self.reward!r}; valid: shaped, terminal.")
    if self.max_decisions < 1 or self.max_axes < 1:
      raise ValueError("max_decisions and max_axes must be positive.")
    if self.pipelines < 0:
      raise ValueError(
        f"pipelines={self.pipelines} must be 0 (none) or a number of pipeline options."
      )

  @property
  def weights(self) -> tuple[float, float]:
    """(time weight, memory weight) of the objective."""
    return {
      "time": (1.0, 0.0),
      "memory": (0.0, 1.0),
      "mix": (1.0 - self.memory_weight, self.memory_weight),
    }[self.objective]
