"""The published runs: every row's numbers agree with each other and with its source's,
and `bench published` prices the smallest row end to end."""

import dataclasses
import math

import pytest

from automap_rl.mesh import get_hardware, parse_mesh_spec
from automap_rl.pipeline import Pipeline
from automap_rl.workloads import model_flops, published
from automap_rl.workloads import spec as spec_lib
from experiments import bench_published
from experiments.cli import main

RUNS = {run.name: run for run in published.RUNS}


@pytest.mark.parametrize("run", published.RUNS, ids=lambda r: r.name)
def test_every_row_is_consistent(run):
  published.check(run)
  sizes = parse_mesh_spec(run.mesh)
  assert math.prod(sizes.values()) == run.devices
  assert run.batch % (run.plan.replicas * run.plan.microbatch_size) == 0
  _, config = spec_lib.make_config(run.model)
  if run.plan.pipeline > 1:
    assert config.layers % (run.plan.pipeline * run.plan.chunks) == 0
    microbatches = run.batch // (run.plan.replicas * run.plan.microbatch_size)
    assert microbatches >= run.plan.pipeline
  # A row that simulates another model than the paper's says how in its notes.
  if model_flops.simulated_shape(run.model) != run.shape:
    assert any("simulated for" in note for note in run.notes)


def test_there_are_runs_beyond_megatron_on_tpu_and_h100_dense_and_moe():
  others = [r for r in published.RUNS if not r.name.startswith("megatron-")]
  assert len(others) >= 4
  assert {r.hardware for r in others} >= {"h100", "tpu-v4", "tpu-v5e"}
  assert any(r.shape.experts > 1 for r in others)
  assert any(r.plan.fsdp > 1 or r.plan.zero for r in others)


@pytest.mark.parametrize(
  "run", [r for r in published.RUNS if r.name.startswith("megatron-")], ids=lambda r: r.name
)
def test_megatron_parameter_formula_gives_table_1s_sizes(run):
  params = model_flops.megatron_2021_params(run.shape, run.seq) / 1e9
  stated = run.stated_params / 1e9
  decimals = 0 if stated >= 1000 else 1
  assert round(params, decimals) == pytest.approx(stated)


@pytest.mark.parametrize("name", ["llama3-405b-8k", "palm-540b", "bloom-176b"], ids=lambda n: n)
def test_shapes_give_the_stated_parameter_counts(name):
  run = RUNS[name]
  assert run.shape.params() == pytest.approx(run.stated_params, rel=0.003)


def test_palm_mfu_definition_reproduces_its_46_2_percent():
  """PaLM, Appendix B: 238.3K tokens/s on 6144 TPU v4 chips at 275 TFLOP/s is 46.2% MFU."""
  run = RUNS["palm-540b"]
  per_token = run.published_flops() / (run.batch * run.seq)
  mfu = 238.3e3 * per_token / (run.devices * get_hardware("tpu-v4").flops["bfloat16"])
  assert mfu == pytest.approx(run.figure, abs=5e-4)


@pytest.mark.parametrize(
  ("name", "mfu"),
  [("maxtext-16b-v5e", 0.6110), ("maxtext-32b-v5e", 0.6686), ("maxtext-64b-v5e", 0.5990)],
)
def test_maxtext_tflops_and_mfu_agree_on_v5e_peak(name, mfu):
  run = RUNS[name]
  assert run.figure * 1e12 / get_hardware("tpu-v5e").flops["bfloat16"] == pytest.approx(
    mfu, abs=0.005
  )


def test_figure_of_is_the_formula_over_step_time_and_devices():
  run = RUNS["megatron-1.7b"]
  flops = run.published_flops()
  assert run.figure_of(flops, 2.0) == pytest.approx(flops / 2.0 / 32 / 1e12)
  palm = RUNS["palm-540b"]
  assert palm.figure_of(6144 * 275e12, 1.0) == pytest.approx(1.0)


def test_unknown_row_is_a_one_line_error(capsys):
  assert main(["bench", "published", "--rows", "megatron-1.7b,nope"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "unknown row(s) ['nope']" in err[0]
  with pytest.raises(ValueError, match="valid rows"):
    published.get(["nope"])


def test_smallest_row_priced_end_to_end():
  run = RUNS["megatron-1.7b"]
  problem, decisions, pipeline = published.build(run)
  # No pipeline stages: the batch of 512 runs as 16 microbatches of one sequence per replica.
  assert pipeline == Pipeline("data", stages=1, microbatches=16)
  assert {d.axis for d in decisions} == {"data"}
  row = bench_published.bench_row(run, bench_published.PublishedBenchConfig())
  assert row["simulated"] == pytest.approx(
    run.published_flops() / row["step_time_s"] / 32 / 1e12, rel=1e-6
  )
  assert row["ratio"] == pytest.approx(row["simulated"] / 137)
  assert row["fits"] and 0 < row["peak_memory_gb"] < 80
  assert row["step_time_s"] >= max(row["compute_s"], row["bubble_s"])
  assert "Narayanan" in bench_published.format_rows([row])


def test_a_row_runs_on_its_softwares_overlap_and_overlap_only_hides_communication():
  run = RUNS["megatron-3.6b"]
  assert not published.build_mesh(run).hardware.async_collectives
  assert published.build_mesh(RUNS["llama3-405b-8k"]).hardware.async_collectives
  costs = {}
  for overlap in (False, True):
    problem, decisions, pipeline = published.build(dataclasses.replace(run, overlap=overlap))
    costs[overlap] = problem.plan_cost(decisions, pipeline)
  assert float(costs[True].compute_time) == pytest.approx(float(costs[False].compute_time))
  assert float(costs[True].comm_time) < float(costs[False].comm_time)
  assert float(costs[True].peak_memory) == float(costs[False].peak_memory)


@pytest.mark.parametrize("split", ["sequence", "embedding"])
def test_split_activations_take_less_memory_and_need_a_size_that_splits(split):
  """On a pipeline, whose stages hold the activations of microbatches in flight."""
  run = RUNS["megatron-39.1b"]
  with_split = dataclasses.replace(run, plan=dataclasses.replace(run.plan, activation_split=split))
  published.check(with_split)
  peaks = [
    float(problem.plan_cost(decisions, pipeline).peak_memory)
    for problem, decisions, pipeline in map(published.build, (run, with_split))
  ]
  assert peaks[1] < peaks[0]
  odd = dataclasses.replace(
    with_split,
    plan=dataclasses.replace(with_split.plan, tensor=7),
    mesh="stage=2,data=32,model=7",
  )
  size = {"sequence": 2048, "embedding": 8192}[split]
  with pytest.raises(ValueError, match=f"{split} {size} does not split over tensor parallelism 7"):
    published.check(odd)
