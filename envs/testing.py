"""The contract every partitioning environment keeps, as reusable checks (PGX's `api_test`).

`api_test(env)` plays seeded random episodes through an `Env` (exact-size, bucket-padded or
one row of a mixed batch) and raises `AssertionError` naming the broken rule:

* `init` and `step` are pure: jitted and vmapped calls agree, the same key gives
  the same episode, and a jitted `step` compiles once for a whole episode;
* states have the documented shapes and dtypes, with a leading batch axis under `vmap`;
* the stop action (the last) is always legal; a terminal state allows only stop, stays put
  whatever the action, and rewards 0; an illegal action acts as stop;
* rewards are finite and sum over an episode to the objective's decrease (1 - final);
* the state's resolution is `sharding.resolve` of its encoded decisions;
* observations are graphs of fixed shapes with finite features and in-range edges.

`check_plan_state(made, reached)` checks that a state made from a plan elsewhere
(`core.from_plan`) is the one its actions reach.

`gym_api_test(gym_env)` checks the Gymnasium-style wrapper's `reset`/`step` signatures,
seeding and masks.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from envs.core import State
from envs.env import Env
from envs.gym import GymEnv

# Rewards are differences of float32 sums over ~10^3 ops, which jit reassociates: they
# agree to ~1e-6 of the replicated objective, not to the last ulp.
TOLERANCE = 1e-5


def _random_actions(key: jax.Array, legal: jax.Array, stop_probability: float) -> jax.Array:
  """A legal non-stop action per row of `legal` [..., A] (stop when none, or by chance)."""
  pick, coin = jax.random.split(key)
  moves = legal.at[..., -1].set(False)
  action = jax.random.categorical(pick, jnp.where(moves, 0.0, -jnp.inf)).astype(jnp.int32)
  stop = ~moves.any(axis=-1) | (jax.random.uniform(coin, action.shape) < stop_probability)
  return jnp.where(stop, legal.shape[-1] - 1, action)


def _check_shapes(env: Env, state: State, batch: tuple[int, ...] = ()) -> None:
  k, a = env.config.max_decisions, env.num_actions
  chex.assert_shape([state.dec_class, state.dec_axis], (*batch, k))
  chex.assert_shape(state.legal_action_mask, (*batch, a))
  chex.assert_shape(
    [state.reward, state.objective, state.terminated, state.truncated, state.num_decisions], batch
  )
  chex.assert_type([state.dec_class, state.dec_axis, state.num_decisions], jnp.int32)
  chex.assert_type([state.reward, state.objective], jnp.float32)
  assert state.legal_action_mask.dtype == jnp.bool_ and state.terminated.dtype == jnp.bool_


def _episode(init, step, key: jax.Array, max_steps: int, stop_probability: float) -> list[State]:
  states = [init(key)]
  for i in range(max_steps):
    state = states[-1]
    if bool(state.terminated) or bool(state.truncated):
      break
    action = _random_actions(jax.random.fold_in(key, i), state.legal_action_mask, stop_probability)
    states.append(step(state, action))
  return states


def _check_terminal(env: Env, step, state: State) -> None:
  assert bool(state.terminated) or bool(state.truncated), "an episode ended in a live state"
  np.testing.assert_array_equal(
    np.flatnonzero(state.legal_action_mask),
    [env.num_actions - 1],
    err_msg="a terminal state allows an action besides stop",
  )
  for action in {0, env.num_actions // 2, env.num_actions - 1}:
    after = step(state, jnp.int32(action))
    assert float(after.reward) == 0.0, "a terminal state rewarded a step"
    chex.assert_trees_all_equal(after.replace(reward=state.reward), state)


def _check_episode(env: Env, step, states: list[State]) -> None:
  for before, after in zip(states, states[1:]):
    assert bool(after.legal_action_mask[-1]), "stop is not legal"
    assert np.isfinite(float(after.reward)), "a reward is not finite"
    np.testing.assert_allclose(
      float(after.reward),
      float(before.objective) - float(after.objective),
      atol=TOLERANCE,
      err_msg="a reward is not the objective's decrease",
    )
  final = states[-1]
  total = sum(float(s.reward) for s in states[1:])
  np.testing.assert_allclose(
    total,
    1.0 - float(final.objective),
    atol=TOLERANCE * max(len(states), 1),
    err_msg="the return is not the objective's total decrease",
  )
  resolved = env.problem.resolve(final.dec_class, final.dec_axis)
  for name in ("value_mask", "op_mask"):
    exact, padded = np.asarray(getattr(resolved, name)), np.asarray(getattr(final, name))
    rows, cols = exact.shape
    np.testing.assert_array_equal(
      padded[:rows, :cols],
      exact,
      err_msg=f"the state's {name} is not the resolution of its decisions",
    )
    assert not padded[rows:].any() and not padded[:, cols:].any(), f"padding of {name} was sharded"


def check_plan_state(made: State, reached: State) -> None:
  """Checks that a state made from a plan (`core.from_plan`) is the one its actions
  reached, but for the step count and reward; raises `AssertionError` naming the field."""
  for name in (
    "dec_class",
    "dec_axis",
    "num_decisions",
    "value_mask",
    "op_mask",
    "legal_action_mask",
    "terminated",
    "pipeline",
  ):
    np.testing.assert_array_equal(getattr(made, name), getattr(reached, name), err_msg=name)
  for name in ("objective", "step_time", "peak_memory"):
    np.testing.assert_allclose(
      float(getattr(made, name)), float(getattr(reached, name)), rtol=TOLERANCE, err_msg=name
    )
  assert int(made.step_count) == 0 and not bool(made.truncated)


def _check_observation(env: Env, states: list[State]) -> None:
  observe = jax.jit(env.observe)
  shapes = None
  for state in (states[0], states[-1]):
    graph = observe(state)
    now = jax.tree.map(np.shape, graph)
    assert shapes is None or now == shapes, "observation shapes change during an episode"
    shapes = now
    num_nodes = graph.nodes.shape[0]
    for name in ("nodes", "edges", "globals"):
      assert np.isfinite(np.asarray(getattr(graph, name))).all(), f"observation {name} not finite"
    for name in ("senders", "receivers"):
      ids = np.asarray(getattr(graph, name))
      assert ((ids >= 0) & (ids < num_nodes)).all(), f"observation {name} out of range"


def api_test(
  env: Env,
  *,
  num_episodes: int = 3,
  max_steps: int = 40,
  batch: int = 4,
  seed: int = 0,
  stop_probability: float = 0.05,
) -> None:
  """Checks the environment contract (see the module docstring) on `env`; raises
  `AssertionError` naming the broken rule."""
  key = jax.random.key(seed)
  traces = []

  def traced_step(state: State, action: jax.Array) -> State:
    traces.append(1)  # Runs once per trace, i.e. per compile.
    return env.step(state, action)

  init, step = jax.jit(env.init), jax.jit(traced_step)

  state = init(key)
  _check_shapes(env, state)
  assert bool(state.legal_action_mask[-1]), "stop is not legal at the start"

  for episode in range(num_episodes):
    episode_key = jax.random.fold_in(key, episode)
    states = _episode(init, step, episode_key, max_steps, stop_probability)
    again = _episode(init, step, episode_key, max_steps, stop_probability)
    assert len(states) == len(again), "the same key gave a different episode"
    chex.assert_trees_all_equal(states[-1], again[-1])
    last = states[-1]
    if not (bool(last.terminated) or bool(last.truncated)):
      last = step(last, jnp.int32(env.num_actions - 1))
      states.append(last)
    _check_episode(env, step, states)
    _check_terminal(env, step, last)
  assert len(traces) == 1, "step recompiled during episodes"

  live = init(key)
  illegal = np.flatnonzero(~np.asarray(live.legal_action_mask))
  if len(illegal):
    acted = step(live, jnp.int32(illegal[0]))
    assert bool(acted.terminated), "an illegal action did not act as stop"

  keys = jax.random.split(key, batch)
  states = jax.jit(jax.vmap(env.init))(keys)
  _check_shapes(env, states, (batch,))
  vstep = jax.jit(jax.vmap(env.step))
  plain = [init(k) for k in keys]
  for i in range(3):
    actions = _random_actions(jax.random.fold_in(key, 100 + i), states.legal_action_mask, 0.0)
    states = vstep(states, actions)
    plain = [step(s, a) for s, a in zip(plain, actions)]
    _check_shapes(env, states, (batch,))
  for b in range(batch):
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[b], states), plain[b], atol=TOLERANCE)
  _check_observation(env, _episode(init, step, key, max_steps, stop_probability))


def gym_api_test(gym: GymEnv, *, seed: int = 0, max_steps: int = 40) -> None:
  """Checks the Gymnasium-style wrapper: `reset(seed)` and `step` signatures, masks in
  `info`, seeded sampling, and termination by the stop action."""
  runs = []
  for _ in range(2):
    obs, info = gym.reset(seed=seed)
    assert info["action_mask"].dtype == np.bool_ and info["action_mask"][-1], (
      "stop not legal after reset"
    )
    actions, done = [], False
    while not done and len(actions) < max_steps:
      actions.append(int(gym.action_space.sample(info["action_mask"].astype(np.int8))))
      assert info["action_mask"][actions[-1]], "the wrapper sampled an illegal action"
      obs, reward, terminated, truncated, info = gym.step(actions[-1])
      assert isinstance(reward, float) and np.isfinite(reward) and np.isfinite(obs.nodes).all()
      done = terminated or truncated
    runs.append(actions)
  assert runs[0] == runs[1], "the same seed gave different episodes"
  gym.reset(seed=seed)
  _, reward, terminated, _, _ = gym.step(gym.env.stop_action)
  assert terminated and reward == 0.0, "stop did not end the episode with reward 0"
