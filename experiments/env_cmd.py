"""`automap-rl env MODEL`: a random (or batch-sharding expert) episode of the partitioning env."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from automap_rl import mesh as mesh_lib
from automap_rl import workloads
from automap_rl.problem import Problem
from envs import Env, EnvConfig
from envs.gym import GymEnv
from experiments.cli import write_json


@dataclasses.dataclass(frozen=True)
class EnvEpisodeConfig:
  """One episode.

  Attributes:
    model: a zoo spec; mesh, hardware: as for `make_mesh`.
    action_space, objective, max_decisions: see `envs.EnvConfig`.
    seed: the random agent's seed.
    json_path: where to write the episode, or None.
  """

  model: str = "gpt"
  mesh: str = "data=2,model=4"
  hardware: str = "h100"
  action_space: str = "groups"
  objective: str = "time"
  max_decisions: int = 64
  seed: int = 0
  json_path: str | None = None


def run(config: EnvEpisodeConfig) -> dict[str, Any]:
  problem = Problem.build(workloads.make_workload(config.model).trace(),
                          mesh_lib.make_mesh(config.mesh, config.hardware))
  env = Env.build(problem, EnvConfig(action_space=config.action_space, objective=config.objective,
                                     max_decisions=config.max_decisions))
  gym = GymEnv(env)
  _, info = gym.reset(seed=config.seed)
  print(f"{config.model} on {config.mesh} ({config.hardware}): {len(env.targets)} {config.action_space} "
        f"targets, {env.num_actions} actions, replicated step {info['step_time'] * 1e3:.3f} ms, "
        f"peak {info['peak_memory'] / 2**30:.3f} GiB")
  steps, total, done = [], 0.0, False
  while not done:
    action = int(gym.action_space.sample(info["action_mask"].astype(np.int8)))
    _, reward, terminated, truncated, info = gym.step(action)
    total += reward
    done = terminated or truncated
    steps.append({"action": action, "name": env.action_name(action), "reward": reward, **{
        k: info[k] for k in ("objective", "step_time", "peak_memory", "num_decisions")}})
    print(f"{len(steps):>3} {env.action_name(action):<60} reward {reward:+.4f}  objective {info['objective']:.4f}  "
          f"step {info['step_time'] * 1e3:.3f} ms  peak {info['peak_memory'] / 2**30:.3f} GiB")
  print(f"return {total:+.4f} over {len(steps)} steps ({info['num_decisions']} class decisions)")
  summary = {"config": dataclasses.asdict(config), "steps": steps, "return": total}
  write_json(config.json_path, summary)
  return summary


def register(subparsers) -> None:
  parser = subparsers.add_parser("env", help="run a random episode of the partitioning environment")
  parser.add_argument("model", nargs="?", default="gpt", help="zoo spec, e.g. gpt:layers=12")
  parser.add_argument("--mesh", default="data=2,model=4")
  parser.add_argument("--hardware", default="h100")
  parser.add_argument("--action-space", default="groups", choices=("arg_dims", "named_dims", "groups"))
  parser.add_argument("--objective", default="time", choices=("time", "memory", "mix"))
  parser.add_argument("--max-decisions", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", dest="json_path")
  parser.set_defaults(command=lambda a: run(EnvEpisodeConfig(
      a.model, a.mesh, a.hardware, a.action_space, a.objective, a.max_decisions, a.seed, a.json_path)))
