"""Pipeline actions in the environment: off by default, the contract with them on, the
pipelined objective, the masked stage axis, and search choosing a pipeline."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_hardware import H100_WORK_ONLY

from agents import mcts
from agents.base import env_config, searcher
from automap_rl import workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from envs import Env, EnvConfig, core
from envs.observe import global_features, node_features
from envs.tables import objective
from envs.testing import api_test, check_plan_state

GPT = "gpt:layers=8,d_model=256,heads=8,seq=128,vocab=512,batch=32,scan=true"
MESH = "data=4,model=2"
OPTIONS = 6


@functools.cache
def problem(mesh: str = MESH) -> Problem:
  return Problem.build(
    workloads.make_workload(GPT, abstract=True).trace(), make_mesh(mesh, H100_WORK_ONLY)
  )


@functools.cache
def env(pipelines: int) -> Env:
  return Env.build(problem(), EnvConfig(max_axes=2, pipelines=pipelines))


@functools.cache
def jitted(e: Env):
  """`e`'s init, step and observe, jitted once per environment: a new `jax.jit` of a bound
  method traces, lowers and compiles it again."""
  return jax.jit(e.init), jax.jit(e.step), jax.jit(e.observe)


def random_episode(e: Env, key: jax.Array, first: int | None = None, steps: int = 6) -> list:
  """States of a random episode (`first`: its first action)."""
  init, step, _ = jitted(e)
  states = [init(key)]
  for i in range(steps):
    legal = np.flatnonzero(np.asarray(states[-1].legal_action_mask)[:-1])
    if not len(legal):
      break
    action = (
      first
      if (i == 0 and first is not None)
      else int(jax.random.choice(jax.random.fold_in(key, i), legal))
    )
    states.append(step(states[-1], jnp.int32(action)))
  return states


def test_without_pipeline_options_the_environment_is_todays():
  e = env(0)
  assert e.pipelines == () and e.tables.pipeline is None and e.num_actions == e.tables.num_moves + 1
  graph = jitted(e)[2](e.init(jax.random.key(0)))
  assert graph.nodes.shape[1] == node_features(2) and graph.globals.shape[1] == global_features(2)
  for seed in range(3):
    for state in random_episode(e, jax.random.key(seed))[1:]:
      assert int(state.pipeline) == 0
      cost = problem().cost(e.decisions(state))
      np.testing.assert_allclose(float(state.step_time), float(cost.step_time), rtol=1e-5)


def test_contract_with_pipeline_options():
  api_test(env(OPTIONS), num_episodes=2, max_steps=12, batch=3)


def test_the_first_action_chooses_a_pipeline_and_masks_its_stage_axis():
  e = env(OPTIONS)
  moves = e.tables.num_moves
  root = e.init(jax.random.key(0))
  assert int(root.pipeline) == -1
  legal = np.flatnonzero(np.asarray(root.legal_action_mask))
  np.testing.assert_array_equal(legal, [*range(moves, moves + len(e.pipelines)), e.stop_action])
  assert e.pipelines[0] is None and len(e.pipelines) > 2
  _, step, observe = jitted(e)
  graph = observe(root)
  assert graph.nodes.shape[1] == node_features(2, True) and graph.globals.shape[
    1
  ] == global_features(2, True)
  for k, pipeline in enumerate(e.pipelines):
    state = step(root, jnp.int32(moves + k))
    assert int(state.pipeline) == k and e.pipeline(state) == pipeline
    mask = np.asarray(state.legal_action_mask)
    assert not mask[moves:-1].any(), "a second pipeline action is legal"
    by_axis = mask[:moves].reshape(-1, 2)
    if pipeline is None:
      np.testing.assert_array_equal(
        mask[:moves], np.asarray(env(0).init(jax.random.key(0)).legal_action_mask)[:-1]
      )
    else:
      stage_axis = problem().mesh.axis_names.index(pipeline.axis)
      assert not by_axis[:, stage_axis].any() and by_axis[:, 1 - stage_axis].any()
      nodes = np.asarray(observe(state).nodes)
      assert nodes[:, -1].max() > 0, "the observation shows no stage membership"


def test_a_plan_made_elsewhere_chooses_no_pipeline():
  """With pipeline options, `from_plan`'s state is the one reached by choosing option 0 (no
  pipeline) and then the plan's moves."""
  e = env(OPTIONS)
  made = jax.jit(functools.partial(core.from_plan, e.config, e.tables))
  resolve = jax.jit(problem().resolve)
  for seed in range(2):
    for state in random_episode(e, jax.random.key(seed), first=e.tables.num_moves)[1:]:
      masks = resolve(state.dec_class, state.dec_axis)
      cost = problem().cost(e.decisions(state))
      check_plan_state(
        made(state.dec_class, state.dec_axis, masks.value_mask, masks.op_mask, cost), state
      )


def test_the_objective_is_the_pipelined_plan_cost():
  e = env(OPTIONS)
  config, base, hbm = e.config, np.asarray(e.tables.base), float(e.tables.cost.hbm_bytes)
  for k, pipeline in enumerate(e.pipelines):
    for seed in range(2):
      states = random_episode(e, jax.random.key(seed), first=e.tables.num_moves + k)
      for state in states[1:]:
        cost = problem().plan_cost(e.decisions(state), pipeline)
        np.testing.assert_allclose(float(state.step_time), float(cost.step_time), rtol=1e-5)
        np.testing.assert_allclose(float(state.peak_memory), float(cost.peak_memory), rtol=1e-5)
        np.testing.assert_allclose(
          float(state.objective), float(objective(config, cost, base, hbm)), rtol=1e-5
        )


def test_search_chooses_a_pipeline_where_it_pays():
  """MCTS with pipeline options on a mesh whose slow axes pay for stages: its first action
  picks a pipeline, and the result carries it, priced as the simulator prices it."""
  import agents

  p = problem("data=4,fsdp=2,model=8")
  config = mcts.MCTSConfig(pipelines=OPTIONS)
  result = agents.run_agent("mcts", p, seed=0, budget=150, config=config)
  pipeline = searcher(
    p, env_config(p, config.action_space, config.max_decisions, OPTIONS)
  ).pipeline(result.action_ids)
  assert pipeline is not None and result.pipeline == pipeline and result.actions[0] == str(pipeline)
  assert float(result.cost.step_time) == pytest.approx(
    float(p.plan_cost(result.decisions, pipeline).step_time), rel=1e-5
  )
  assert result.step_time == pytest.approx(float(result.cost.step_time), rel=1e-5)


def test_a_mixed_batch_prices_each_program_as_alone():
  """Programs with and without layer stacks, on different meshes, stacked into one
  batch with pipeline options: every state of a random episode has the objective its
  program's own environment gives it."""
  from envs import core
  from envs.programs import batch_tables

  config = EnvConfig(max_axes=3, pipelines=OPTIONS)
  problems = [
    problem(),
    Problem.build(
      workloads.make_workload("mlp", abstract=True).trace(),
      make_mesh("data=2,model=4", H100_WORK_ONLY),
    ),
  ]
  tables, _ = batch_tables(problems, config)
  init, step = (
    jax.jit(functools.partial(core.init, config)),
    jax.jit(functools.partial(core.step, config)),
  )
  for i, p in enumerate(problems):
    alone = Env.build(p, config)  # Its own tables: `alone.step` is `step` on them.
    mine = jax.tree.map(lambda x, i=i: x[i], tables)
    state, batched = init(alone.tables, jax.random.key(0)), init(mine, jax.random.key(0))
    for t in range(4):
      legal = np.flatnonzero(np.asarray(state.legal_action_mask)[:-1])
      if not len(legal):
        break
      action = (
        int(legal[-1]) if t == 0 else int(jax.random.choice(jax.random.key(10 * i + t), legal))
      )
      # Moves keep their index; the options follow the (padded) moves.
      index = (
        action
        if action < alone.tables.num_moves
        else action - alone.tables.num_moves + mine.num_moves
      )
      state, batched = (
        step(alone.tables, state, jnp.int32(action)),
        step(mine, batched, jnp.int32(index)),
      )
      assert int(batched.pipeline) == int(state.pipeline)
      np.testing.assert_allclose(float(batched.objective), float(state.objective), rtol=1e-5)
      np.testing.assert_allclose(float(batched.peak_memory), float(state.peak_memory), rtol=1e-5)


def test_only_a_scanned_stack_is_offered_a_pipeline():
  """The menu offers what the lowering runs: the scanned GPT's stack gets pipelines, the
  same GPT unrolled (its layers priced as a stack all the same) only "no pipeline"."""
  from envs.pipelines import menu

  unrolled = Problem.build(
    workloads.make_workload(GPT.replace("scan=true", "scan=false"), abstract=True).trace(),
    make_mesh(MESH, H100_WORK_ONLY),
  )
  assert unrolled.layer_stacks and not unrolled.layer_stacks[0].scanned
  assert menu(unrolled, OPTIONS) == (None,)
  assert len(menu(problem(), OPTIONS)) > 1
