"""`automap_rl.partition` end to end, and the `automap-rl partition` command with agents."""

import json

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import agents
from automap_rl import workloads
from automap_rl.plan import shard_blocks
from experiments import cli, partition_cmd

GPT = "gpt:layers=1,d_model=32,heads=4,seq=16,vocab=64,batch=8"


def user_mlp():
  """A user function for `automap-rl partition test_api:user_mlp`."""
  w = workloads.make_workload("mlp:layers=2,width=64,in_dim=32,classes=8,batch=16", abstract=True)
  return w.step, w.args, w.arg_names, w.arg_roles


def test_partition_end_to_end_lowers_and_checks_numerics(tmp_path):
  w = workloads.make_workload(GPT)
  phases, searched = [], []
  plan = agents.partition(w.step, *w.args, mesh="data=2,model=4", hardware="h100", agent="mcts",
                          budget=200, seed=0, arg_names=w.arg_names, arg_roles=w.arg_roles,
                          phase=phases.append, progress=lambda sims, best: searched.append(sims))
  assert phases == ["tracing", "building cost tables", "searching"]
  assert searched and searched[-1] == plan.search.simulations <= 200
  assert jax.tree.structure(plan.in_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)) == \
      jax.tree.structure(w.args)
  in_shardings = plan.in_shardings
  assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(in_shardings))
  assert len(jax.tree.leaves(plan.out_shardings)) == len(jax.tree.leaves(jax.eval_shape(w.step, *w.args)))
  report = plan.report()
  for name in ("mcts", "data_parallel", "megatron", "fsdp", "data_megatron", "replicated"):
    assert name in report
  assert "devices" in plan.diagram()
  assert (tmp_path / "plan.png").exists() or plan.plot(str(tmp_path / "plan.png"))
  assert (tmp_path / "plan.png").stat().st_size > 1000
  lowered = plan.check_numerics()  # Raises NumericsError on a mismatch.
  assert lowered.compiled is not None
  assert callable(plan.jit())


@pytest.mark.slow
def test_partition_with_a_tactic_lowers_megatron():
  w = workloads.make_workload(GPT)
  plan = agents.partition(w.step, *w.args, agent="data_megatron", arg_names=w.arg_names,
                              arg_roles=w.arg_roles)
  assert plan.in_specs[0]["block_0"]["mlp"]["fc1"]["kernel"] == PartitionSpec(None, "model")
  assert plan.in_specs[2]["inputs"] == PartitionSpec("data", None)
  plan.check_numerics()


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
  plan = agents.partition(step, *args, mesh="data=8", agent="data_parallel", arg_names=("w", "x"),
                          arg_roles=("parameter", "input"))
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
  result = partition_cmd.run(partition_cmd.PartitionConfig(
      workload="test_api:user_mlp", mesh="data=8", agent="mcts", budget="100", seed=1, json=str(out),
      progress=False))
  saved = json.loads(out.read_text())
  for key in ("step_time_s", "peak_memory_bytes", "fits", "comm_bytes", "comm_count", "decisions", "baselines",
              "search_seconds", "trace"):
    assert key in saved
  assert saved["trace"][0]["simulations"] == 0 and result["simulations"] <= 100
  assert partition_cmd.is_user_function("pkg.mod:fn") and not partition_cmd.is_user_function("gpt:layers=2")


def test_partition_command_tactic_keeps_its_behaviour(tmp_path):
  result = partition_cmd.run(partition_cmd.PartitionConfig(workload=GPT, tactic="megatron"))
  assert result["trace"] == [] and result["agent"] == "tactic"
  assert result["step_time_s"] == pytest.approx(result["baselines"]["megatron"]["step_time_s"])


def test_command_line_reports_bad_input_without_a_traceback(capsys):
  assert cli.main(["bench", "simulator", "--workload", "gpt:layerz=2"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("automap-rl bench simulator: error: unknown key 'layerz' for model 'gpt'")
  assert "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["partition", "--hardware", "v100"], "invalid choice 'v100' for argument '--hardware'"),
    (["partition", "--seed", "abc"], "Error parsing --seed"),
    (["partition", "--agent", "alphazero"], "invalid choice 'alphazero' for argument '--agent'"),
    (["bench"], "bench needs one of: simulator, env, iopddl, search"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["validate", "--suite", "huge"], "invalid choice 'huge' for argument '--suite'"),
])
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
    assert all(name in text for name in mesh.HARDWARE) and all(name in text for name in workloads.FAMILIES)
  for flag in ("--mesh", "--agent", "--tactic", "--budget", "--seed", "--json", "--plot", "--check-numerics",
               "--check-workload", "(default: data=2,model=4)"):
    assert flag in partition
