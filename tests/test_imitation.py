"""The imitation warm start: teacher plans replayed as the environment's actions, and a
network that learns to take them."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from toy_hardware import H100_WORK_ONLY

from agents import base, imitation, selfplay, train
from agents.network import Network, static_graph
from automap_rl import tactics
from automap_rl.mesh import make_mesh
from automap_rl.plan import plan_to_json
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.workloads.suite import load_cases
from envs import Env, core
from experiments import cli, train_cmd

SMOKE = dataclasses.replace(train_cmd.PRESETS["smoke"], wandb="disabled", progress=False, devices=1)


@pytest.fixture(scope="module")
def teacher():
  """A smoke case's suite (alone) and a teacher plan of three decisions, the second of
  which the first already covers (the environment refuses it)."""
  case = load_cases("smoke")[0]
  problem = selfplay.case_problem(case)
  config = SMOKE.train
  suite = selfplay.build_suite((problem,), config.env)
  env = Env.build(problem, config.env)
  axes = problem.mesh.axis_names
  decisions = [
    Decision(env.targets[0].target, axes[-1]),
    Decision(env.targets[0].target, axes[0]),
    Decision(env.targets[-1].target, axes[0]),
  ]
  return case, problem, suite, env, decisions


def test_a_teacher_plan_replays_to_its_objective_in_the_padded_suite_and_alone(teacher):
  _, problem, suite, env, decisions = teacher
  config = SMOKE.train.env
  padded = jax.tree.map(lambda x: x[0], suite.tables)
  ids = imitation.teacher_actions(problem, config, padded, decisions, None)
  samples = imitation.teacher_samples(suite, config, [(0, ids)])
  # Alone: the unpadded tables number the pipeline options and `stop` differently.
  state, step = env.init(jax.random.key(0)), jax.jit(env.step)
  taken = []
  for action in imitation.teacher_actions(problem, config, env.tables, decisions, None):
    if bool(state.legal_action_mask[action]) and not bool(state.terminated | state.truncated):
      taken.append(env.action_name(action))
      state = step(state, action)
  assert (
    taken[0] == env.action_name(env.tables.num_moves) and taken[-1] == "stop"
  )  # No pipeline, then the plan.
  assert len(samples.problem) == len(taken) == len(ids) - 1  # The repeated target is refused.
  assert samples.value[0] == pytest.approx(
    -np.log(float(state.objective)), rel=1e-5
  )  # The root's objective is 1.
  assert samples.value[-1] == 0.0
  np.testing.assert_array_equal(samples.policy.argmax(-1), [a for a in ids if a != ids[2]])


def test_the_warm_start_learns_the_teachers_actions(teacher, tmp_path):
  case, problem, suite, env, decisions = teacher
  path = tmp_path / "known.json"
  path.write_text(json.dumps({"cases": {case.name: plan_to_json(decisions)}}))
  config = dataclasses.replace(
    SMOKE,
    imitation_updates=150,
    best_known=str(path),
    train=dataclasses.replace(SMOKE.train, learning_rate=3e-3, warmup_updates=10),
  )
  mesh = train.data_mesh(1)
  start = train.init(config.train, suite)
  state = train_cmd.warm_start(config, [case], suite, start, suite, mesh, lead=True)
  ids = imitation.teacher_actions(
    problem, config.train.env, jax.tree.map(lambda x: x[0], suite.tables), decisions, None
  )
  samples = imitation.teacher_samples(suite, config.train.env, [(0, ids)])
  network = Network(config.train.network)
  tables, root = (
    jax.tree.map(lambda x: x[0], suite.tables),
    jax.tree.map(lambda x: x[0], suite.roots),
  )

  # One compile for both parameter sets (op by op, the forward compiles each of its primitives).
  @jax.jit
  def argmax_actions(params):
    embeddings = network.encode(params, static_graph(tables, root))
    return jax.vmap(network.head, in_axes=(None, None, 0))(params, embeddings, samples.features)[
      0
    ].argmax(-1)

  def chosen(params):
    return np.asarray(argmax_actions(params))

  teacher_actions = samples.policy.argmax(-1)
  assert not np.array_equal(chosen(start.params), teacher_actions)
  np.testing.assert_array_equal(chosen(state.params), teacher_actions)
  assert int(state.iteration) == 0 and int(state.buffer.size) == len(teacher_actions)


def test_a_climb_takes_the_simulators_best_refinement_until_none_improves():
  """Each climb from an expert plan: every step's action is the legal one whose stepped
  objective is lowest, lower than the plan's; the climb stops where no legal action lowers
  the objective; the value targets are the log of the objective over the climb's end. On
  the smoke Llama, priced for its work alone, one expert plan has a refinement (on the smoke
  GPT none has)."""
  case = next(c for c in load_cases("smoke") if c.name.startswith("llama"))
  problem = Problem.build(
    case.make_workload(abstract=True).trace(), make_mesh(case.mesh, H100_WORK_ONLY)
  )
  config = SMOKE.train.env
  suite = selfplay.build_suite((problem,), config)
  tables = jax.tree.map(lambda x: x[0], suite.tables)
  stop = tables.num_actions - 1
  samples, climbs = imitation.climb_samples([problem], suite, config)
  experts = [e for e in tactics.expert_plans(problem) if e.fits and e.decisions]
  assert climbs == len(experts) > 1
  step = jax.jit(
    jax.vmap(lambda state, action: core.step(config, tables, state, action), in_axes=(None, 0))
  )
  every = np.arange(tables.num_actions)
  actions, values = samples.policy.argmax(-1), iter(samples.value)
  position = 0
  for expert in experts:
    state = base.plan_state(problem, config, tables, expert.decisions, expert.cost)
    path = []
    while True:
      children = step(state, every)
      priced = np.where(
        np.asarray(state.legal_action_mask) & (every != stop),
        np.asarray(children.objective),
        np.inf,
      )
      action = int(actions[position])
      path.append(float(state.objective))
      position += 1
      if action == stop:
        assert priced.min() >= float(state.objective) * (1 - imitation.CLIMB_TOLERANCE)
        break
      assert priced[action] == priced.min() < float(state.objective)
      state = jax.tree.map(lambda x, a=action: np.asarray(x)[a], children)
    np.testing.assert_allclose(
      [next(values) for _ in path], np.log(path) - np.log(path[-1]), rtol=1e-5, atol=1e-6
    )
  assert position == len(actions) and (actions != stop).any()


def test_a_warm_start_without_a_teacher_is_refused(tmp_path, capsys):
  path = tmp_path / "known.json"
  path.write_text(json.dumps({"cases": {}}))
  argv = [
    "train",
    "--preset",
    "smoke",
    "--run-dir",
    str(tmp_path / "run"),
    "--wandb",
    "disabled",
    "--no-progress",
    "--devices",
    "1",
    "--imitation-updates",
    "10",
  ]
  assert cli.main([*argv, "--best-known", str(tmp_path / "missing.json")]) == 2
  assert "no such file" in capsys.readouterr().err and not (tmp_path / "run").exists()
  assert cli.main([*argv, "--best-known", str(path)]) == 2
  assert "none of the 2 smoke cases has a best-known plan" in capsys.readouterr().err
  assert not (tmp_path / "run").exists()
  assert cli.main([*argv[:-2], "--imitation-climbs"]) == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert (
    "--imitation-climbs" in line
    and "--imitation-updates" in line
    and not (tmp_path / "run").exists()
  )
