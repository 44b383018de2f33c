"""Training distributions: zoo models at sampled sizes on sampled meshes, and mixed batches.

`sample_problems(seed, n)` draws programs and meshes deterministically from the seed;
`batch_tables(problems, config)` pads their tables to common power-of-two buckets and
stacks them, so `jax.vmap(functools.partial(core.step, config))(tables, states, actions)`
steps a batch that mixes models (all share one action count, `tables.num_actions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from automap_rl import mesh as mesh_lib
from automap_rl import workloads
from automap_rl.problem import Problem
from envs import actions, tables
from envs.config import EnvConfig

# Per model, the config fields to sample and their choices.
SIZES: Mapping[str, Mapping[str, Sequence]] = {
  "mlp": {"layers": (2, 3, 4, 6), "width": (128, 256, 512, 1024), "batch": (16, 32, 64)},
  "gpt": {
    "layers": (1, 2, 3, 4),
    "d_model": (64, 128, 256),
    "seq": (32, 64, 128),
    "batch": (8, 16, 32),
  },
  "moe": {"layers": (1, 2), "d_model": (64, 128), "experts": (4, 8), "batch": (8, 16)},
  "gnn": {
    "n_node": (32, 64, 128),
    "latent": (32, 64, 128),
    "steps": (2, 3, 4),
    "batch": (8, 16, 32),
  },
  "resnet": {"stages": (2, 3), "width": (16, 32), "image_size": (16, 32), "batch": (8, 16, 32)},
  "unet": {"levels": (1, 2), "base_channels": (16, 32), "image_size": (16, 32), "batch": (8, 16)},
}
MESHES: tuple[str, ...] = ("data=8", "data=2,model=4", "data=4,model=2", "data=2,fsdp=2,model=2")
HARDWARE: tuple[str, ...] = ("h100",)


@dataclasses.dataclass(frozen=True)
class Sample:
  """One drawn training problem: a zoo spec, a mesh spec and its hardware."""

  model: str
  mesh: str
  hardware: str

  def to_problem(self) -> Problem:
    program = workloads.make_workload(self.model).trace()
    return Problem.build(program, mesh_lib.make_mesh(self.mesh, self.hardware))


def sample(
  seed: int,
  n: int,
  model_names: Sequence[str] = tuple(SIZES),
  meshes: Sequence[str] = MESHES,
  hardware: Sequence[str] = HARDWARE,
) -> list[Sample]:
  """`n` (model spec, mesh) draws, the same for the same seed."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    name = str(rng.choice(list(model_names)))
    fields = ",".join(
      f"{k}={v}"
      for k, choices in SIZES[name].items()
      for v in [choices[rng.integers(len(choices))]]
    )
    out.append(
      Sample(f"{name}:{fields}", str(rng.choice(list(meshes))), str(rng.choice(list(hardware))))
    )
  return out


def sample_problems(seed: int, n: int, **kwargs) -> list[Problem]:
  """Traced and built problems of `sample(seed, n, **kwargs)`."""
  return [s.to_problem() for s in sample(seed, n, **kwargs)]


def batch_tables(
  problems: Sequence[Problem], config: EnvConfig
) -> tuple[tables.EnvTables, list[tuple]]:
  """Stacked, bucket-padded tables of `problems` [len(problems), ...] and each one's targets."""
  targets = [actions.targets(p, config.action_space) for p in problems]
  built = [tables.build_env_tables(p, config, t) for p, t in zip(problems, targets)]
  return tables.stack(built), targets
