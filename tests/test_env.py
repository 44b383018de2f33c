"""The partitioning environment: purity, exact masks, rewards, batching, the wrapper."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automap_rl import mesh as mesh_lib
from automap_rl import sharding, workloads
from automap_rl.problem import Problem
from envs import Env, EnvConfig, core, observe, programs, tables, testing
from envs.bench import random_actions
from envs.gym import GymEnv

# Rewards are differences of float32 sums over ~10^3 ops, which jit reassociates: they
# agree to ~1e-6 of the replicated objective, not to the last ulp.
TOL = 1e-5


@functools.cache
def problem(model: str, mesh: str = "data=2,model=4") -> Problem:
  return Problem.build(
    workloads.make_workload(model, abstract=True).trace(), mesh_lib.make_mesh(mesh, "h100")
  )


def random_episode(env: Env, seed: int, step=None, limit: int = 1000):
  """States of a random episode that stops with probability 0.05 per step."""
  step = step or env.step
  rng = np.random.default_rng(seed)
  states = [env.init(jax.random.key(seed))]
  while not (states[-1].terminated or states[-1].truncated) and len(states) < limit:
    legal = np.flatnonzero(np.asarray(states[-1].legal_action_mask))
    action = env.stop_action if rng.random() < 0.05 else int(rng.choice(legal))
    states.append(step(states[-1], jnp.int32(action)))
  return states


def _mixed_batch_row(index: int) -> Env:
  """Row `index` of a padded, stacked batch of three programs, as an `Env`."""
  probs = [
    problem("mlp"),
    problem("gpt:layers=2", "data=8"),
    problem("mlp", "data=2,fsdp=2,model=2"),
  ]
  config = EnvConfig(action_space="named_dims")
  stacked, targets = programs.batch_tables(probs, config)
  return Env(config, probs[index], tuple(targets[index]), jax.tree.map(lambda x: x[index], stacked))


ENVIRONMENTS = {
  "mlp-arg_dims": lambda: Env.build(problem("mlp"), EnvConfig(action_space="arg_dims")),
  "mlp-named_dims-3-axes": lambda: Env.build(
    problem("mlp", "data=2,fsdp=2,model=2"), EnvConfig(action_space="named_dims")
  ),
  "gpt-groups": lambda: Env.build(problem("gpt:layers=2")),
  "gpt-groups-bucketed": lambda: Env.build(problem("gpt:layers=2"), bucket=True),
  "gpt-truncated": lambda: Env.build(
    problem("gpt:layers=2"), EnvConfig(action_space="named_dims", max_steps=3)
  ),
  "gpt-terminal-reward": lambda: Env.build(problem("gpt:layers=2"), EnvConfig(reward="terminal")),
  "mixed-batch-row": lambda: _mixed_batch_row(1),
}


@pytest.mark.parametrize(
  "name",
  [
    n
    if n not in ("gpt-groups-bucketed", "gpt-truncated", "gpt-terminal-reward")
    else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(ENVIRONMENTS)
  ],
)
def test_every_environment_keeps_the_contract(name):
  testing.api_test(ENVIRONMENTS[name]())


@pytest.mark.parametrize(
  "model,mesh",
  [
    pytest.param("mlp", "data=2,model=4", marks=pytest.mark.slow),
    ("gpt:layers=2", "data=2,fsdp=2,model=2"),
  ],
)
def test_padded_tables_give_the_exact_masks_and_target_features(model, mesh):
  exact = Env.build(problem(model, mesh), EnvConfig(action_space="named_dims"))
  padded = Env.build(problem(model, mesh), EnvConfig(action_space="named_dims"), bucket=True)
  real = len(exact.targets) * exact.config.max_axes
  step_exact, step_padded = jax.jit(exact.step), jax.jit(padded.step)
  observe_exact, observe_padded = jax.jit(exact.observe), jax.jit(padded.observe)
  a, b = exact.init(jax.random.key(0)), padded.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  for _ in range(6):
    np.testing.assert_array_equal(a.legal_action_mask[:real], b.legal_action_mask[:real])
    assert not b.legal_action_mask[real:-1].any()
    targets = slice(observe_exact(a).nodes.shape[0] - 1 - len(exact.targets), -1)
    padded_targets = observe_padded(b).nodes
    start = padded_targets.shape[0] - 1 - padded.tables.target_classes.shape[0]
    np.testing.assert_allclose(
      observe_exact(a).nodes[targets], padded_targets[start : start + len(exact.targets)], atol=1e-6
    )
    legal = np.flatnonzero(np.asarray(a.legal_action_mask)[:-1])
    if not len(legal):
      break
    action = jnp.int32(rng.choice(legal))
    a, b = step_exact(a, action), step_padded(b, action)


def test_the_gym_wrapper_keeps_its_contract():
  testing.gym_api_test(GymEnv(Env.build(problem("gpt:layers=2"))))


def test_the_contract_catches_a_terminal_state_that_moves():
  env = Env.build(problem("mlp"))

  def leaky_step(state, action):
    moved = env.step(state, action)
    return moved.replace(reward=jnp.where(state.terminated, 1.0, moved.reward).astype(jnp.float32))

  broken = dataclasses.replace(env)
  object.__setattr__(broken, "step", leaky_step)
  with pytest.raises(AssertionError, match="terminal state rewarded"):
    testing.api_test(broken, num_episodes=1)


@pytest.mark.parametrize(
  "model,space",
  [
    ("mlp", "arg_dims"),
    ("mlp", "groups"),
    ("gpt:layers=2", "groups"),
    ("gpt:layers=2", "named_dims"),
  ],
)
def test_mask_is_exact_and_resolution_incremental(model, space):
  """Legal iff appending the action's decisions changes the resolution and fits (brute force)."""
  prob = problem(model)
  env = Env.build(prob, EnvConfig(action_space=space, max_decisions=12))
  resolve = jax.jit(prob.resolve)
  x = env.config.max_axes
  states = [s for s in random_episode(env, 1, jax.jit(env.step)) if not s.terminated]
  for state in states[:5]:
    now = resolve(state.dec_class, state.dec_axis)
    np.testing.assert_array_equal(state.value_mask, now.value_mask)
    np.testing.assert_array_equal(state.op_mask, now.op_mask)
    n = int(state.num_decisions)
    for action in range(env.num_actions - 1):
      t, a = divmod(action, x)
      classes = env.targets[t].classes
      legal = bool(state.legal_action_mask[action])
      if a >= len(prob.mesh.axis_names) or n + len(classes) > env.config.max_decisions:
        assert not legal, env.action_name(action)
        continue
      dec_class, dec_axis = np.asarray(state.dec_class).copy(), np.asarray(state.dec_axis).copy()
      dec_class[n : n + len(classes)], dec_axis[n : n + len(classes)] = classes, a
      after = resolve(dec_class, dec_axis)
      changed = bool(
        (after.value_mask != now.value_mask).any() | (after.op_mask != now.op_mask).any()
      )
      assert legal == changed, env.action_name(action)
    assert state.legal_action_mask[-1]


@pytest.mark.parametrize("model,space", [("mlp", "groups"), ("gpt:layers=2", "named_dims")])
def test_a_plan_made_elsewhere_is_the_state_its_decisions_reach(model, space):
  """`from_plan` of a state's decisions, their resolution and their cost gives that state, at every
  step
  of random episodes: a search from an expert's plan starts where its actions would."""
  prob = problem(model)
  env = Env.build(prob, EnvConfig(action_space=space, max_decisions=24))
  made = jax.jit(functools.partial(core.from_plan, env.config, env.tables))
  resolve = jax.jit(prob.resolve)
  for seed in range(3):
    for state in random_episode(env, seed, jax.jit(env.step))[1:]:
      if not (
        bool(state.terminated) or bool(state.truncated)
      ):  # A stop ends an episode, not a plan.
        masks = resolve(state.dec_class, state.dec_axis)
        cost = prob.cost(env.decisions(state))
        testing.check_plan_state(
          made(state.dec_class, state.dec_axis, masks.value_mask, masks.op_mask, cost), state
        )


@pytest.mark.parametrize("objective", ["time", "memory", "mix"])
def test_returns_sum_to_the_simulated_improvement(objective):
  prob = problem("gpt:layers=2")
  config = EnvConfig(objective=objective, action_space="named_dims")
  env = Env.build(prob, config)
  step = jax.jit(env.step)  # One trace and compile for the three episodes.
  for seed in range(3):
    states = random_episode(env, seed, step)
    total = sum(float(s.reward) for s in states[1:])
    base, final = prob.cost([]), prob.cost(env.decisions(states[-1]))
    ref = np.array([base.step_time, base.peak_memory, 0.0], np.float32)
    raw = lambda c: float(tables.raw_objective(config, c, ref, prob.tables.hbm_bytes))
    np.testing.assert_allclose(total, 1.0 - raw(final) / raw(base), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(states[-1].step_time, final.step_time, rtol=1e-5)


@functools.cache
def _reward_modes(max_steps: int | None) -> tuple[Env, Env, object, object]:
  """The same environment with shaped and terminal rewards, and their vmapped jitted steps."""
  prob = problem("gpt:layers=2")
  envs = [
    Env.build(prob, EnvConfig(action_space="named_dims", max_steps=max_steps, reward=reward))
    for reward in ("shaped", "terminal")
  ]
  return (*envs, *(jax.jit(jax.vmap(env.step)) for env in envs))


@settings(
  max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
  picks=st.lists(st.lists(st.integers(0, 10_000), max_size=12), min_size=4, max_size=4),
  max_steps=st.sampled_from([None, 3]),
)
def test_terminal_reward_ends_where_the_shaped_one_does(picks, max_steps):
  """Random decision sequences, a batch of four at once (one compile; the terminal env
  simulates only the rows whose episode ends): the terminal env keeps the replicated figures and
  rewards
  0 until the episode ends, then reports the plan's simulated objective, step time and
  peak memory (those of the shaped env and of `Problem.cost`) and the whole return."""
  shaped, terminal, step_shaped, step_terminal = _reward_modes(max_steps)
  batch, length = len(picks), max(len(p) for p in picks)
  a = b = jax.vmap(shaped.init)(jax.random.split(jax.random.key(0), batch))
  returns = np.zeros(batch)
  for i in range(length + 1):
    legal = np.asarray(a.legal_action_mask)
    actions = np.array(
      [
        np.flatnonzero(legal[row])[p[i] % legal[row].sum()] if i < len(p) else shaped.stop_action
        for row, p in enumerate(picks)
      ],
      np.int32,
    )
    ended = np.asarray(b.terminated | b.truncated)
    a, b = step_shaped(a, actions), step_terminal(b, actions)
    returns += np.asarray(b.reward)
    np.testing.assert_array_equal(b.legal_action_mask, a.legal_action_mask)
    np.testing.assert_array_equal(b.dec_class, a.dec_class)
    now = np.asarray(b.terminated | b.truncated)
    live = ~now
    np.testing.assert_array_equal(np.asarray(b.objective)[live], 1.0)
    np.testing.assert_array_equal(np.asarray(b.reward)[live | ended], 0.0)
  assert bool((b.terminated | b.truncated).all())
  for name in ("objective", "step_time", "peak_memory"):
    np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-6, err_msg=name)
  np.testing.assert_allclose(returns, 1.0 - np.asarray(b.objective), atol=1e-6)
  for row in range(batch):
    state = jax.tree.map(lambda x, row=row: x[row], b)
    cost = shaped.problem.cost(terminal.decisions(state))
    np.testing.assert_allclose(state.step_time, cost.step_time, rtol=1e-5)
    np.testing.assert_allclose(state.peak_memory, cost.peak_memory, rtol=1e-5)


def test_batched_legal_mask_is_each_states_own():
  """Vmapped, the legal mask runs batch-last (`core._legal`): each row is the
  mask of its state computed alone, over states along random episodes."""
  env = Env.build(problem("gpt:layers=2"), EnvConfig(reward="terminal"))
  legal = functools.partial(core.legal_actions, env.tables, max_decisions=env.config.max_decisions)
  batched, alone = jax.jit(jax.vmap(legal)), jax.jit(legal)
  state = jax.vmap(env.init)(jax.random.split(jax.random.key(0), 16))
  step = jax.jit(jax.vmap(env.step))
  for i in range(6):
    masks = batched(state.value_mask, state.op_mask, state.num_decisions)
    for row in range(16):
      np.testing.assert_array_equal(
        masks[row], alone(state.value_mask[row], state.op_mask[row], state.num_decisions[row])
      )
    state = step(state, random_actions(jax.random.key(i), state.legal_action_mask))


def test_capacity_ends_episodes_and_truncation():
  env = Env.build(problem("gpt:layers=2"), EnvConfig(action_space="groups", max_decisions=4))
  states = random_episode(
    env, 0, jax.jit(env.step)
  )  # Jitted: op by op, each primitive compiles alone.
  assert int(states[-1].num_decisions) <= 4
  env = Env.build(problem("gpt:layers=2"), EnvConfig(action_space="named_dims", max_steps=2))
  state, step = jax.jit(env.init)(jax.random.key(0)), jax.jit(env.step)
  for _ in range(2):
    state = step(state, jnp.argmax(state.legal_action_mask).astype(jnp.int32))
  assert state.truncated and not state.terminated


@pytest.mark.slow
def test_mixed_batch_is_inert_padding():
  probs = [
    problem("mlp"),
    problem("gpt:layers=2", "data=8"),
    problem("mlp", "data=2,fsdp=2,model=2"),
  ]
  config = EnvConfig(action_space="named_dims")
  stacked, targets = programs.batch_tables(probs, config)
  init = jax.vmap(functools.partial(core.init, config))
  step = jax.jit(jax.vmap(functools.partial(core.step, config)))
  state = init(stacked, jax.random.split(jax.random.key(0), 3))
  for i in range(5):
    state = step(stacked, state, random_actions(jax.random.key(i), state.legal_action_mask))
  for i, prob in enumerate(probs):
    names = prob.mesh.axis_names
    decisions = [
      sharding.Decision(int(c), names[int(a)])
      for c, a in zip(state.dec_class[i], state.dec_axis[i])
      if c >= 0
    ]
    np.testing.assert_allclose(state.step_time[i], prob.cost(decisions).step_time, rtol=1e-5)
    exact = Env.build(prob, config)
    assert int(state.legal_action_mask[i].sum()) >= 1
    assert len(targets[i]) == len(exact.targets)
  graphs = jax.vmap(observe)(stacked, state)
  assert (
    graphs.nodes.shape[-1]
    == Env.build(probs[0], config)
    .observe(Env.build(probs[0], config).init(jax.random.key(0)))
    .nodes.shape[-1]
  )
  assert (
    np.isfinite(np.asarray(graphs.nodes)).all() and np.isfinite(np.asarray(graphs.globals)).all()
  )
  senders = np.asarray(graphs.senders)
  assert (senders < graphs.nodes.shape[1]).all() and (senders >= 0).all()


def test_sampler_is_seeded():
  assert programs.sample(7, 5) == programs.sample(7, 5)
  assert programs.sample(7, 5) != programs.sample(8, 5)


def _batch_arg_action(env: Env) -> int:
  """The expert: shard the first batch input's dim 0 on the first mesh axis."""
  for t, target in enumerate(env.targets):
    if target.name.startswith("batch/") and target.name.endswith(":0"):
      return t * env.config.max_axes
  raise AssertionError("no batch target")


@pytest.mark.parametrize(
  "model",
  [
    m if m in ("gpt", "unet") else pytest.param(m, marks=pytest.mark.slow)
    for m in workloads.FAMILIES
  ],
)
def test_random_and_expert_agents_on_the_zoo(model):
  env = Env.build(problem(model), EnvConfig(action_space="arg_dims"))
  gym = GymEnv(env)
  obs, info = gym.reset(seed=0)
  done, steps = False, 0
  while not done:
    action = int(gym.action_space.sample(info["action_mask"].astype(np.int8)))
    obs, reward, terminated, truncated, info = gym.step(action)
    done, steps = terminated or truncated, steps + 1
    assert np.isfinite(reward) and np.isfinite(obs.nodes).all()
  obs, info = gym.reset(seed=0)
  action = _batch_arg_action(env)
  assert info["action_mask"][action]
  _, reward, _, _, info = gym.step(action)
  _, stop_reward, terminated, _, _ = gym.step(env.stop_action)
  assert terminated and stop_reward == 0.0
  assert reward == pytest.approx(1.0 - info["objective"], abs=1e-6)
