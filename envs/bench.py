"""Environment throughput: steps per second of one jitted env and of a vmapped batch."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from automap_rl.problem import Problem
from envs import core
from envs.config import EnvConfig
from envs.env import Env
from envs.tables import EnvTables


def random_actions(key: jax.Array, legal: jax.Array) -> jax.Array:
  """A uniformly random legal action per row of `legal` (bool [..., A]), int32 [...]: the
  k-th legal one for k uniform below their count (one random number a row, where a
  categorical draws one per action, a tenth of the environment's step)."""
  count = legal.sum(axis=-1)
  k = jnp.minimum(jnp.floor(jax.random.uniform(key, count.shape) * count), count - 1)
  return jnp.argmax(jnp.cumsum(legal, axis=-1) > k[..., None], axis=-1).astype(jnp.int32)


def random_steps(env: Env, batch: int | None, steps: int, tables_as_argument: bool):
  """A jitted function of a key running `steps` random steps from `init`, restarting
  finished episodes. `tables_as_argument`: the environment's tables are the jitted
  function's argument (as searches pass them, so that problems of a bucket share the
  compile), else constants compiled into it."""

  def run(tables: EnvTables, key: jax.Array) -> jax.Array:
    def one_step(carry, key):
      state, fresh = carry
      act_key, _ = jax.random.split(key)
      state = core.step(env.config, tables, state, random_actions(act_key, state.legal_action_mask))
      done = state.terminated | state.truncated
      state = jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh, state)
      return (state, fresh), None

    step_fn = one_step if batch is None else jax.vmap(one_step, in_axes=((0, 0), 0))
    init = functools.partial(core.init, env.config, tables)
    init_keys = jax.random.split(key, 1 if batch is None else batch)
    fresh = init(init_keys[0]) if batch is None else jax.vmap(init)(init_keys)
    keys = jax.random.split(key, steps if batch is None else (steps, batch))
    (state, _), _ = jax.lax.scan(step_fn, (fresh, fresh), keys)
    return state.objective

  if tables_as_argument:
    compiled = jax.jit(run)
    return lambda key: compiled(env.tables, key)
  return jax.jit(functools.partial(run, env.tables))


def _rate(run, steps: int, seconds: float) -> float:
  jax.block_until_ready(run(jax.random.key(0)))  # Compile and warm up.
  start, calls = time.perf_counter(), 0
  while True:
    jax.block_until_ready(run(jax.random.key(calls + 1)))
    calls += 1
    elapsed = time.perf_counter() - start
    if elapsed >= seconds:
      return calls * steps / elapsed


BATCHED_STEPS, SINGLE_STEPS = 16, 256  # Random steps per jitted call.


def batched_rate(
  problem: Problem, batch: int, config: EnvConfig, bucketed: bool
) -> Callable[[float], float]:
  """A function of seconds that measures steps per second of `batch` envs (a vmapped scan)
  for about that long, its environment built and its rollout compiled once. `bucketed`:
  the tables padded to their buckets and passed as arguments, as the searches run them;
  else exact-size tables compiled in as constants."""
  run = random_steps(Env.build(problem, config, bucket=bucketed), batch, BATCHED_STEPS, bucketed)
  return lambda seconds: _rate(run, BATCHED_STEPS * batch, seconds)


def bench_env(
  problem: Problem,
  batch: int = 256,
  seconds: float = 5.0,
  config: EnvConfig = EnvConfig(),
  single: bool = True,
) -> dict:
  """Random-agent environment steps per second, after warm-up, of `batch` envs (a vmapped
  scan) and, if `single`, of one env (a jitted scan), each measured for about `seconds`,
  on exact-size tables. Episodes that end restart from the replicated plan."""
  env = Env.build(problem, config)
  out = {
    "reward": config.reward,
    "action_space": config.action_space,
    "num_actions": env.num_actions,
    "batch": batch,
    "steps_per_second_batched": _rate(
      random_steps(env, batch, BATCHED_STEPS, False), BATCHED_STEPS * batch, seconds
    ),
  }
  if single:
    out["steps_per_second_single"] = _rate(
      random_steps(env, None, SINGLE_STEPS, False), SINGLE_STEPS, seconds
    )
  return out
