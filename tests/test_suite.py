"""Tests for the task suite ``automap_rl.workloads.suite``."""

import dataclasses
import warnings

import jax
import pytest

from automap_rl import mesh as mesh_lib
from automap_rl import tactics
from automap_rl.problem import Problem
from automap_rl.workloads import FAMILIES, SPLITS, canonical_spec, load_cases
from automap_rl.workloads.suite import MAX_DEVICES


def test_registry_size_and_families():
  train, test = load_cases("train"), load_cases("test")
  assert len(train) + len(test) >= 60
  families = {c.family for c in train + test}
  assert len(families) >= 8 and families <= set(FAMILIES)
  assert {c.family for c in train}.isdisjoint({c.family for c in test})
  assert len(load_cases()) == sum(len(load_cases(s)) for s in SPLITS)


def test_cases_are_well_formed():
  cases = load_cases()
  assert len({c.name for c in cases}) == len(cases)
  hardware = set()
  for case in cases:
    assert canonical_spec(case.workload)  # Parses and builds a config.
    assert case.workload.startswith(case.family)
    mesh = case.make_mesh()
    assert 8 <= mesh.num_devices <= MAX_DEVICES and len(mesh.axis_names) in (2, 3)
    assert mesh_lib.get_hardware(case.hardware).name == case.hardware
    hardware.add(case.hardware)
    if case.split != "smoke":
      assert f"size={case.size}" in case.workload
  assert {"a100-40g", "a100-80g", "h100", "tpu-v5e"} <= hardware
  assert any(len(mesh_lib.parse_mesh_spec(c.mesh)) == 3 for c in cases)
  assert any(
    c.make_mesh().num_devices > 64 for c in cases if c.split == "train"
  )  # GPT-175B on 16 nodes.


def test_train_and_test_hold_cases_at_the_scale_published_runs_trained():
  """Each split has cases on hundreds of devices at a million tokens a batch or more (GPT-3's
  1,536 x 2,048; T5's 2,048 x 512), where pipelines and accumulation matter."""
  from automap_rl.workloads import spec as spec_lib

  for split in ("train", "test"):
    large = []
    for case in load_cases(split):
      _, config = spec_lib.make_config(case.workload)
      if case.make_mesh().num_devices >= 256 and config.batch * config.seq >= 1 << 20:
        large.append(case.name)
    assert len(large) >= 2, (split, large)


def test_gpu_meshes_have_a_fast_inner_and_a_slow_outer_axis():
  case = next(c for c in load_cases("train") if c.mesh == "data=8,model=8" and c.hardware == "h100")
  mesh = case.make_mesh()
  assert mesh.link("model").bandwidth > mesh.link("data").bandwidth


def test_unknown_split_is_a_one_line_error():
  with pytest.raises(
    ValueError, match=r"^unknown split 'dev'; valid splits: smoke, train, test, external$"
  ):
    load_cases("dev")


def _traced(case) -> Problem:
  """The case's problem, traced abstractly, with no unknown primitive."""
  workload = case.make_workload()
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(workload.args))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # An unknown primitive warns.
    program = workload.trace()
  assert program.unknown_primitives == ()
  return Problem.build(program, case.make_mesh())


@pytest.mark.parametrize("case", load_cases("smoke"), ids=lambda c: c.name)
def test_smoke_cases_trace_abstractly_and_simulate(case):
  cost = _traced(case).cost([])
  assert float(cost.step_time) > 0 and bool(cost.fits)


# External cases whose abstract trace takes a second or two; the transformers and ResNet
# ones take 4-11 s each and run in `make test-all`.
FAST_EXTERNAL = ("jraph-gcn", "jraph-gat", "eqx-mlp")


@pytest.mark.parametrize(
  "case",
  [
    c if c.family in FAST_EXTERNAL else pytest.param(c, marks=pytest.mark.slow)
    for c in load_cases("external")
  ],
  ids=lambda c: c.name,
)
def test_external_cases_trace_abstractly_and_have_dims_to_shard(case):
  problem = _traced(case)
  # Named dimensions that every mesh axis divides, and an expert plan over them that takes
  # less memory per device than replication.
  divisible = [
    c for c in problem.named.classes if all(c.size % a == 0 for a in problem.mesh.axis_sizes)
  ]
  assert len(divisible) >= 4
  expert = tactics.best_expert_plan(problem)
  assert expert.decisions and float(expert.cost.peak_memory) < float(problem.cost([]).peak_memory)


def test_suite_list_prints_every_case_of_the_split(capsys):
  from experiments import cli

  assert cli.main(["suite", "list", "--split", "test"]) == 0
  out = capsys.readouterr().out
  test = load_cases("test")
  assert all(c.name in out for c in test) and not any(c.name in out for c in load_cases("train"))
  assert f"{len(test)} cases (test {len(test)})" in out
  assert cli.main(["suite", "list", "--split", "nope"]) == 2


def test_bench_suite_families_picks_their_cases_in_suite_order():
  from experiments import suite_cmd

  picked = suite_cmd.bench_cases(suite_cmd.SuiteBenchConfig(split="train", families=("dit", "mlp")))
  assert (
    picked == [c for c in load_cases("train") if c.family in ("mlp", "dit")] and len(picked) >= 2
  )
  assert suite_cmd.bench_cases(suite_cmd.SuiteBenchConfig(split="test")) == load_cases("test")
  named = suite_cmd.SuiteBenchConfig(split="test", cases=("ssm-2.8b-8x4x8-a100-80g",))
  assert [c.name for c in suite_cmd.bench_cases(named)] == ["ssm-2.8b-8x4x8-a100-80g"]
  with pytest.raises(ValueError, match=r"^--cases nope: no such case in the test split$"):
    suite_cmd.bench_cases(suite_cmd.SuiteBenchConfig(split="test", cases=("nope",)))


def test_bench_suite_scores_experts_agents_and_best_known(tmp_path):
  from automap_rl.plan import plan_from_json, plan_to_json
  from automap_rl.sharding import ArgDim, Decision
  from experiments import suite_cmd

  case = load_cases("smoke")[0]
  config = suite_cmd.SuiteBenchConfig(
    agents=("random",), budget=40, best_known=str(tmp_path / "best.json")
  )
  decision = Decision(ArgDim("batch/inputs", 0), "data")
  stored = plan_to_json([decision])
  assert plan_from_json(stored) == ([decision], None)
  row = suite_cmd.bench_case(case, config, stored)
  best = row["best_expert_step_time_s"]
  assert row["experts"][row["best_expert"]]["ratio"] == pytest.approx(1.0)
  assert all(s["ratio"] >= 1.0 - 1e-6 for s in row["experts"].values() if s["fits"])
  # The best-known plan is the best plan of the row, stored plans included.
  scores = [*row["experts"].values(), *row["agents"].values()]
  assert row["best_known"]["step_time_s"] == min(
    s["step_time_s"] for s in scores + [row["best_known"]]
  )
  assert row["best_known"]["ratio"] == pytest.approx(row["best_known"]["step_time_s"] / best)
  written = suite_cmd.update_best_known([row], config.best_known, "cmd")
  assert written == (row["best_known"]["source"] != "stored")
  if written:  # Each plan keeps the command that found it.
    entry = suite_cmd.load_best_known(config.best_known)["cases"][case.name]
    assert entry["command"] == "cmd" and entry["decisions"] == row["best_known"]["decisions"]
  summary = suite_cmd.summarize([row, {**row, "best_known": {**row["best_known"], "ratio": 0.5}}])
  assert (
    summary["cases"] == 2 and summary["best_known_beats_best_expert_by_5pct_or_only_it_fits"] == 0.5
  )


def test_an_agents_pipelined_plan_is_stored_with_its_pipeline_and_prices_the_same_again(
  tmp_path, monkeypatch
):
  """A searched plan with pipeline stages becomes the best-known with them: written back
  and read again, the stored plan costs what the agent's did."""
  from agents import SearchResult
  from automap_rl.plan import plan_from_json
  from experiments import suite_cmd

  case = next(c for c in load_cases("smoke") if c.name.startswith("llama"))
  problem = Problem.build(case.make_workload().trace(), case.make_mesh())
  decisions, pipeline = tactics.applicable_pipelines(problem)["pipeline"]
  cost = problem.plan_cost(decisions, pipeline)
  assert not pipeline.trivial and float(cost.step_time) != float(
    problem.plan_cost(decisions).step_time
  )
  found = SearchResult(
    decisions=list(decisions),
    cost=cost,
    trace=[],
    simulations=0,
    seconds=0.0,
    actions=[],
    objective=0.0,
    pipeline=pipeline,
  )
  # Priced a thousand times faster than it is, it is the case's best-known plan.
  monkeypatch.setattr(
    suite_cmd.agents,
    "run_agent",
    lambda *a, **k: dataclasses.replace(
      found, cost=jax.tree.map(lambda x: x * 1e-3 if x.dtype.kind == "f" else x, cost)
    ),
  )
  config = suite_cmd.SuiteBenchConfig(agents=("learned",), best_known=str(tmp_path / "best.json"))
  row = suite_cmd.bench_case(case, config, None)
  assert (
    row["best_known"]["source"] == "learned" and row["best_known"]["pipeline"] == pipeline.to_json()
  )
  assert suite_cmd.update_best_known([row], config.best_known, "cmd") == 1
  stored = plan_from_json(suite_cmd.load_best_known(config.best_known)["cases"][case.name])
  assert stored == (list(decisions), pipeline)
  assert float(problem.plan_cost(*stored).step_time) == pytest.approx(
    float(cost.step_time), rel=1e-6
  )


def test_bench_pipeline_compares_the_best_pipelined_and_intra_op_plans(tmp_path):
  from experiments import bench_pipeline

  (row,) = bench_pipeline.run(
    bench_pipeline.PipelineBenchConfig(
      cases=("gpt-39b-4x2x8-h100-remat",), agents=(), json=str(tmp_path / "p.json")
    )
  )
  plans = row["plans"]
  piped, intra = plans[row["best_pipelined"]], plans[row["best_intra_op"]]
  assert piped["pipelined"] and piped["fits"] and "stages" in piped["pipeline"]
  # The best expert inside megatron_3d's stages: its decisions on the stage axis dropped.
  staged = plans[next(n for n in plans if n.startswith("best expert"))]
  assert plans[next(n for n in plans if n.startswith("best expert") and n.endswith("+ stages"))][
    "pipelined"
  ]
  assert not staged.get("pipelined", False)
  assert not intra.get("pipelined", False) and intra["fits"]
  assert row["pipelined_over_intra_op"] == pytest.approx(
    piped["step_time_s"] / intra["step_time_s"]
  )
  assert (
    0 < piped["bubble_share"] < 1
    and 0 < intra["comm_share"] < 1
    and 0 < piped["stage_balance"] <= 1
  )
  assert 0 < piped["utilization"] < 1
  with pytest.raises(ValueError, match="unknown case"):
    bench_pipeline.run(bench_pipeline.PipelineBenchConfig(cases=("gpt-39b",), agents=()))
