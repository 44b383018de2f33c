"""`automap-rl env MODEL`: a random (or batch-sharding expert) episode of the partitioning env."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from automap_rl import mesh as mesh_lib
from automap_rl import workloads
from automap_rl.problem import Problem
from envs import Env, EnvConfig
from envs.config import ActionSpace, Objective
from envs.gym import GymEnv
from experiments.cli import write_json
from experiments.options import Hardware, JsonPath, MeshSpec, PositionalWorkload


@dataclasses.dataclass(frozen=True)
class EnvEpisodeConfig:
  """One episode.

  Attributes:
    workload: the workload spec.
    mesh: the mesh spec.
    hardware: the hardware profile.
    action_space: what an action shards: an argument dimension, a named dimension or a
      structural group of them (see `envs.EnvConfig`).
    objective: what the reward measures (see `envs.EnvConfig`).
    max_decisions: the episode's capacity in class decisions.
    seed: the random agent's seed.
    json: where to write the episode.
  """

  workload: PositionalWorkload = "gpt"
  mesh: MeshSpec = "data=2,model=4"
  hardware: Hardware = "h100"
  action_space: ActionSpace = "groups"
  objective: Objective = "time"
  max_decisions: int = 64
  seed: int = 0
  json: JsonPath = None


def run(config: EnvEpisodeConfig) -> dict[str, Any]:
  problem = Problem.build(
    workloads.make_workload(config.workload).trace(),
    mesh_lib.make_mesh(config.mesh, config.hardware),
  )
  env = Env.build(
    problem,
    EnvConfig(
      action_space=config.action_space,
      objective=config.objective,
      max_decisions=config.max_decisions,
    ),
  )
  gym = GymEnv(env)
  _, info = gym.reset(seed=config.seed)
  print(
    f"{config.workload} on {config.mesh} ({config.hardware}): {len(env.targets)} "
    f"{config.action_space} "
    f"targets, {env.num_actions} actions, replicated step {info['step_time'] * 1e3:.3f} ms, "
    f"peak {info['peak_memory'] / 2**30:.3f} GiB"
  )
  steps, total, done = [], 0.0, False
  while not done:
    action = int(gym.action_space.sample(info["action_mask"].astype(np.int8)))
    _, reward, terminated, truncated, info = gym.step(action)
    total += reward
    done = terminated or truncated
    steps.append(
      {
        "action": action,
        "name": env.action_name(action),
        "reward": reward,
        **{k: info[k] for k in ("objective", "step_time", "peak_memory", "num_decisions")},
      }
    )
    print(
      f"{len(steps):>3} {env.action_name(action):<60} reward {reward:+.4f}  objective "
      f"{info['objective']:.4f}  "
      f"step {info['step_time'] * 1e3:.3f} ms  peak {info['peak_memory'] / 2**30:.3f} GiB"
    )
  print(f"return {total:+.4f} over {len(steps)} steps ({info['num_decisions']} class decisions)")
  summary = {"config": dataclasses.asdict(config), "steps": steps, "return": total}
  write_json(config.json, summary)
  return summary
