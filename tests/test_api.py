"""`automap_rl.partition` end to end, and the `automap-rl partition` command with agents."""

import json
import sys
import time
import warnings

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

import agents
from automap_rl import tactics, workloads
from automap_rl.plan_pictures import shard_blocks
from experiments import cli, partition_cmd

GPT = "gpt:layers=1,d_model=32,heads=4,seq=16,vocab=64,batch=8"


def user_mlp():
  """A user function for `automap-rl partition test_api:user_mlp`."""
  w = workloads.make_workload("mlp:layers=2,width=64,in_dim=32,classes=8,batch=16", abstract=True)
  return w.step, w.args, w.arg_names, w.arg_roles


def test_partition_end_to_end_lowers_and_checks_numerics(tmp_path):
  w = workloads.make_workload(GPT)
  phases, searched = [], []
  plan = agents.partition(
    w.step,
    *w.args,
    mesh="data=2,model=4",
    hardware="h100",
    agent="mcts",
    budget=200,
    seed=0,
    arg_names=w.arg_names,
    arg_roles=w.arg_roles,
    phase=phases.append,
    progress=lambda sims, best: searched.append(sims),
  )
  assert phases == ["tracing", "building cost tables", "searching"]
  assert searched and searched[-1] == plan.search.simulations <= 200
  assert jax.tree.structure(
    plan.in_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
  ) == jax.tree.structure(w.args)
  in_shardings = plan.in_shardings
  assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(in_shardings))
  assert len(jax.tree.leaves(plan.out_shardings)) == len(
    jax.tree.leaves(jax.eval_shape(w.step, *w.args))
  )
  report = plan.report()
  for name in ("mcts", "data_parallel", "megatron", "fsdp", "data_megatron", "replicated"):
    assert name in report
  assert "devices" in plan.diagram()
  assert (tmp_path / "plan.png").exists() or plan.plot(str(tmp_path / "plan.png"))
  assert (tmp_path / "plan.png").stat().st_size > 1000
  lowered = plan.check()  # Raises NumericsError on a mismatch.
  assert lowered.compiled is not None
  assert callable(plan.jit())


@pytest.mark.slow
def test_partition_with_a_tactic_lowers_megatron():
  w = workloads.make_workload(GPT)
  plan = agents.partition(
    w.step, *w.args, agent="data_megatron", arg_names=w.arg_names, arg_roles=w.arg_roles
  )
  assert plan.in_specs[0]["block_0"]["mlp"]["fc1"]["kernel"] == PartitionSpec(None, "model")
  assert plan.in_specs[2]["inputs"] == PartitionSpec("data", None)
  plan.check()


def test_partition_traces_once_and_lowering_reuses_the_trace():
  """Search and lowering share one trace of the user's function (a Python side effect in
  it runs once); the numerics check's own reference runs are apart."""
  import jax.numpy as jnp

  traces = []

  def step(w, x):
    traces.append(1)
    loss, grad = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * grad, loss

  args = (jnp.ones((16, 8)) * 0.1, jnp.ones((32, 16)))
  plan = agents.partition(
    step,
    *args,
    mesh="data=8",
    agent="data_parallel",
    arg_names=("w", "x"),
    arg_roles=("parameter", "input"),
  )
  assert plan.in_specs[1] == PartitionSpec("data", None)
  plan.lower()
  assert len(traces) == 1


def test_shard_blocks_map_devices_row_major():
  counts, holders = shard_blocks((8, 4), PartitionSpec("model", None), ("data", "model"), (2, 4))
  assert counts == (4, 1)
  assert holders[(0, 0)] == [0, 4] and holders[(3, 0)] == [3, 7]
  counts, holders = shard_blocks((8,), PartitionSpec(("data", "model")), ("data", "model"), (2, 4))
  assert counts == (8,) and holders[(5,)] == [5]


def test_partition_command_with_mcts_and_a_user_function(tmp_path):
  out = tmp_path / "plan.json"
  result = partition_cmd.run(
    partition_cmd.PartitionConfig(
      workload="test_api:user_mlp",
      mesh="data=8",
      agent="mcts",
      budget="100",
      seed=1,
      json=str(out),
      progress=False,
    )
  )
  saved = json.loads(out.read_text())
  for key in (
    "step_time_s",
    "peak_memory_bytes",
    "fits",
    "comm_bytes",
    "comm_count",
    "decisions",
    "baselines",
    "search_seconds",
    "trace",
  ):
    assert key in saved
  assert saved["trace"][0]["simulations"] == 0 and result["simulations"] <= 100
  assert partition_cmd.is_user_function("pkg.mod:fn") and not partition_cmd.is_user_function(
    "gpt:layers=2"
  )


def test_partition_command_tactic_keeps_its_behaviour(tmp_path):
  result = partition_cmd.run(partition_cmd.PartitionConfig(workload=GPT, tactic="megatron"))
  assert result["trace"] == [] and result["agent"] == "tactic"
  assert result["step_time_s"] == pytest.approx(result["baselines"]["megatron"]["step_time_s"])


def test_command_line_reports_bad_input_without_a_traceback(capsys):
  assert cli.main(["bench", "simulator", "--workload", "gpt:layerz=2"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("automap-rl bench simulator: error: unknown key 'layerz' for model 'gpt'")
  assert "Traceback" not in err


@pytest.mark.parametrize(
  "argv,message",
  [
    (["partition", "--hardware", "v100"], "invalid choice 'v100' for argument '--hardware'"),
    (["partition", "--seed", "abc"], "Error parsing --seed"),
    (["partition", "--agent", "alphazero"], "invalid choice 'alphazero' for argument '--agent'"),
    (["bench"], "bench needs one of: buckets, simulator, env, iopddl, pipeline, published, search"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["validate", "--suite", "huge"], "invalid choice 'huge' for argument '--suite'"),
    (["bench", "env", "--repeats", "0"], "repeats=0: the exact and bucketed tables need a run"),
  ],
)
def test_bad_options_give_one_line_and_exit_2(capsys, argv, message):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1, err


def test_help_lists_hardware_profiles_and_workload_families(capsys):
  from automap_rl import mesh

  assert cli.main(["--help"]) == 0
  top = capsys.readouterr().out
  assert cli.main(["partition", "--help"]) == 0
  partition = capsys.readouterr().out
  for text in (top, partition):
    assert all(name in text for name in mesh.HARDWARE) and all(
      name in text for name in workloads.FAMILIES
    )
  for flag in (
    "--mesh",
    "--agent",
    "--tactic",
    "--budget",
    "--seed",
    "--json",
    "--plot",
    "--check-numerics",
    "--check-workload",
    "(default: data=2,model=4)",
  ):
    assert flag in partition


def user_mlp_without_roles():
  """The user function of `user_mlp`, as `(fn, args)`: the roles are read from the step."""
  w = workloads.make_workload("mlp:layers=2,width=64,in_dim=32,classes=8,batch=16", abstract=True)
  return w.step, w.args


@pytest.mark.parametrize("family", workloads.FAMILIES)
def test_argument_roles_are_read_from_what_the_step_returns(family):
  from automap_rl import ir

  w = workloads.make_workload(family, abstract=True)
  inferred = ir.infer_roles(w.step, *w.args)
  assert inferred.roles == tuple(w.arg_roles) and not inferred.doubts
  assert ir.donated_argnums(inferred.roles) == tuple(
    range(len(w.args) - 1)
  )  # Everything but the batch.


def test_a_step_that_returns_no_argument_warns_and_names_them():
  import jax.numpy as jnp

  loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
  with pytest.warns(UserWarning, match="none of w, x reads as parameters"):
    plan = agents.partition(
      loss,
      jnp.ones((16, 8)),
      jnp.ones((32, 16)),
      mesh="data=8",
      agent="data_parallel",
      arg_names=("w", "x"),
    )
  assert plan.problem.program.donate_argnums == ()


def test_partition_reads_roles_and_runs_on_a_jax_mesh_with_the_users_function():
  """No roles given: the expert baselines still see the parameters (Megatron applies), the
  parameters and optimizer state are donated, the plan runs on the devices of the
  `jax.sharding.Mesh` it was given, and `jit` is the user's step under `jax.jit`."""
  import warnings

  import numpy as np

  w = workloads.make_workload(GPT)
  devices = np.array(jax.devices()[::-1][:8]).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ("data", "model"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    plan = agents.partition(w.step, *w.args, mesh=mesh, hardware="a100-80g", agent="data_megatron")
  assert plan.mesh.hardware.name == "a100-80g" and plan.mesh.shape == {"data": 2, "model": 4}
  assert "megatron" in plan.costs() and plan.problem.program.donate_argnums == (0, 1)
  assert plan.in_specs[0]["block_0"]["mlp"]["fc1"]["kernel"] == PartitionSpec(None, "model")
  jitted = plan.jit()
  compiled = jitted.lower(*w.args).compile()
  first = jax.tree.leaves(compiled.input_shardings[0])[0]
  assert list(first.mesh.devices.flat) == list(devices.flat)
  expected = jax.jit(w.step)(*jax.tree.map(np.array, w.args))
  got = jitted(*jax.tree.map(np.array, w.args))
  # The loss and Adam's first moments (the gradients); not the parameters: Adam's first
  # step normalises gradients, and the attention key bias's is zero up to rounding.
  for a, b in zip(
    jax.tree.leaves((expected[2], expected[1][0].mu)), jax.tree.leaves((got[2], got[1][0].mu))
  ):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)


TRACING_S = 2.0  # A large model's tracing, in small: the step sleeps while it is traced.


def _slow_to_trace(step):
  """`step`, sleeping `TRACING_S` each time it is traced (a new function: traces are cached
  per function)."""

  def slow(*args):
    time.sleep(TRACING_S)
    return step(*args)

  return slow


def test_a_seconds_budget_bounds_the_whole_call_tracing_included(monkeypatch):
  w = workloads.make_workload(GPT, abstract=True)
  given = []

  def spy(agent, problem, *, budget, **kwargs):
    given.append(budget)
    return run_agent(agent, problem, budget=budget, **kwargs)

  module = sys.modules["agents.partition"]  # The package's `partition` is the function.
  run_agent = module.run_agent
  monkeypatch.setattr(module, "run_agent", spy)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plan = agents.partition(
      _slow_to_trace(w.step),
      *w.args,
      agent="random",
      budget=agents.Seconds(5),
      arg_names=w.arg_names,
      arg_roles=w.arg_roles,
    )
  # The agent gets only what tracing left (all 5 s without the rule); how far its last batch
  # runs past that deadline is not asserted: a loaded test worker compiles slowly.
  assert [b.simulations for b in given] == [None] and given[0].seconds <= 5 - TRACING_S
  if plan.search.stopped_by is None:
    assert plan.search.simulations > 0
  else:
    # A loaded worker built the random agent's environment past the deadline: said, and the best
    # expert.
    assert plan.search.stopped_by == "seconds" and any(
      "whole time budget of 5 s" in str(c.message) for c in caught
    )
    assert plan.decisions == list(tactics.best_expert_plan(plan.problem).decisions)


def test_an_agent_whose_set_up_takes_the_budget_returns_the_best_expert_naming_the_limit(
  monkeypatch,
):
  w = workloads.make_workload(GPT, abstract=True)
  base = sys.modules["agents.base"]
  searcher = base.searcher

  def slow_set_up(*args, **kwargs):  # The agent's clock runs out while it builds its environment.
    time.sleep(2)
    return searcher(*args, **kwargs)

  monkeypatch.setattr(base, "searcher", slow_set_up)
  with pytest.warns(
    UserWarning,
    match=r"the whole time budget of 2 s; returning the best expert plan .* without "
    r"running random \(stopped by its time budget\)",
  ):
    plan = agents.partition(
      w.step, *w.args, agent="random", budget="2s", arg_names=w.arg_names, arg_roles=w.arg_roles
    )
  assert plan.search.stopped_by == "seconds"
  assert plan.decisions == list(tactics.best_expert_plan(plan.problem).decisions)


def test_a_budget_spent_before_the_search_returns_the_best_expert_naming_the_limit():
  w = workloads.make_workload(GPT, abstract=True)
  with pytest.warns(
    UserWarning,
    match=r"the whole time budget of 1 s; returning the best expert plan .* without "
    r"running ilp \(stopped by its time budget\)",
  ):
    plan = agents.partition(
      _slow_to_trace(w.step),
      *w.args,
      agent="ilp",
      budget="1s",
      arg_names=w.arg_names,
      arg_roles=w.arg_roles,
    )
  expert = tactics.best_expert_plan(plan.problem)
  assert plan.search.stopped_by == "seconds" and plan.decisions == list(expert.decisions)
  assert plan.search.step_time == pytest.approx(float(expert.cost.step_time))
  assert "stopped by its seconds limit" in plan.report()


def test_the_commands_seconds_budget_counts_loading_the_workload(monkeypatch, tmp_path):
  """`partition --budget` counts from the command's start: a workload whose loading takes
  longer than the budget leaves the search nothing, and the command says so."""
  load = partition_cmd.load_target

  def slow_load(spec):
    time.sleep(TRACING_S)
    return load(spec)

  monkeypatch.setattr(partition_cmd, "load_target", slow_load)
  out = tmp_path / "plan.json"
  with pytest.warns(UserWarning, match="the whole time budget of 1 s"):
    assert (
      cli.main(
        [
          "partition",
          GPT,
          "--agent",
          "random",
          "--budget",
          "1s",
          "--no-progress",
          "--json",
          str(out),
        ]
      )
      == 0
    )
  assert json.loads(out.read_text())["stopped_by"] == "seconds"


def test_a_mesh_object_is_priced_with_the_hardware_asked_for():
  from automap_rl.mesh import as_mesh, make_mesh

  mesh, devices = as_mesh(make_mesh("data=2,model=4", "h100"), "tpu-v5e")
  assert mesh.hardware.name == "tpu-v5e" and devices is None
  assert as_mesh(make_mesh("data=2,model=4", "h100"))[0].hardware.name == "h100"
  with pytest.raises(TypeError, match="mesh must be"):
    as_mesh(8)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
  workload=st.sampled_from([GPT, "test_api:user_mlp_without_roles"]),
  mesh=st.sampled_from(["data=8", "data=2,model=4"]),
  agent=st.sampled_from(["random", "greedy", "mcts", "fsdp_megatron"]),
  budget=st.integers(8, 40),
  seed=st.integers(0, 3),
)
def test_the_command_and_the_facade_give_the_same_plan_and_cost(
  workload, mesh, agent, budget, seed
):
  name, fn, args, names, roles = partition_cmd.load_target(workload)
  plan = agents.partition(
    fn,
    *args,
    mesh=mesh,
    hardware="a100-40g",
    agent=agent,
    budget=budget,
    seed=seed,
    arg_names=names,
    arg_roles=roles,
  )
  tactic = agent in agents.AGENTS
  result = partition_cmd.run(
    partition_cmd.PartitionConfig(
      workload=workload,
      mesh=mesh,
      hardware="a100-40g",
      agent=agent if tactic else "tactic",
      tactic=None if tactic else agent,
      budget=str(budget),
      seed=seed,
      progress=False,
    )
  )
  assert result["decisions"] == [str(d) for d in plan.decisions]
  assert result["step_time_s"] == float(plan.cost.step_time)
  assert result["peak_memory_bytes"] == float(plan.cost.peak_memory)


def test_the_report_compares_with_the_best_expert_that_fits_and_says_when_none_does():
  from automap_rl.plan import compare_with_best_expert

  row = lambda seconds, fits: {"step_time_s": seconds, "peak_memory_bytes": 1e9, "fits": fits}
  experts = {"data_megatron": row(2.0, True), "fsdp": row(1.0, False), "megatron": row(3.0, True)}
  assert (
    compare_with_best_expert("mcts", {"mcts": row(1.5, True), **experts})
    == "mcts step time / best expert (data_megatron): 0.750"
  )
  assert (
    compare_with_best_expert("data_megatron", experts)
    == "data_megatron step time / best expert (data_megatron): 1.000"
  )
  line = compare_with_best_expert("mcts", {"mcts": row(9.0, True), "fsdp": row(1.0, False)})
  assert line.startswith("no expert fits in memory") and "/" not in line
