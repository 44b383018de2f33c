"""Environment throughput: steps per second of one jitted env and of a vmapped batch."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from automap_rl import mesh as mesh_lib
from automap_rl import workloads
from automap_rl.problem import Problem
from envs.config import EnvConfig
from envs.env import Env


def random_actions(key: jax.Array, legal: jax.Array) -> jax.Array:
  """A uniformly random legal action per row of `legal` (bool [..., A]), int32 [...]."""
  return jax.random.categorical(key, jnp.where(legal, 0.0, -jnp.inf)).astype(jnp.int32)


def _rollout(env: Env, batch: int | None, steps: int):
  """A jitted function running `steps` random steps from `init`, restarting finished episodes."""
  def one_step(carry, key):
    state, fresh = carry
    act_key, _ = jax.random.split(key)
    state = env.step(state, random_actions(act_key, state.legal_action_mask))
    done = state.terminated | state.truncated
    state = jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh, state)
    return (state, fresh), None

  step_fn = one_step if batch is None else jax.vmap(one_step, in_axes=((0, 0), 0))

  @jax.jit
  def run(key):
    init_keys = jax.random.split(key, 1 if batch is None else batch)
    fresh = env.init(init_keys[0]) if batch is None else jax.vmap(env.init)(init_keys)
    keys = jax.random.split(key, steps if batch is None else (steps, batch))
    (state, _), _ = jax.lax.scan(step_fn, (fresh, fresh), keys)
    return state.objective

  return run


def _rate(run, steps: int, seconds: float) -> float:
  jax.block_until_ready(run(jax.random.key(0)))  # Compile and warm up.
  start, calls = time.perf_counter(), 0
  while True:
    jax.block_until_ready(run(jax.random.key(calls + 1)))
    calls += 1
    elapsed = time.perf_counter() - start
    if elapsed >= seconds:
      return calls * steps / elapsed


def bench_env(model: str, mesh: str = "data=2,model=4", hardware: str = "h100", batch: int = 256,
              seconds: float = 5.0, config: EnvConfig = EnvConfig()) -> dict:
  """Random-agent environment steps per second, after warm-up, of one env (a jitted scan)
  and of `batch` envs (a vmapped scan), each measured for about `seconds`."""
  program = workloads.make_workload(model).trace()
  env = Env.build(Problem.build(program, mesh_lib.make_mesh(mesh, hardware)), config)
  single_steps, batched_steps = 256, 16
  return {
      "model": model,
      "mesh": mesh,
      "hardware": hardware,
      "action_space": config.action_space,
      "num_actions": env.num_actions,
      "steps_per_second_single": _rate(_rollout(env, None, single_steps), single_steps, seconds),
      "steps_per_second_batched": _rate(_rollout(env, batch, batched_steps), batched_steps * batch, seconds),
      "batch": batch,
  }
