"""`automap-rl bench simulator|env ...`: throughput benchmarks, ratios measured in one run."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from automap_rl import workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from envs.bench import bench_env
from experiments.cli import write_json
from experiments.options import Hardware, JsonPath, MeshSpec, Workload


@dataclasses.dataclass(frozen=True)
class EnvBenchConfig:
  """Environment steps per second: one environment, and a vmapped batch of them.

  Attributes:
    workload: the workload spec.
    mesh: the mesh spec.
    hardware: the hardware profile.
    batch: environments per vmapped call.
    seconds: how long to time each mode.
    seed: seed of the random actions.
    json: where to write the figures.
  """

  workload: Workload = "gpt:layers=12"
  mesh: MeshSpec = "data=2,model=4"
  hardware: Hardware = "h100"
  batch: int = 256
  seconds: float = 3.0
  seed: int = 0
  json: JsonPath = None


@dataclasses.dataclass(frozen=True)
class SimulatorBenchConfig(EnvBenchConfig):
  """Simulator evaluations per second: one plan per call, and a vmapped batch of plans.

  Attributes:
    batch: plans per vmapped call.
    decisions: decisions per random plan.
    seed: seed of the random plans.
  """

  decisions: int = 16


def calls_per_second(fn: Callable[[], Any], seconds: float) -> float:
  """Calls of `fn` per second after one warm-up call, blocking on every result."""
  jax.block_until_ready(fn())
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    jax.block_until_ready(fn())
    calls += 1
  return calls / (time.perf_counter() - start)


def random_plans(problem: Problem, key: jax.Array, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
  """`batch` random decision lists of (named dim, axis), int32 [batch, length] each."""
  class_key, axis_key = jax.random.split(key)
  classes = jax.random.randint(class_key, (batch, length), 0, max(len(problem.named.classes), 1))
  axes = jax.random.randint(axis_key, (batch, length), 0, len(problem.mesh.axis_sizes))
  return classes.astype(jnp.int32), axes.astype(jnp.int32)


def bench_simulator(config: SimulatorBenchConfig) -> dict[str, Any]:
  """Cost evaluations per second, one plan per call and a vmapped batch per call."""
  workload = workloads.make_workload(config.workload, abstract=True)
  problem = Problem.build(workload.trace(), make_mesh(config.mesh, config.hardware))
  classes, axes = random_plans(problem, jax.random.key(config.seed), config.batch, config.decisions)
  single = jax.jit(problem.evaluate)
  batched = jax.jit(jax.vmap(problem.evaluate))
  return {
      "model": workload.name,
      "mesh": config.mesh,
      "evals_per_second_single": calls_per_second(lambda: single(classes[0], axes[0]), config.seconds),
      "evals_per_second_batched": config.batch * calls_per_second(lambda: batched(classes, axes), config.seconds),
      "batch": config.batch,
      "value_signatures": len(problem.sigs.value_keys),
      "op_signatures": len(problem.sigs.op_keys),
  }


def report(result: dict[str, Any], json_path: str | None) -> dict[str, Any]:
  print(json.dumps(result, indent=1))
  write_json(json_path, result)
  return result


def run_simulator(config: SimulatorBenchConfig) -> dict[str, Any]:
  return report(bench_simulator(config), config.json)


def run_env(config: EnvBenchConfig) -> dict[str, Any]:
  return report(bench_env(config.workload, config.mesh, config.hardware, batch=config.batch, seconds=config.seconds),
                config.json)
