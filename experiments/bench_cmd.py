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
from experiments.cli import write_json


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """A throughput benchmark.

  Attributes:
    target: `simulator` or `env`.
    model: zoo spec.
    mesh: mesh spec.
    hardware: hardware profile.
    batch: plans (environments) per vmapped call.
    decisions: decisions per random plan.
    seconds: how long to time each mode.
    seed: seed of the random plans.
    json_path: where to write the figures.
  """

  target: str = "simulator"
  model: str = "gpt:layers=12"
  mesh: str = "data=2,model=4"
  hardware: str = "h100"
  batch: int = 256
  decisions: int = 16
  seconds: float = 3.0
  seed: int = 0
  json_path: str | None = None


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


def bench_simulator(config: BenchConfig) -> dict[str, Any]:
  """Cost evaluations per second, one plan per call and a vmapped batch per call."""
  workload = workloads.make_workload(config.model, abstract=True)
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


def run(config: BenchConfig) -> dict[str, Any]:
  if config.target == "simulator":
    result = bench_simulator(config)
  else:
    from envs.bench import bench_env

    result = bench_env(config.model, config.mesh, config.hardware, batch=config.batch, seconds=config.seconds)
  print(json.dumps(result, indent=1))
  write_json(config.json_path, result)
  return result


def _throughput_flags(parser) -> None:
  parser.add_argument("--model", default="gpt:layers=12")
  parser.add_argument("--mesh", default="data=2,model=4")
  parser.add_argument("--hardware", default="h100")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--seconds", type=float, default=3.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", dest="json_path")
  parser.set_defaults(command=lambda a: run(BenchConfig(
      target=a.target, model=a.model, mesh=a.mesh, hardware=a.hardware, batch=a.batch,
      seconds=a.seconds, seed=a.seed, json_path=a.json_path)))


def register(subparsers) -> None:
  from experiments import bench_search

  parser = subparsers.add_parser("bench", help="benchmarks: simulator and env throughput, search quality")
  targets = parser.add_subparsers(dest="target", required=True)
  _throughput_flags(targets.add_parser("simulator", help="cost evaluations per second"))
  _throughput_flags(targets.add_parser("env", help="environment steps per second"))
  search = targets.add_parser("search", help="search agents against the best expert tactic on the zoo")
  bench_search.add_arguments(search)
  search.set_defaults(command=lambda a: bench_search.run(bench_search.config_from_args(a)))
