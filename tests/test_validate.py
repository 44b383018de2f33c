"""Tests for automap_rl.xla.validate and `automap-rl validate`."""

import dataclasses
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from automap_rl import tactics, workloads
from automap_rl.sharding import ArgDim, Decision, Group
from automap_rl.xla import validate
from automap_rl.xla.numerics import reference_outputs
from experiments import validate_cmd

TINY = validate.ValidationSuite(
  models=("mlp:layers=1,width=32,in_dim=16,classes=8,batch=8",),
  meshes=("data=8",),
  random_plans=1,
  isolated=False,
)


def test_tiny_suite_json_and_plot(tmp_path, monkeypatch):
  monkeypatch.setitem(validate.SUITES, "quick", TINY)
  json_path, plot_path = tmp_path / "v.json", tmp_path / "v.png"
  validate_cmd.run(validate_cmd.ValidateConfig("quick", str(json_path), str(plot_path)))
  document = json.loads(json_path.read_text())
  assert set(document) == {"cases", "summary"}
  assert set(document["summary"]) == {
    "num_cases",
    "lowering_errors",
    "xla_aborts",
    "pipelined_cases",
    "comm_bytes_median_rel_error",
    "comm_bytes_spearman",
    "flops_median_rel_error",
    "memory_median_rel_error",
    "memory_spearman",
    "numerics_ok_fraction",
    "realized_fraction",
  }
  assert (
    document["summary"]["numerics_ok_fraction"] == 1 and document["summary"]["pipelined_cases"] == 0
  )
  assert document["summary"]["realized_fraction"] == 1  # Every plan compiled as written.
  assert document["summary"]["num_cases"] == len(document["cases"]) >= 4
  case = document["cases"][0]
  assert {"model", "mesh", "plan", "simulated", "compiled", "numerics_ok", "differences"} <= set(
    case
  )
  by_plan = {c["plan"]: c for c in document["cases"]}
  dp = by_plan["data_parallel"]
  assert dp["simulated"]["comm_bytes"] == dp["compiled"]["comm_bytes"] > 0
  assert by_plan["replicated"]["compiled"]["comm_bytes"] == 0
  assert plot_path.stat().st_size > 0


def test_summary_statistics():
  assert validate.relative_error(0.0, 0.0) == 0.0
  assert validate.relative_error(1.0, 0.0) == math.inf
  assert validate.relative_error(110.0, 100.0) == 0.1
  assert validate.spearman([1, 2, 3], [10, 30, 20]) == 0.5
  assert math.isnan(validate.spearman([1, 2], [1, 2]))


def test_rank_agreement_orders_pipelined_and_intra_op_plans_of_a_case_together():
  """Pairs within a case, pipelined plans and intra-op ones alike; compiled ties left out."""
  from automap_rl.xla import fullsize

  def check(
    case: str, plan: str, simulated: float, compiled: float, pipelined: bool
  ) -> fullsize.PlanCheck:
    return fullsize.PlanCheck(
      case=case,
      devices=8,
      plan=plan,
      searched=False,
      decisions=(),
      simulated={"step_time": simulated},
      compiled={"step_time": compiled},
      differences=0,
      seconds=0.0,
      pipeline={"axis": "data"} if pipelined else None,
    )

  checks = [
    check("a", "megatron", 1.0, 1.0, False),
    check("a", "megatron_3d", 2.0, 3.0, True),
    check("a", "pipeline", 3.0, 2.0, True),
    check("b", "fsdp", 1.0, 2.0, False),
    check("b", "pipeline", 2.0, 1.0, True),
    check("b", "megatron_3d", 5.0, 2.0005, True),
  ]
  # a: (megatron, megatron_3d) and (megatron, pipeline) agree, (megatron_3d, pipeline) does not;
  # b: (fsdp, pipeline) disagrees, (pipeline, megatron_3d) agrees, (fsdp, megatron_3d) ties on the
  # compiled side.
  assert fullsize.agreement_by_case(checks) == pytest.approx({"a": 2 / 3, "b": 1 / 2})
  assert fullsize.pairwise_agreement(checks) == pytest.approx(3 / 5)


@pytest.mark.slow
def test_simulated_flops_follow_xla_fusion_on_per_device_shapes():
  """XLA clones cheap producers (LayerNorm, GELU, their gradients) into every fusion that
  reads them, and whether a reduction is a library call depends on its per-device size:
  the replicated and the data-parallel plan fuse differently, and both match."""
  spec = validate.SUITES["quick"].models[1]
  assert spec.startswith("gpt:")
  workload = workloads.make_workload(spec, seed=0)
  reference = reference_outputs(workload.step, workload.args)
  problem = validate.trace_problem(workload, "data=8", "cpu")
  plans = tactics.applicable(problem)
  for name in ("replicated", "data_parallel"):
    case = validate.run_case(
      problem, workload, "data=8", name, plans[name], reference, isolated=False
    )
    assert validate.relative_error(case.simulated["flops"], case.compiled["flops"]) < 0.015, name


def test_collectives_combine_per_loop_iteration_as_xla_does():
  """Layers in a scan: XLA's combiner merges one iteration's independent gradient
  reductions (the loop body is one computation), and the simulator counts the same
  collectives of every kind, and the same bytes."""
  workload = workloads.make_workload(
    "gpt:layers=4,d_model=64,heads=4,seq=16,vocab=64,batch=8,scan=True", abstract=True
  )
  problem = validate.trace_problem(workload, "data=2,model=4", "cpu")
  plans = tactics.applicable(problem)
  for name in ("data_megatron",):  # Gradient reductions combined per iteration; activations' not.
    lowered = _compiled(problem, plans[name], workload)
    simulated, compiled = (
      validate.simulated_metrics(problem, plans[name]),
      validate.compiled_metrics(lowered.stats),
    )
    assert (
      compiled["comm_count_by_kind"]["all-reduce"] > 4
    )  # One per iteration at least, and the rest.
    assert {k: round(v, 3) for k, v in simulated["comm_count_by_kind"].items()} == compiled[
      "comm_count_by_kind"
    ], name
    assert math.isclose(simulated["comm_bytes"], compiled["comm_bytes"], rel_tol=1e-6), name


def test_nested_loops_cost_what_xla_compiles():
  """An SSM: a scan over time steps inside the scan over layers. XLA all-reduces the
  state matrix's gradient in every time step (combined per loop, not with the layer
  loop's gradients), gathers FSDP's loop-invariant weights once per layer rather than per
  time step, and on CPU computes the depthwise convolution's kernel gradient as a dense
  convolution over all channels: the simulator counts the same collectives, bytes and
  flops."""
  layers, seq = 2, 16
  workload = workloads.make_workload(
    f"ssm:layers={layers},d_model=32,seq={seq},batch=8", abstract=True
  )
  problem = validate.trace_problem(workload, "data=4,model=2", "cpu")
  plans = tactics.applicable(problem)
  for name in ("replicated", "data_parallel", "fsdp", "data_megatron"):
    lowered = _compiled(problem, plans[name], workload)
    simulated, compiled = (
      validate.simulated_metrics(problem, plans[name]),
      validate.compiled_metrics(lowered.stats),
    )
    assert lowered.differences == (), name
    assert validate.relative_error(simulated["flops"], compiled["flops"]) < 0.03, name
    for kind in ("all-reduce", "all-gather") if name == "fsdp" else ("all-reduce",):
      assert simulated["comm_count_by_kind"][kind] == pytest.approx(
        compiled["comm_count_by_kind"][kind], rel=0.15
      ), name
    if name != "replicated":
      assert (
        compiled["comm_count_by_kind"]["all-reduce"] > layers * seq
      )  # One per time step at least.
    if name == "data_parallel":
      assert simulated["comm_bytes"] == compiled["comm_bytes"]


def test_loop_buffers_are_live_through_the_loop():
  """XLA's while loop holds a stacked input (the layer stack's residuals, read slice by
  slice in the backward pass) and a stacked output (the stacked weights' gradients) for
  the whole loop: the simulator's peak memory of an SSM (a scan over time steps in the
  scan over layers) is the compiled one's within 5% (it was 12-16% under when a value's
  liveness ended at its last read in the body)."""
  workload = workloads.make_workload("ssm:layers=8,d_model=64,seq=128,batch=16", abstract=True)
  problem = validate.trace_problem(workload, "data=4,model=2", "h100")
  plans = tactics.applicable(problem)
  for name in ("data_parallel", "fsdp"):
    lowered = _compiled(problem, plans[name], workload)
    simulated, compiled = (
      validate.simulated_metrics(problem, plans[name]),
      validate.compiled_metrics(lowered.stats),
    )
    assert simulated["peak_memory"] == pytest.approx(compiled["peak_memory"], rel=0.05), name


def test_gathers_and_scatter_adds_move_what_the_simulator_prices():
  """A message-passing GNN (node features gathered by edge, messages scatter-added back)
  with its graph batch over `data` and the `model` axis unused: left to itself, XLA
  partitions the gathers and scatter-adds over devices of no mesh axis (all-reduces and
  collective-permutes of whole node arrays, 1.59x the simulated comm bytes; GraphCast's
  fsdp plan on 8x8 moved 2,191x its simulated all-gather bytes). Pinned to the shardings
  their rules compute on, they all-gather and all-reduce the bytes the simulator prices
  (the model's unused second aggregation of each step, which XLA removes, left out: its
  all-reduce made the simulated bytes 1.36x XLA's). In float32: XLA's CPU backend
  computes bfloat16 in float32, collectives included."""
  workload = workloads.make_workload(
    "gnn:n_node=256,n_edge=1024,latent=64,steps=1,batch=8,dtype=float32", abstract=True
  )
  problem = validate.trace_problem(workload, "data=2,model=4", "cpu")
  plan = tactics.applicable(problem)["fsdp"]
  lowered = _compiled(problem, plan, workload)
  simulated, compiled = (
    validate.simulated_metrics(problem, plan),
    validate.compiled_metrics(lowered.stats),
  )
  gathered = compiled["comm_bytes_by_kind"]["all-gather"]
  assert (
    gathered == pytest.approx(simulated["comm_bytes_by_kind"]["all-gather"], rel=1e-3)
    and gathered > 1e6
  )
  assert simulated["comm_bytes"] == pytest.approx(compiled["comm_bytes"], rel=1e-3)
  assert not lowered.differences


def test_a_vocab_parallel_embedding_moves_what_the_simulator_prices():
  """Megatron with sequence parallelism: the token embedding's rows over `model` (each
  shard gathers the rows it holds, the partial embeddings are summed; its gradient stays
  split by rows) while the token ids are split by sequence over the same axis. XLA moves
  the bytes the simulator prices, and the embedding's gradient is never summed whole over
  `model` (the replicated table's plan all-reduces it: more all-reduce bytes)."""
  workload = workloads.make_workload(
    "gpt:layers=2,d_model=128,heads=4,seq=64,vocab=1024,batch=8,dtype=float32", abstract=True
  )
  problem = validate.trace_problem(workload, "data=2,model=4", "cpu")
  (rows,) = tactics.structure(problem).embedding_rows
  assert tactics.structure(problem).parameter_dims[rows] == (("params/embed/embedding", 0),)
  split = tactics.data_parallel(problem) + tactics.megatron(problem)
  whole = [d for d in split if d.target != ArgDim("params/embed/embedding", 0)]
  reduced = []
  for plan in (split, whole):
    plan = plan + tactics.sequence_split(problem, "model")
    lowered = _compiled(problem, plan, workload)
    simulated = validate.simulated_metrics(problem, plan)
    compiled = validate.compiled_metrics(lowered.stats)
    assert not lowered.differences
    for kind, moved in compiled["comm_bytes_by_kind"].items():
      assert simulated["comm_bytes_by_kind"][kind] == pytest.approx(moved, rel=1e-3), kind
    reduced.append(compiled["comm_bytes_by_kind"]["all-reduce"])
  vocab, width = 1024, 128
  assert reduced[1] - reduced[0] > vocab * width * 4  # A whole table, at the least.


def test_hybrid_sharding_reduces_as_xla_cpu_does():
  """Hybrid sharded data parallelism on XLA:CPU, which has no native reduce-scatter: each
  weight gradient (a dot's partial sums over the batch on both axes, stored over `model`)
  is all-reduced whole over `model` and sliced, then its shard over `data`; a bias
  gradient (a reduce_sum's) in one all-reduce over both. The simulator prices XLA's
  all-reduces, bytes and count."""
  workload = workloads.make_workload(
    "mlp:layers=2,width=512,in_dim=512,classes=16,batch=64", abstract=True
  )
  problem = validate.trace_problem(workload, "data=2,model=4", "cpu")
  plan = tactics.hsdp(problem)
  lowered = _compiled(problem, plan, workload)
  simulated = validate.simulated_metrics(problem, plan)
  compiled = validate.compiled_metrics(lowered.stats)
  groups = {c.mesh_axes for c in lowered.stats.collectives if c.kind == "all-reduce"}
  assert groups == {("model",), ("data",), ("data", "model")}
  for metric in ("comm_bytes_by_kind", "comm_count_by_kind"):
    assert simulated[metric]["all-reduce"] == pytest.approx(compiled[metric]["all-reduce"])


def test_a_token_permutation_moves_what_the_simulator_prices():
  """Expert parallelism with tokens permuted to their experts by index: the experts take
  the expert axis before the batch, so the dispatched tokens are split by expert and the
  experts' weights are never gathered; XLA moves the bytes the simulator prices, the
  permutation back to the tokens as all-to-alls."""
  workload = workloads.make_workload(
    "moe:layers=1,d_model=128,heads=4,seq=64,vocab=512,batch=8,experts=4,top_k=2,"
    "capacity_factor=1.0,dispatch=gather,dtype=float32",
    abstract=True,
  )
  problem = validate.trace_problem(workload, "data=2,expert=4", "cpu")
  experts = tactics._shard_classes(problem, tactics.structure(problem).experts, "expert")
  plan = experts + tactics._batch_over(problem, ("data", "expert"))
  dispatched = [v.id for v in problem.program.values if v.shape == (4, 8, 32, 128)]
  specs = problem.partition_specs(plan, dispatched)
  assert dispatched and all(tuple(spec[:2]) == ("expert", "data") for spec in specs)
  lowered = _compiled(problem, plan, workload)
  simulated = validate.simulated_metrics(problem, plan)["comm_bytes_by_kind"]
  compiled = validate.compiled_metrics(lowered.stats)["comm_bytes_by_kind"]
  assert not lowered.differences
  assert compiled["all-to-all"] > 0
  for kind, moved in compiled.items():
    assert simulated[kind] == pytest.approx(moved, rel=0.05), kind


def test_random_plans_are_lowered_in_isolation_and_checked(tmp_path, capsys):
  """`validate --random 2` on one model: two plans, one per mesh, every one compiled in a
  child process first, run and checked; the JSON counts lowering errors and aborts."""
  json_path = tmp_path / "r.json"
  validate_cmd.run(
    validate_cmd.ValidateConfig(
      random=2, models=("mlp:layers=1,width=32,in_dim=16,classes=8,batch=8",), json=str(json_path)
    )
  )
  document = json.loads(json_path.read_text())
  assert [c["mesh"] for c in document["cases"]] == ["data=8", "data=2,model=4"]
  assert [c["plan"] for c in document["cases"]] == ["random_0", "random_1"]
  assert all(
    c["numerics_ok"] and c["reference"] == "float64" and c["lowering_error"] is None
    for c in document["cases"]
  )
  summary = document["summary"]
  assert (summary["num_cases"], summary["lowering_errors"], summary["xla_aborts"]) == (2, 0, 0)
  assert summary["numerics_ok_fraction"] == 1


def test_random_plans_in_two_processes_are_the_plans_of_one():
  """`validate --random N --workers 2` runs the same plans, compiled to the same modules,
  and returns them in the same order as one process does."""
  suite = validate.RandomSuite(
    models=("mlp:layers=1,width=32,in_dim=16,classes=8,batch=8",), plans=3
  )
  one, two = (validate.run_random(dataclasses.replace(suite, workers=w)) for w in (1, 2))
  assert [c.plan for c in two] == ["random_0", "random_1", "random_2"]
  assert [(c.mesh, c.decisions, c.compiled, c.numerics_ok) for c in two] == [
    (c.mesh, c.decisions, c.compiled, c.numerics_ok) for c in one
  ]
  assert all(c.numerics_ok for c in two)


def test_the_seed_draws_the_random_plans(monkeypatch):
  """`validate --random N --seed S` hands S to the random suite, which seeds the workloads'
  parameters and the random plans with it."""
  suites = []
  monkeypatch.setattr(validate, "run_random", lambda suite, report: suites.append(suite) or [])
  monkeypatch.setattr(validate, "summarize_cases", lambda cases: {})
  monkeypatch.setattr(validate_cmd, "_summary_text", lambda summary: "")
  for seed in (0, 3):
    validate_cmd.run(validate_cmd.ValidateConfig(random=1, models=("mlp",), seed=seed))
  assert [suite.seed for suite in suites] == [0, 3]


def test_a_plan_that_does_not_lower_is_a_failed_case_not_a_crash(monkeypatch):
  workload = workloads.make_workload("mlp:layers=1,width=32,in_dim=16,classes=8,batch=8")
  problem = validate.trace_problem(workload, "data=8", "cpu")

  def refuse(*args, **kwargs):
    raise validate.LoweringError(
      "XLA cannot compile the plan (aborted: x.cc:1: Check failed: no) at dot_general."
    )

  monkeypatch.setattr(validate, "lower", refuse)
  case = validate.run_case(
    problem,
    workload,
    "data=8",
    "p",
    tactics.data_parallel(problem),
    reference_outputs(workload.step, workload.args),
  )
  assert (case.numerics_ok, case.compiled) == (False, {})
  assert (
    case.lowering_error
    == "XLA cannot compile the plan (aborted: x.cc:1: Check failed: no) at dot_general."
  )
  summary = validate.summarize_cases([case])
  assert (summary["lowering_errors"], summary["xla_aborts"], summary["numerics_ok_fraction"]) == (
    1,
    1,
    0.0,
  )


PIPELINED_GPT = "gpt:layers=4,d_model=16,heads=2,seq=8,vocab=32,batch=8,scan=true"


def test_random_pipelines_take_a_whole_axis_and_decisions_off_it():
  """Random pipelined plans: one stage per device of a random axis that divides the 4
  layers (or one stage: gradient accumulation), 4 or 8 microbatches, every schedule,
  decisions that resolve at microbatch size and never use an axis the stages take."""
  import numpy as np

  from automap_rl.mesh import make_mesh
  from automap_rl.problem import Problem

  workload = workloads.make_workload(PIPELINED_GPT)
  problem = Problem.build(
    validate.trace_workload(workload), make_mesh("stage=2,data=2,model=2", "cpu")
  )
  rng = np.random.default_rng(0)
  seen, schedules = set(), set()
  for _ in range(24):
    decisions, pipeline = validate.random_pipelined_plan(problem, workload.args, rng, 4)
    assert pipeline.stages in (1, 2) and pipeline.microbatches in (4, 8)
    assert 1 <= len(decisions) <= 4
    assert pipeline.stages == 1 or all(d.axis != pipeline.axis for d in decisions)
    problem.pipelined(pipeline).resolution(decisions)  # Raises where a decision does not divide.
    seen.add((pipeline.axis, pipeline.microbatches))
    schedules.add("accumulation" if pipeline.stages == 1 else pipeline.schedule)
  assert len(seen) >= 4  # Every axis can take the stages.
  assert schedules == {"accumulation", "gpipe", "1f1b", "interleaved"}


@pytest.mark.slow
def test_random_pipelined_plans_are_lowered_run_and_counted(tmp_path):
  """`validate --random 2 --pipelines`: two pipelined plans, one per pipeline mesh, each
  compiled in a child process first, run and checked; the stage transfers are compiled
  collective-permutes and the simulator prices them; the summary counts the plans."""
  json_path = tmp_path / "p.json"
  validate_cmd.run(
    validate_cmd.ValidateConfig(
      random=2, pipelines=True, models=(PIPELINED_GPT,), json=str(json_path)
    )
  )
  document = json.loads(json_path.read_text())
  cases = document["cases"]
  assert [c["mesh"] for c in cases] == list(validate.PIPELINE_MESHES)
  for case in cases:
    pipeline = case["pipeline"]
    sizes = dict(part.split("=") for part in case["mesh"].split(","))
    assert pipeline["stages"] in (1, int(sizes[pipeline["axis"]]))
    assert pipeline["microbatches"] in (4, 8)
    assert case["numerics_ok"] and case["lowering_error"] is None and case["reference"] == "float64"
    if pipeline["stages"] > 1:  # Gradient accumulation (one stage) sends nothing.
      assert (
        case["compiled"]["collective_permute_bytes"] > 0
        and case["simulated"]["collective_permute_bytes"] > 0
      )
    assert pipeline["stages"] == 1 or not any(
      f"axis='{pipeline['axis']}'" in d for d in case["decisions"]
    )
  summary = document["summary"]
  assert (
    summary["num_cases"],
    summary["pipelined_cases"],
    summary["lowering_errors"],
    summary["xla_aborts"],
  ) == (2, 2, 0, 0)
  assert summary["numerics_ok_fraction"] == 1


def test_random_pipelines_of_a_model_without_a_scanned_stack_accumulate_or_fail_in_one_line():
  """An unrolled stack is not pipelined over stages yet: its random pipelines are gradient
  accumulation; a model with no stack at all fails in one line."""
  import numpy as np

  from automap_rl.mesh import make_mesh
  from automap_rl.problem import Problem

  mlp = workloads.make_workload("mlp:layers=2,width=32,in_dim=16,classes=8,batch=8")
  problem = Problem.build(validate.trace_workload(mlp), make_mesh("stage=2,data=2,model=2", "cpu"))
  if problem.layer_stacks:
    rng = np.random.default_rng(0)
    for _ in range(6):
      assert validate.random_pipeline(problem, mlp.args, rng).stages == 1
  suite = validate.RandomSuite(
    models=("mlp:layers=1,width=32,in_dim=16,classes=8,batch=8",), plans=1, pipelines=True
  )
  with pytest.raises(ValueError, match="on stage=2,data=2,model=2: no lowerable pipeline") as e:
    validate.run_random(suite)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="--pipelines needs --random"):
    validate_cmd.run(validate_cmd.ValidateConfig(pipelines=True))


def _compiled(problem, decisions, workload):
  """A plan's compile-only lowering (one compile, nothing run): its statistics and
  sharding differences."""
  from automap_rl.xla.lower import lower

  return lower(
    problem,
    decisions,
    workload.step,
    workload.args,
    donate_argnums=validate.DONATE_ARGNUMS,
    executable=False,
  )


def _metrics(
  comm: dict[str, float], flops: float, memory: float, step_time: float, permute: float = 0.0
) -> dict:
  from automap_rl.simulator import KINDS

  by_kind = {k: comm.get(k, 0.0) for k in KINDS}
  return {
    "comm_bytes": sum(by_kind.values()),
    "comm_bytes_by_kind": by_kind,
    "comm_count_by_kind": {k: float(b > 0) for k, b in by_kind.items()},
    "collective_permute_bytes": permute,
    "flops": flops,
    "peak_memory": memory,
    "step_time": step_time,
    "fits": True,
  }


def _sampled_checks():
  """Two families: gpt (an expert and a searched plan that compiled, a searched plan that
  did not) and ssm (two experts, the second overpriced by its all-gathers)."""
  from automap_rl.xla import fullsize

  def check(case, family, plan, searched, simulated, compiled, error=None):
    return fullsize.PlanCheck(
      case=case,
      devices=8,
      plan=plan,
      searched=searched,
      decisions=(),
      simulated=simulated,
      compiled=compiled,
      differences=0,
      seconds=1.0,
      family=family,
      error=error,
    )

  return [
    check(
      "gpt-350m-8x2-a100-80g",
      "gpt",
      "megatron",
      False,
      _metrics({"all-reduce": 100.0}, 10.0, 5.0, 1.0),
      _metrics({"all-reduce": 100.0}, 10.0, 5.0, 1.0),
    ),
    check(
      "gpt-350m-8x2-a100-80g",
      "gpt",
      "mcts@2000",
      True,
      _metrics({"all-reduce": 50.0}, 10.0, 5.0, 0.8),
      _metrics({"all-reduce": 60.0}, 10.0, 5.0, 0.9),
    ),
    check(
      "gpt-350m-8x2-a100-80g",
      "gpt",
      "learned@64",
      True,
      _metrics({"all-reduce": 50.0}, 10.0, 5.0, 0.7),
      {},
      error="ValueError: no lowering",
    ),
    check(
      "ssm-370m-4x4-tpu-v5e",
      "ssm",
      "fsdp",
      False,
      _metrics({"all-reduce": 100.0}, 10.0, 5.0, 1.0),
      _metrics({"all-reduce": 100.0}, 10.0, 5.0, 1.0),
    ),
    check(
      "ssm-370m-4x4-tpu-v5e",
      "ssm",
      "megatron",
      False,
      _metrics({"all-reduce": 100.0, "all-gather": 300.0, "all-to-all": 1.0}, 10.0, 5.5, 2.0),
      _metrics({"all-reduce": 100.0, "all-gather": 100.0, "all-to-all": 0.0}, 10.0, 5.0, 1.25),
    ),
  ]


def test_the_family_table_names_each_familys_worst_plan_and_its_largest_term_error():
  from automap_rl.xla import fullsize

  checks = _sampled_checks()
  worst = checks[-1]
  # all-to-all carries under `TERM_SHARE` of the bytes on both sides: no term, though its error is
  # infinite.
  assert fullsize.term_errors(worst) == pytest.approx(
    {"flops": 0.0, "peak_memory": 0.1, "all-reduce": 0.0, "all-gather": 2.0}
  )
  gpt, ssm = fullsize.family_table(checks)
  assert (gpt["family"], gpt["cases"], gpt["plans"], gpt["failed_to_compile"]) == ("gpt", 1, 3, 1)
  assert gpt["realized_fraction"] == pytest.approx(
    2 / 3
  )  # The plan that did not compile is not realized.
  assert gpt["exploit_gap_max"] == pytest.approx(
    0.9 - 0.8
  )  # Only the compiled searched plan has a gap.
  assert (
    gpt["worst_plan"] == "gpt-350m-8x2-a100-80g/mcts@2000" and gpt["worst_term"] == "all-reduce"
  )
  assert ssm["worst_plan"] == "ssm-370m-4x4-tpu-v5e/megatron" and ssm["worst_term"] == "all-gather"
  assert ssm["worst_step_time_rel_error"] == pytest.approx(0.6) and ssm[
    "worst_term_rel_error"
  ] == pytest.approx(2.0)
  assert ssm["pairwise_rank_agreement"] == 1.0 and math.isnan(ssm["exploit_gap_median_abs"])


def test_pieces_of_a_sampled_run_resume_and_merge_without_compiling(tmp_path, capsys):
  from experiments import cli

  checks = [dataclasses.asdict(c) for c in _sampled_checks()]
  first, second = tmp_path / "gpt.json", tmp_path / "ssm.json"
  first.write_text(json.dumps({"checks": checks[:3]}))
  second.write_text(json.dumps({"checks": checks[3:]}))
  # The JSON already holds the case asked for: nothing is traced or compiled.
  assert (
    cli.main(
      [
        "validate",
        "--suite",
        "fullsize",
        "--cases",
        "gpt-350m-8x2-a100-80g",
        "--resume",
        "--json",
        str(first),
      ]
    )
    == 0
  )
  assert [c["plan"] for c in json.loads(first.read_text())["checks"]] == [
    "megatron",
    "mcts@2000",
    "learned@64",
  ]
  merged = tmp_path / "merged.json"
  assert (
    cli.main(
      ["validate", "--suite", "fullsize", "--merge", str(first), str(second), "--json", str(merged)]
    )
    == 0
  )
  document = json.loads(merged.read_text())
  assert [row["family"] for row in document["families"]] == ["gpt", "ssm"]
  assert document["summary"]["plans"] == 5 and document["summary"]["failed_to_compile"] == 1
  out = capsys.readouterr().out
  assert "FAILED TO COMPILE gpt-350m-8x2-a100-80g/learned@64: ValueError: no lowering" in out
  assert "ssm-370m-4x4-tpu-v5e/megatron (60.0%; all-gather 200.0%)" in out
  # A plan compiled again in a later piece replaces its earlier check: the failed plan, now
  # compiled.
  again = tmp_path / "again.json"
  again.write_text(json.dumps({"checks": [{**checks[1], "plan": "learned@64"}]}))
  assert (
    cli.main(
      [
        "validate",
        "--suite",
        "fullsize",
        "--merge",
        str(first),
        str(second),
        str(again),
        "--json",
        str(merged),
      ]
    )
    == 0
  )
  summary = json.loads(merged.read_text())["summary"]
  assert summary["plans"] == 5 and summary["failed_to_compile"] == 0


@given(
  st.one_of(
    st.builds(ArgDim, st.text(max_size=20), st.integers(0, 5)),
    st.builds(Group, st.integers(0, 10**6)),
    st.integers(0, 10**6),
  ),
  st.sampled_from(["data", "model", "fsdp_2"]),
)
def test_a_decision_is_read_back_from_its_repr(target, axis):
  from automap_rl.xla import fullsize

  decision = Decision(target, axis)
  assert fullsize.decision_from_text(repr(decision)) == decision


def test_merged_checks_are_priced_again_by_this_simulator_without_compiling():
  """`--merge --resimulate`: a check whose simulated side is stale gets this simulator's
  figures; its compiled side stays as stored."""
  from automap_rl.xla import fullsize

  name = "gpt-350m-8x2-a100-80g"
  case = fullsize.validation_case(name)
  problem = validate.trace_problem(
    case.make_workload(abstract=True), case.mesh, fullsize.validation_mesh(case).hardware
  )
  decisions = tactics.applicable(problem)["megatron"]
  stale = _metrics({"all-reduce": 1.0}, 1.0, 1.0, 1.0)
  check = fullsize.PlanCheck(
    case=name,
    devices=16,
    plan="megatron",
    searched=False,
    decisions=tuple(map(repr, decisions)),
    simulated=stale,
    compiled=stale,
    differences=0,
    seconds=1.0,
    family="gpt",
  )
  (priced,) = fullsize.resimulated([check])
  assert priced.compiled == stale
  assert priced.simulated["peak_memory"] == pytest.approx(
    float(problem.cost(decisions).peak_memory)
  )
  assert priced.simulated["comm_bytes"] == pytest.approx(
    validate.simulated_metrics(problem, decisions)["comm_bytes"]
  )


def test_merged_checks_are_compiled_again_case_by_case_without_searching(
  tmp_path, monkeypatch, capsys
):
  """A stored searched plan with stale figures on both sides: `--recompile` lowers and
  compiles it again (a small copy of the case here), keeps its name and searched flag,
  and measures what a fresh check measures."""
  from automap_rl.xla import fullsize
  from experiments import cli

  name, small = "mlp-8x8192-2x4-h100", "mlp:layers=2,width=64,in_dim=32,classes=8,batch=16"
  validation_case = fullsize.validation_case
  monkeypatch.setattr(
    fullsize,
    "validation_case",
    lambda case: dataclasses.replace(validation_case(case), workload=small),
  )
  case = fullsize.validation_case(name)
  workload = case.make_workload(abstract=True)
  problem = validate.trace_problem(workload, case.mesh, fullsize.validation_mesh(case).hardware)
  decisions = tactics.applicable(problem)["data_megatron"]
  fresh = fullsize.check_plan(name, problem, workload, "mcts@2000", decisions, searched=True)
  stale = {"comm_bytes": 1.0, "step_time": 1.0}
  stored = dataclasses.replace(fresh, simulated=stale, compiled=stale, family="mlp")
  merged, out = tmp_path / "stored.json", tmp_path / "again.json"
  merged.write_text(json.dumps({"checks": [dataclasses.asdict(stored)]}))
  assert (
    cli.main(
      ["validate", "--suite", "fullsize", "--merge", str(merged), "--recompile", "--json", str(out)]
    )
    == 0
  )
  (check,) = json.loads(out.read_text())["checks"]
  assert (check["plan"], check["searched"], check["decisions"]) == (
    "mcts@2000",
    True,
    list(fresh.decisions),
  )
  for side in ("simulated", "compiled"):
    assert check[side]["comm_bytes"] == pytest.approx(getattr(fresh, side)["comm_bytes"])
    assert check[side]["step_time"] == pytest.approx(getattr(fresh, side)["step_time"])
  assert "mlp-8x8192-2x4-h100: tracing, then one compile per plan" in capsys.readouterr().out


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--agents", "mcts@lots"], "--agents mcts@lots: the budget after @ must be a positive number"),
    (["--agents", "uct"], "--agents uct: unknown agent 'uct'"),
    (["--resume"], "--resume needs --json"),
    (["--merge", "missing.json"], "missing.json: not a `validate --suite fullsize --json` file"),
    (["--resimulate"], "--resimulate needs --merge"),
    (["--recompile"], "--recompile needs --merge"),
    (["--no-experts", "--agents"], "--no-experts needs --agents"),
  ],
)
def test_a_bad_fullsize_request_is_one_line_and_exit_2(argv, message, capsys):
  from experiments import cli

  assert (
    cli.main(["validate", "--suite", "fullsize", "--cases", "gpt-350m-8x2-a100-80g", *argv]) == 2
  )
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert message in line


def test_the_sampled_run_covers_every_family_on_8_to_64_devices():
  from automap_rl.xla import fullsize

  cases = [fullsize.validation_case(name) for name in fullsize.SAMPLED_CASES]
  for case in cases:  # Every workload builds, in float32.
    config = workloads.spec.make_config(case.workload)[1]
    assert getattr(config, "dtype", "float32") == "float32", case.name
  families = [c.family for c in cases]
  assert set(families) == set(workloads.FAMILIES) and all(
    families.count(f) >= 2 for f in workloads.FAMILIES
  )
  assert not set(fullsize.SAMPLED_CASES) & set(
    fullsize.FULLSIZE_CASES
  )  # Cases the simulator was not fitted to.
  devices = [c.make_mesh().num_devices for c in cases]
  assert min(devices) == 8 and max(devices) == 64
  assert {c.hardware.split("-")[0] for c in cases} == {"a100", "h100", "tpu"}


def test_draws_of_consecutive_seeds_meet_every_uncovered_family_and_repeat_for_a_seed():
  from automap_rl import workloads
  from automap_rl.xla.fullsize import FULLSIZE_CASES, SAMPLED_CASES
  from automap_rl.xla.fullsize_draw import MAX_DRAWN_DEVICES, drawn_cases

  family = {c.name: c.family for c in workloads.load_cases()}
  uncovered = {f for n, f in family.items() if n not in {*FULLSIZE_CASES, *SAMPLED_CASES}}
  draws = [drawn_cases(8, seed) for seed in range(3)]
  assert draws[0] == drawn_cases(8, 0)
  assert all(len({family[n] for n in d}) == 8 for d in draws)  # One family at a time.
  assert {family[n] for d in draws for n in d} == uncovered
  assert not {n for d in draws for n in d} & {*FULLSIZE_CASES, *SAMPLED_CASES}
  # Cases past what a CPU compiles (the published-scale ones, up to 1,024 devices) are
  # never drawn.
  devices = {c.name: c.make_mesh().num_devices for c in workloads.load_cases()}
  assert max(devices.values()) > MAX_DRAWN_DEVICES
  assert max(devices[n] for d in draws for n in d) <= MAX_DRAWN_DEVICES
