"""Self-play training, its command, evaluation and the learned agent.

One smoke run (the `smoke` preset, 3 iterations) is shared by the tests: the same process
reuses its suite and compiled iteration, so a second run costs no compile. The tests
check numbers that must match: the replay buffer's contents, bit-for-bit parameters after
a resume and from the same seed, returns recomputed from the plans, budgets respected.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_hardware import H100_WORK_ONLY

from agents import base as agents_base
from agents import checkpoint, gumbel, learned, partition, replay, selfplay, train
from agents.gumbel import GumbelSettings
from agents.learned import LearnedConfig
from agents.network import state_features
from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from automap_rl.workloads.suite import load_cases
from envs import core
from experiments import cli, evaluate_cmd, train_cmd

# An H100 whose collectives run where the program puts them (`Hardware.async_collectives`
# off): the tests that use it are set up on its costs, where data parallelism is the best
# expert of their small models (with overlap, FSDP's weight gathers hide and FSDP is).
SYNCHRONOUS_H100 = dataclasses.replace(H100_WORK_ONLY, async_collectives=False)

SMOKE = dataclasses.replace(train_cmd.PRESETS["smoke"], wandb="disabled", progress=False, devices=1)
# Logits closer than this are a tie: the jitted path and the step-by-step head round differently.
LOGIT_TIE = 1e-4


@functools.cache
def built(spec: str, hardware: str = "h100") -> Problem:
  """The problem of an abstract workload on the mesh `data=2,model=4` (`hardware`: "h100"
  for `H100_WORK_ONLY`, or "synchronous" for `SYNCHRONOUS_H100`), built once per process:
  the tests that search the same problem share its searchers and their compiles."""
  profile = {"h100": H100_WORK_ONLY, "synchronous": SYNCHRONOUS_H100}[hardware]
  return Problem.build(
    workloads.make_workload(spec, abstract=True).trace(), make_mesh("data=2,model=4", profile)
  )


def assert_trees_equal(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> train_cmd.TrainResult:
  """The smoke preset end to end, wandb offline (files in the run directory only)."""
  run_dir = tmp_path_factory.mktemp("smoke")
  return train_cmd.run(dataclasses.replace(SMOKE, run_dir=str(run_dir), wandb="offline"))


def test_replay_buffer_keeps_the_valid_samples_in_a_ring():
  buffer = replay.empty(jnp.float32(0.0), capacity=4)
  buffer = replay.add(buffer, jnp.arange(1.0, 4.0), jnp.array([True, False, True]))
  np.testing.assert_array_equal(buffer.items, [1.0, 3.0, 0.0, 0.0])
  assert int(buffer.size) == 2 and int(buffer.position) == 2
  buffer = replay.add(buffer, jnp.arange(10.0, 13.0), jnp.ones(3, bool))
  np.testing.assert_array_equal(
    buffer.items, [12.0, 3.0, 10.0, 11.0]
  )  # The oldest (1.0) was overwritten.
  assert int(buffer.size) == 4 and int(buffer.position) == 1
  drawn = replay.sample(
    replay.add(replay.empty(jnp.float32(0.0), 8), jnp.array([5.0, 6.0]), jnp.ones(2, bool)),
    jax.random.key(0),
    64,
  )
  assert set(np.asarray(drawn).tolist()) == {5.0, 6.0}  # Only filled slots are drawn.


def test_smoke_preset_end_to_end(smoke_run):
  run_dir = smoke_run.run_dir
  config = SMOKE.train
  rows = [json.loads(line) for line in open(os.path.join(run_dir, train_cmd.METRICS_FILE))]
  assert [r["iteration"] for r in rows] == [1, 2, 3]
  assert rows == smoke_run.metrics
  # Every live step of every episode went into the buffer (capacity not reached).
  steps = np.cumsum([r["steps"] * config.episodes for r in rows])
  np.testing.assert_allclose([r["buffer"] for r in rows], steps)
  assert int(smoke_run.state.buffer.size) == steps[-1] and int(smoke_run.state.iteration) == 3
  for r in rows:
    assert 0.0 <= r["beats_expert"] <= 1.0 and 1 <= r["steps"] <= config.episode_length
    assert np.isfinite([r["loss"], r["policy_kl"], r["value_loss"], r["score"]]).all()
  assert os.path.getsize(os.path.join(run_dir, train_cmd.CURVE_FILE)) > 0
  assert os.path.isdir(os.path.join(run_dir, "wandb"))
  assert sorted(os.listdir(os.path.join(run_dir, checkpoint.CHECKPOINTS_DIR)))[-1] == "3"
  # The exported policy is the final parameters.
  network, params = learned.load_policy(run_dir, *_tables_and_root())
  assert network.config == config.network
  assert_trees_equal(params, smoke_run.state.params)
  # Orbax's commit marker is rewritten without the run directory's absolute path.
  with open(
    os.path.join(run_dir, checkpoint.POLICY_DIR, checkpoint.PARAMS_DIR, checkpoint.COMMIT_FILE)
  ) as f:
    assert f.read() == checkpoint.COMMIT_TEXT


def test_partition_command_searches_with_the_policy_it_is_given(smoke_run, tmp_path):
  out = tmp_path / "plan.json"
  assert (
    cli.main(
      [
        "partition",
        "gpt:layers=1",
        "--mesh",
        "data=2,model=4",
        "--agent",
        "learned",
        "--checkpoint",
        smoke_run.run_dir,
        "--budget",
        "16",
        "--seed",
        "1",
        "--no-progress",
        "--json",
        str(out),
      ]
    )
    == 0
  )
  result = json.load(open(out))
  assert result["checkpoint"] == checkpoint.policy_dir(smoke_run.run_dir)
  w = workloads.make_workload("gpt:layers=1", abstract=True)
  plan = partition(
    w.step,
    *w.args,
    mesh="data=2,model=4",
    hardware="h100",
    agent="learned",
    budget=16,
    seed=1,
    arg_names=w.arg_names,
    arg_roles=w.arg_roles,
    config=LearnedConfig(checkpoint=smoke_run.run_dir),
  )
  assert result["decisions"] == [str(d) for d in plan.decisions]
  assert result["step_time_s"] == pytest.approx(float(plan.cost.step_time), rel=1e-6)


def test_a_run_from_a_policy_starts_from_its_parameters(smoke_run):
  """Fine-tuning: the policy's parameters, bit for bit; the fresh state's optimizer, buffer and
  key."""
  fresh = train.replicate(train.init(SMOKE.train, smoke_suite()), train.data_mesh(1))
  tuned = train_cmd.from_policy(fresh, smoke_run.run_dir)
  assert_trees_equal(tuned.params, smoke_run.state.params)
  assert_trees_equal(
    (tuned.opt_state, tuned.buffer, tuned.key), (fresh.opt_state, fresh.buffer, fresh.key)
  )


@functools.cache
def smoke_suite() -> selfplay.Suite:
  """The smoke preset's suite (built once per process)."""
  problems = tuple(
    selfplay.case_problem(c) for c in train_cmd.pick_cases(load_cases(SMOKE.split), SMOKE.max_cases)
  )
  return selfplay.build_suite(problems, SMOKE.train.env)


def _tables_and_root():
  suite = smoke_suite()
  return jax.tree.map(lambda x: x[0], suite.tables), jax.tree.map(lambda x: x[0], suite.roots)


@pytest.mark.slow
def test_returns_are_log_best_expert_over_plan():
  problems = [
    selfplay.case_problem(c) for c in train_cmd.pick_cases(load_cases(SMOKE.split), SMOKE.max_cases)
  ]
  suite = smoke_suite()
  for p, problem in enumerate(problems):  # The best expert, recomputed from the simulator's costs:
    costs = [
      problem.cost(plan) for plan in tactics.applicable(problem).values()
    ]  # the fastest that fits,
    fitting = [c for c in costs if bool(c.fits)]  # else the one with the least memory.
    c = (
      min(fitting, key=lambda c: float(c.step_time))
      if fitting
      else min(costs, key=lambda c: float(c.peak_memory))
    )
    base = float(problem.cost([]).step_time)
    want = (
      float(c.step_time)
      * (1 + max(float(c.peak_memory) / float(problem.tables.hbm_bytes) - 1, 0))
      / base
    )
    np.testing.assert_allclose(float(suite.best[p]), want, rtol=1e-5)
  state = train.init(SMOKE.train, suite)
  problems_ids = jnp.arange(2, dtype=jnp.int32)
  episodes = jax.jit(selfplay.play, static_argnums=(5, 6))(
    state.params,
    suite,
    problems_ids,
    jnp.zeros(2, bool),
    selfplay.episode_keys(jax.random.key(3), 4, 2),
    SMOKE.train.search,
    SMOKE.train.env,
  )
  # Value targets: the log-objective still to gain; the earned part plus it is the return.
  objective = np.exp(np.asarray(episodes.samples.value) + np.log(np.asarray(episodes.final))[None])
  np.testing.assert_allclose(objective[0], 1.0, rtol=1e-5)  # Every episode starts replicated.
  score = np.asarray(selfplay.score(suite, problems_ids, episodes.final))
  # A difference of two float32 logs of about 0.4, each within an ulp (3e-8) of numpy's:
  # near 0 (a plan close to the best expert's) only an absolute tolerance holds.
  np.testing.assert_allclose(
    score, np.log(np.asarray(suite.best)) - np.log(np.asarray(episodes.final)), rtol=1e-6, atol=1e-6
  )
  np.testing.assert_allclose(np.asarray(episodes.samples.policy).sum(-1), 1.0, rtol=1e-5)


@functools.cache
def suite_with_an_expert_start() -> selfplay.Suite:
  """The smoke cases and a 2-layer GPT, whose best experts are data parallelism (two class
  decisions), in one suite (tables padded to the largest program)."""
  gpt = Problem.build(
    workloads.make_workload("gpt:layers=2", abstract=True).trace(),
    make_mesh("data=2,model=2", SYNCHRONOUS_H100),
  )
  assert tactics.best_expert_plan(gpt).name == "data_parallel"
  smoke = [
    selfplay.case_problem(c) for c in train_cmd.pick_cases(load_cases(SMOKE.split), SMOKE.max_cases)
  ]
  return selfplay.build_suite((*smoke, gpt), SMOKE.train.env, expert_starts=True)


def test_expert_starts_are_the_best_expert_plans_and_every_other_sweep_plays_from_them():
  suite = suite_with_an_expert_start()
  # The expert start is the best expert's plan, the yardstick: its objective is `best`.
  np.testing.assert_allclose(
    np.asarray(suite.expert_roots.objective), np.asarray(suite.best), rtol=1e-6
  )
  np.testing.assert_array_equal(suite.expert_roots.num_decisions, [2] * suite.size)
  assert float(suite.best[-1]) < 0.9 and not np.asarray(suite.expert_roots.terminated).any()
  assert_trees_equal(
    smoke_suite().expert_roots, smoke_suite().roots
  )  # Built without expert starts.
  # Every second sweep over the suite starts from the expert plans: over two sweeps each
  # problem is played once from each start, whatever B and P.
  for episodes_, size in ((4, 6), (8, 60), (3, 2)):
    config = dataclasses.replace(SMOKE.train, episodes=episodes_, expert_start_every=2)
    starts = [
      episode_start
      for i in range(2 * size)
      for episode_start in zip(*map(np.asarray, train.episode_starts(config, jnp.int32(i), size)))
    ][: 2 * size]
    assert sorted((int(p), bool(e)) for p, e in starts) == sorted(
      (p, e) for p in range(size) for e in (False, True)
    )
    assert not any(e for _, e in starts[:size])
  never = train.episode_starts(SMOKE.train, jnp.int32(5), 2)[1]
  assert not np.asarray(never).any()


@pytest.mark.slow
def test_an_episode_from_the_expert_start_begins_at_the_experts_plan():
  suite = suite_with_an_expert_start()
  state = train.init(SMOKE.train, suite)
  problems = jnp.full(2, suite.size - 1, jnp.int32)
  episodes = jax.jit(selfplay.play, static_argnums=(5, 6))(
    state.params,
    suite,
    problems,
    jnp.array([False, True]),
    selfplay.episode_keys(jax.random.key(3), 4, 2),
    SMOKE.train.search,
    SMOKE.train.env,
  )
  # Each episode's first sample holds its start's objective (value target + final plan's).
  first = np.exp(np.asarray(episodes.samples.value[0]) + np.log(np.asarray(episodes.final)))
  np.testing.assert_allclose(first, [1.0, float(suite.best[-1])], rtol=1e-5)


@pytest.mark.slow
def test_resume_is_bit_for_bit_and_the_seed_fixes_everything(smoke_run, tmp_path):
  config = dataclasses.replace(SMOKE, run_dir=str(tmp_path / "resumed"))
  stopped = train_cmd.run(dataclasses.replace(config, iterations=2))
  assert int(stopped.state.iteration) == 2
  # Same seed, same first iterations (everything but the clock).
  strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
  assert strip(stopped.metrics) == strip(smoke_run.metrics[:2])
  resumed = train_cmd.run(config)  # Restores iteration 2 and runs the third.
  assert int(resumed.state.iteration) == 3
  assert strip(resumed.metrics) == strip(smoke_run.metrics)
  assert_trees_equal(resumed.state, smoke_run.state)  # Parameters, optimizer, buffer, key.
  fresh, other = (
    train.init(SMOKE.train, smoke_suite()),
    train.init(dataclasses.replace(SMOKE.train, seed=1), smoke_suite()),
  )
  assert_trees_equal(fresh, train.init(SMOKE.train, smoke_suite()))
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(fresh.params), jax.tree.leaves(other.params))
  )


@pytest.mark.slow
def test_evaluate_on_a_tiny_split(smoke_run, tmp_path):
  config = evaluate_cmd.EvaluateConfig(
    checkpoint=smoke_run.run_dir,
    split="smoke",
    max_cases=1,
    search_budgets=(4,),
    baseline_budget=8,
    ilp_seconds=0,
    json=str(tmp_path / "eval.json"),
    plot=str(tmp_path / "eval.png"),
    progress=False,
  )
  document = evaluate_cmd.run(config)
  assert json.load(open(config.json))["summary"] == document["summary"]
  assert os.path.getsize(config.plot) > 0
  (case,) = document["cases"]
  problem = selfplay.case_problem(load_cases("smoke")[0])
  assert case["case"] == load_cases("smoke")[0].name
  # The best expert's objective relative to the replicated plan (every expert fits on
  # gpt-tiny, so no memory penalty). (The greedy policy may stop at once: no simulation.)
  base = float(problem.cost([]).step_time)
  experts = [problem.cost(plan) for plan in tactics.applicable(problem).values()]
  assert all(bool(c.fits) for c in experts)
  assert case["best_expert_objective"] == pytest.approx(
    min(float(c.step_time) for c in experts) / base, rel=1e-5
  )
  budgets = {"learned": 8, "learned+gumbel@4": 4, "gumbel@4": 4, "mcts@8": 8, "random@8": 8}
  equal_time = {
    f"{agent}@=learned+gumbel@4{call}"
    for agent in ("mcts", "random")
    for call in ("", ", compiled")
  }
  assert set(case["methods"]) == set(budgets) | equal_time  # Equal-time methods: a seconds budget.
  for name, figures in case["methods"].items():
    assert name == "learned" or figures["simulations"] > 0
    assert name in equal_time or figures["simulations"] <= budgets[name]
    assert figures["ratio"] == pytest.approx(figures["objective"] / case["best_expert_objective"])
    assert (
      figures["objective"] <= 1.0 + 1e-6
    )  # The replicated start is a candidate of every method.
    assert figures["step_time_s"] == pytest.approx(
      figures["objective"] * base, rel=1e-4
    )  # Fits: no penalty.
    # The anytime trace: the replicated plan first, the method's plan at its end, never worse on the
    # way.
    curve = evaluate_cmd.ratio_at(case, name, np.array([0.0, figures["seconds"] + 1.0]))
    assert curve[0] == pytest.approx(1.0 / case["best_expert_objective"])
    assert curve[1] == pytest.approx(figures["ratio"], rel=1e-6) and curve[1] <= curve[0] * (
      1 + 1e-6
    )
  for name, summary in document["summary"].items():
    assert summary["median_ratio"] == pytest.approx(case["methods"][name]["ratio"])
    start = case["methods"][name]["start"]
    assert summary["from_expert"] == (start is not None) and (
      start is None or name.startswith("learned")
    )


@pytest.mark.slow
def test_learned_agent_partitions_a_workload(smoke_run):
  w = workloads.make_workload("gpt:layers=1", abstract=True)
  config = LearnedConfig(checkpoint=smoke_run.run_dir, gumbel=GumbelSettings(num_simulations=8))
  kwargs = dict(
    mesh="data=2,model=4",
    hardware="h100",
    agent="learned",
    budget=24,
    seed=4,
    arg_names=w.arg_names,
    arg_roles=w.arg_roles,
    config=config,
  )
  plan = partition(w.step, *w.args, **kwargs)
  again = partition(w.step, *w.args, **kwargs)
  assert plan.decisions == again.decisions
  assert 0 < plan.search.simulations <= 24
  problem = Problem.build(w.trace(), plan.problem.mesh)
  assert float(plan.cost.step_time) == pytest.approx(
    float(problem.cost(plan.decisions).step_time), rel=1e-4
  )
  assert plan.search.objective <= 1.0
  greedy = partition(
    w.step, *w.args, **{**kwargs, "config": dataclasses.replace(config, search=False)}
  )
  # Greedy: one plan per step along the network's argmax path, outside the budget; the best plan on
  # it kept.
  assert (
    greedy.search.simulations == 0 and len(greedy.search.action_ids) <= greedy.search.greedy_steps
  )
  # With search, the greedy path is followed first (greedy_first): its plans are candidates.
  assert plan.search.objective <= greedy.search.objective + 1e-6


def test_no_budget_gives_a_worse_plan_than_the_greedy_path():
  """The shipped policy's greedy path always completes, outside the budget: even a budget
  of one simulation ends at least as well, and the search never spends more than its budget."""
  problem = built("gpt:layers=2")
  greedy = learned.search(problem, LearnedConfig(search=False), seed=0, budget=1)
  assert (
    greedy.simulations == 0
    and greedy.greedy_steps > 1
    and greedy.greedy_steps >= len(greedy.action_ids)
  )
  for budget in (1, 16):
    result = learned.search(
      problem, LearnedConfig(gumbel=GumbelSettings(num_simulations=8)), seed=0, budget=budget
    )
    assert result.greedy_steps == greedy.greedy_steps and result.simulations <= budget
    assert result.objective <= greedy.objective * (1 + 1e-6)


def test_a_greedy_path_is_the_networks_most_likely_action_step_by_step():
  """`learned.greedy_path` (one while loop) takes the actions and reaches the plans that
  stepping the environment with the network's most likely action reaches, from the
  replicated plan with pipeline options, its first action forced or the network's, and its
  second the network's third most likely (`rank`) (on this GPT the network stops only
  where the episode ends; T5-small's paths below go on)."""
  problem = built("gpt:layers=4,scan=true")
  network = learned.load_network(None)
  search, _, _ = agents_base.start(problem, "groups", 256, 1, None, network.config.pipelines)
  env = search.env
  network, params = learned.load_policy(None, env.tables, search.root)
  embeddings = gumbel.encode(network, params, env.tables, search.root)
  head = jax.jit(
    lambda state: network.head(params, embeddings, state_features(env.tables, state))[0]
  )
  step = jax.jit(functools.partial(core.step, env.config, env.tables))
  options = search.legal(search.root)
  assert len(options) > 1  # The root's actions are the pipeline options.
  for first, rank in ((-1, 0), (int(options[-1]), 0), (int(options[0]), 2)):
    path = jax.device_get(
      learned.greedy_path(
        network,
        env.config,
        params,
        embeddings,
        env.tables,
        search.root,
        jnp.int32(first),
        jnp.int32(rank),
        jnp.int32(0),
      )
    )
    state, actions, objectives = search.root, [], []
    while not (bool(state.terminated) or bool(state.truncated)):
      action = int(path.actions[len(actions)])  # -1 where the path stopped: the stop action.
      action = env.stop_action if action < 0 else action
      logits = np.asarray(head(state))
      if (
        rank and len(actions) == 1
      ):  # The rank-th most likely action other than stop (0: the most likely).
        others = np.sort(
          logits[np.asarray(state.legal_action_mask) & (np.arange(len(logits)) != env.stop_action)]
        )[::-1]
        assert action != env.stop_action and abs(logits[action] - others[rank]) <= LOGIT_TIE, (
          action,
          others[:4],
        )
      elif actions or first < 0:
        # The path's action is the most likely one here; the loop and the step-by-step
        # head may order logits tied to float rounding differently.
        assert logits[action] >= logits.max() - LOGIT_TIE, (
          len(actions),
          action,
          int(logits.argmax()),
        )
      state = step(state, jnp.int32(action))
      if action == env.stop_action:
        break
      actions.append(action)
      objectives.append(float(state.objective))
    assert len(actions) > 2 and path.actions.tolist() == actions + [-1] * (
      len(path.actions) - len(actions)
    )
    np.testing.assert_allclose(path.objective[: len(actions)], objectives, rtol=1e-6)
  assert path.actions[0] == first


def test_a_greedy_path_goes_on_past_the_networks_stop(monkeypatch):
  """On T5-small the shipped policy stops where its next actions still improve the plan:
  the greedy paths that go on past the network's stop (the default) take more steps and
  end at a better plan than those that stop there; a search starts where the paths found
  their best plans before going on, so with a budget the going on only adds candidates."""
  problem = built("t5:size=small")
  stops = learned.search(problem, LearnedConfig(search=False, past_stop=0), seed=0, budget=1)
  goes_on = learned.search(problem, LearnedConfig(search=False), seed=0, budget=1)
  assert goes_on.greedy_steps > stops.greedy_steps
  assert goes_on.objective < stops.objective * (1 - 1e-2)
  starts = {}
  for past_stop in (0, LearnedConfig.past_stop):
    monkeypatch.setattr(
      gumbel, "play", lambda given, *_, k=past_stop: starts.setdefault(k, list(given))
    )
    learned.search(problem, LearnedConfig(past_stop=past_stop), seed=0, budget=16)
  assert [s.actions for s in starts[0]] == [s.actions for s in starts[LearnedConfig.past_stop]]
  with pytest.raises(ValueError, match="past_stop=-1"):
    LearnedConfig(past_stop=-1)


def test_greedy_paths_from_the_networks_next_likeliest_decisions_reach_plans_its_own_misses():
  """On this U-Net the network's own greedy paths end at `data_parallel`'s plan; the paths
  that begin with its 2nd to 4th most likely decision (`first_moves`, outside the budget
  as every greedy path) go on from there to a plan 0.73x as costly."""
  problem = built("unet:size=ddpm-cifar10", "synchronous")
  own = learned.search(problem, LearnedConfig(search=False, first_moves=1), seed=0, budget=1)
  more = learned.search(problem, LearnedConfig(search=False), seed=0, budget=1)
  assert own.start == more.start == "data_parallel" and own.action_ids == ()
  assert more.greedy_steps > 2 * own.greedy_steps and more.simulations == 0
  assert more.objective < 0.8 * own.objective and len(more.action_ids) >= 1
  with pytest.raises(ValueError, match="first_moves=0"):
    LearnedConfig(first_moves=0)


def test_the_learned_agent_refines_the_best_experts_plan():
  """From the best expert's plan as well as the replicated one, the learned agent ends no
  worse than that plan or the greedy path from the replicated one (on this U-Net, a family
  the policy was not trained on, that path stays at the replicated plan, 1.4x the expert's
  data parallelism, so the plan comes from the expert's), starts with the expert's
  decisions and is priced as the simulator prices the whole plan."""
  problem = built("unet:size=ddpm-cifar10", "synchronous")
  expert = tactics.best_expert_plan(problem)
  assert expert.fits
  expert_objective = agents_base.plan_objective(problem, expert.cost)
  alone = learned.search(problem, LearnedConfig(search=False, from_expert=False), seed=0, budget=16)
  assert alone.start is None
  for search in (False, True):
    config = LearnedConfig(search=search, gumbel=GumbelSettings(num_simulations=8))
    result = learned.search(problem, config, seed=0, budget=16)
    assert result.objective <= min(expert_objective, alone.objective) * (1 + 1e-5)
    assert result.objective == pytest.approx(
      agents_base.plan_objective(problem, result.cost), rel=1e-5
    )
    assert result.step_time == pytest.approx(
      float(problem.cost(result.decisions).step_time), rel=1e-5
    )
    assert result.actions[0] == f"start from the {expert.name} plan"
    assert tuple(result.decisions[: len(expert.decisions)]) == expert.decisions
    assert result.start == expert.name  # The path from the expert's plan is the better.


def test_an_expert_plan_too_large_to_search_from_is_still_the_learned_agents_candidate():
  """With an environment that holds fewer class decisions than the best expert's plan takes,
  no path starts there, but the plan is offered: the result is no worse than it (on this
  U-Net the network's own greedy path from the replicated plan, `first_moves=1`, is 1.4x
  worse, so it is the expert's)."""
  problem = built("unet:size=ddpm-cifar10")
  expert = tactics.best_expert_plan(problem)
  capacity = len(problem.encode(list(expert.decisions))[0]) - 1
  config = LearnedConfig(search=False, max_decisions=capacity, first_moves=1)
  assert (
    agents_base.start(problem, config.action_space, capacity, 16, None)[0].rooted_at(
      expert.name, expert.decisions, expert.cost
    )
    is None
  )
  result = learned.search(problem, config, seed=0, budget=16)
  assert result.start == expert.name and result.decisions == list(expert.decisions)
  assert result.actions == [f"start from the {expert.name} plan"]
  assert result.objective == pytest.approx(
    agents_base.plan_objective(problem, expert.cost), rel=1e-6
  )


def test_the_learned_search_starts_where_the_greedy_paths_found_their_best_plans(monkeypatch):
  """The budget is spent below the best plans of the greedy paths (from the replicated plan
  and each expert's), the best first: on a small GPT the best is two actions down the path
  from the replicated plan."""
  problem = built("gpt:layers=2")
  greedy = learned.search(problem, LearnedConfig(search=False), seed=0, budget=16)
  assert greedy.start is None and len(greedy.action_ids) == 2
  for count in (1, 3):
    starts = []
    monkeypatch.setattr(gumbel, "play", lambda given, *_: starts.extend(given))
    learned.search(problem, LearnedConfig(search_starts=count), seed=0, budget=16)
    assert len(starts) == count
    assert starts[0].searcher.start is None and starts[0].actions == greedy.action_ids
    assert float(starts[0].state.objective) == pytest.approx(greedy.objective, rel=1e-6)
    objectives = [float(s.state.objective) for s in starts]
    assert objectives == sorted(objectives)
  with pytest.raises(ValueError, match="search_starts=0"):
    LearnedConfig(search_starts=0)


def test_the_learned_search_compiles_once_while_the_greedy_paths_run():
  """The search is compiled in the background (`gumbel.compile_ahead`, on placeholder
  embeddings) while the greedy paths run, and the budget's searches reuse that compile: one
  executable of the search per problem and number of starts."""
  problem = built("gpt:layers=2")
  agents_base.release()
  result = learned.search(
    problem, LearnedConfig(gumbel=GumbelSettings(num_simulations=8)), seed=0, budget=32
  )
  assert result.simulations > 8  # More than one search ran.
  assert gumbel._search_step.jitted()._cache_size() == 1


@pytest.mark.slow
def test_shipped_policy_partitions_from_the_command_line(tmp_path):
  shipped = learned.policy_path(None)
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(shipped) for f in files)
  assert size <= 10 * 2**20
  with open(os.path.join(shipped, checkpoint.PARAMS_DIR, checkpoint.COMMIT_FILE)) as f:
    assert f.read() == checkpoint.COMMIT_TEXT  # No path of the machine that trained it.
  out = tmp_path / "plan.json"
  assert (
    cli.main(
      [
        "partition",
        "gpt:layers=1",
        "--mesh",
        "data=2,model=4",
        "--agent",
        "learned",
        "--budget",
        "16",
        "--seed",
        "1",
        "--no-progress",
        "--json",
        str(out),
      ]
    )
    == 0
  )
  result = json.load(open(out))
  assert result["agent"] == "learned" and 0 < result["simulations"] <= 16
  # Its first action is one of the pipeline options it was trained with, or the start from
  # an expert's plan, whose decisions then come first; the rest are decisions.
  first, rest = result["actions"][0], result["actions"][1:]
  if first.startswith("start from the "):
    assert first.removeprefix("start from the ").removesuffix(" plan") in result["baselines"]
    assert len(result["decisions"]) > len(rest)
  else:
    assert result.get("pipeline") is not None or first == "no pipeline"
    assert len(result["decisions"]) == len(rest)
  assert all(a.startswith("shard ") for a in rest)
  assert result["step_time_s"] <= result["baselines"]["replicated"]["step_time_s"] * (1 + 1e-6)


def test_train_command_presets_and_bad_input(capsys):
  config = cli.parse(
    "train", ["--preset", "smoke", "--train.network.width", "8", "--iterations", "5"]
  )
  assert config.train.network.width == 8 and config.iterations == 5
  assert config.train.episodes == SMOKE.train.episodes and config.split == "smoke"
  assert cli.parse("train", []).preset == "small"
  assert cli.main(["train", "--preset", "huge"]) == 2
  assert cli.main(["evaluate", "--checkpoint", "/nonexistent/run"]) == 2
  shipped = learned.policy_path(None)  # Width 64: not the smoke preset's network.
  assert (
    cli.main(
      ["train", "--preset", "smoke", "--run-dir", "/nonexistent/run", "--init-policy", shipped]
    )
    == 2
  )
  assert (
    cli.main(
      [
        "train",
        "--preset",
        "smoke",
        "--run-dir",
        "/nonexistent/run",
        "--train.expert-start-every",
        "-1",
      ]
    )
    == 2
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 4 and all(line.startswith("automap-rl ") and "error:" in line for line in err)
  assert "no policy checkpoint" in err[1]
  assert (
    f"--init-policy {shipped}: its network" in err[2] and "--train.expert-start-every -1" in err[3]
  )
  assert not os.path.exists("/nonexistent/run")


def test_a_run_directory_is_resumed_only_with_its_training_config(tmp_path):
  """A run directory refuses another --train config, and reads a field its config.json
  lacks (written before the field existed) as the field's default."""
  config = dataclasses.replace(SMOKE, run_dir=str(tmp_path))
  train_cmd._prepare_dir(config)
  path = tmp_path / train_cmd.CONFIG_FILE
  written = json.loads(path.read_text())
  del written["train"]["expert_start_every"]
  path.write_text(json.dumps(written))
  train_cmd._prepare_dir(config)
  with pytest.raises(ValueError, match="holds a run with another --train config"):
    train_cmd._prepare_dir(
      dataclasses.replace(config, train=dataclasses.replace(config.train, expert_start_every=2))
    )


def test_evaluate_without_baselines_runs_the_learned_methods_alone():
  config = cli.parse("evaluate", ["--no-baselines", "--search-budgets", "4", "16"])
  assert set(evaluate_cmd.methods(config)) == {"learned", "learned+gumbel@4", "learned+gumbel@16"}
  assert evaluate_cmd.timed_methods(config) == {}
  with_baselines = dataclasses.replace(config, baselines=True)
  assert set(evaluate_cmd.methods(with_baselines)) == {
    "learned",
    "learned+gumbel@4",
    "learned+gumbel@16",
    "gumbel@4",
    "gumbel@16",
    "mcts@2000",
    "random@2000",
    "ilp@20s",
  }
  assert set(evaluate_cmd.timed_methods(with_baselines)) == {
    "mcts@=learned+gumbel@16",
    "random@=learned+gumbel@16",
  }


def test_equal_time_methods_get_the_seconds_the_reference_took():
  """UCT and random at equal time: each is given, as its seconds budget, the wall clock the
  reference learned search took on the case, on its first call and again compiled, and the
  share of cases the reference wins is counted against each. Every method's first call
  finds no environment built: none inherits another's compiles."""
  import time

  from agents.base import searcher
  from agents.registry import run_agent

  problem = selfplay.case_problem(load_cases("smoke")[0])
  given, built = [], []

  def reference(p):
    built.append(searcher.cache_info().currsize)
    time.sleep(0.3 if len(built) == 1 else 0.0)  # The first call compiles.
    return run_agent("random", p, 0, 4)

  def timed(p, seconds):
    built.append(searcher.cache_info().currsize)
    given.append(seconds)
    return run_agent("random", p, 0, 1)

  def other(p):
    built.append(searcher.cache_info().currsize)
    return run_agent("random", p, 0, 1)

  case = evaluate_cmd.evaluate_case(
    "gpt-tiny", "gpt", problem, {"ref": reference, "other": other}, {"random@=ref": timed}, "ref"
  )
  ref = case["methods"]["ref"]
  assert given == [ref["seconds"], ref["compiled_seconds"]] and ref["seconds"] >= 0.3
  # The reference first, then the timed methods; first calls after a release, the compiled
  # ones, each right after its first, reuse it.
  assert built == [0, 1, 0, 1, 0]
  wins = evaluate_cmd.equal_time_wins([case], "ref")
  better = {
    m: ref["objective"] < case["methods"][m]["objective"] * (1 - 1e-6)
    for m in ("random@=ref", "random@=ref, compiled")
  }
  assert wins == {m: float(b) for m, b in better.items()}
  assert set(evaluate_cmd.summarize([case])["ref"]) >= {"median_seconds", "median_compiled_seconds"}
