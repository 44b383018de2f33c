"""The alpa agent: pipeline stages over one mesh axis, expert plans inside, Alpa's layer DP."""

import dataclasses
import functools

import numpy as np
import pytest
from toy_hardware import H100_WORK_ONLY

import agents
from agents import AlpaConfig, Seconds, Simulations, alpa
from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem

GPT = "gpt:layers=8,d_model=256,heads=8,seq=128,vocab=512,batch=32"
SCANNED = GPT + ",scan=true"
HEAD_HEAVY = (
  "gpt:layers=8,d_model=128,heads=4,seq=128,vocab=8192,batch=32"  # The head costs about 5 layers.
)
MESH = "data=8x1,model=4"  # The data axis across 8 nodes (DCN): pipeline stages pay.
CONFIG = AlpaConfig(microbatches=(4, 8))  # Fewer pipelines to build: the tests stay quick.


@functools.cache
def problem(spec: str) -> Problem:
  return Problem.build(
    workloads.make_workload(spec, abstract=True).trace(), make_mesh(MESH, H100_WORK_ONLY)
  )


@functools.cache
def planned(spec: str) -> agents.SearchResult:
  return alpa.search(problem(spec), CONFIG, seed=0, budget=100_000)


def best_balanced(p: Problem) -> float:
  """The fastest plan that fits among balanced 1F1B pipelines of 8 microbatches with each
  expert inside (less its decisions on a stage axis the stages take whole)."""
  best = np.inf
  for axis, stages in (("data", 4), ("data", 2), ("model", 2)):
    pipeline = Pipeline(axis, stages, 8)
    for plan in tactics.applicable(p).values():
      inside = [d for d in plan if d.axis != axis or p.mesh.axis_size(axis) > stages]
      try:
        cost = p.plan_cost(inside, pipeline)
      except ValueError:  # The microbatch does not divide over the plan's axes.
        continue
      if cost.fits:
        best = min(best, float(cost.step_time))
  return best


@pytest.mark.parametrize("spec", [pytest.param(GPT, marks=pytest.mark.slow), SCANNED])
def test_never_worse_than_the_best_balanced_pipeline_or_any_expert(spec):
  p, result = problem(spec), planned(spec)
  expert = tactics.best_expert_plan(p)
  assert expert.fits and result.cost.fits and result.stopped_by is None
  assert result.step_time <= float(expert.cost.step_time) * (1 + 1e-6)
  assert result.step_time <= best_balanced(p) * (1 + 1e-6)
  for plan, pipeline in tactics.applicable_pipelines(p).values():  # megatron_3d, ...
    cost = p.plan_cost(plan, pipeline)
    assert not cost.fits or result.step_time <= float(cost.step_time) * (1 + 1e-6)
  assert result.pipeline is not None and result.pipeline.stages > 1  # Stages pay on this mesh.
  assert float(result.cost.step_time) == float(
    p.plan_cost(result.decisions, result.pipeline).step_time
  )
  if spec == SCANNED:  # A scanned stack splits evenly only.
    assert result.pipeline.layers_per_chunk is None
  else:  # The last stage carries the head: never more layers than another.
    layers = result.pipeline.chunk_layers(8)
    assert layers[-1] <= min(layers)


def test_the_last_stage_carrying_the_head_gets_fewer_layers():
  """Alpa's layer DP on a 1F1B pipeline of the head-heavy GPT (2 stages over `data`, data
  parallel inside): from the even split and one with a layer moved, the last stage,
  which carries the head, gets fewer layers, priced faster than the even split."""
  p = problem(HEAD_HEAVY)
  plan = tactics.applicable(p)["data_parallel"]
  even = Pipeline("data", 2, 8, "1f1b", layers_per_chunk=(4, 4))
  moved = dataclasses.replace(even, layers_per_chunk=(5, 3))
  a, b = p.plan_cost(plan, even), p.plan_cost(plan, moved)
  time_line, memory_line = alpa.stage_lines(a.terms, b.terms, np.array([4, 4]), np.array([5, 3]))
  split = alpa.balance(8, *time_line, *memory_line, float(p.tables.hbm_bytes))
  assert split is not None and split[-1] < split[0]
  balanced = p.plan_cost(plan, dataclasses.replace(even, layers_per_chunk=split))
  assert float(balanced.step_time) < float(a.step_time)


def test_the_layer_dp_balances_the_slowest_stage_within_memory():
  time_offset, slope = (
    np.array([0.0, 0.0, 3.0]),
    np.ones(3),
  )  # The last stage carries 3 layers' worth of head.
  free = np.zeros(3)
  assert alpa.balance(12, time_offset, slope, free, free, 1.0) == (5, 5, 2)
  # Each layer takes 1 byte on stage 0 (its activations in flight), so it may hold 4 at most.
  memory_slope = np.array([1.0, 0.0, 0.0])
  assert alpa.balance(12, time_offset, slope, free, memory_slope, 4.0) == (4, 6, 2)
  assert alpa.balance(12, time_offset, slope, np.full(3, 2.0), free, 1.0) is None
  assert alpa.balance(3, time_offset, slope, free, free, 1.0) == (1, 1, 1)


def test_same_seed_same_plan_and_the_budget_says_what_stopped_it():
  p = problem(GPT)
  a, b = (alpa.search(p, CONFIG, seed=1, budget=Simulations(20)) for _ in range(2))
  assert (a.decisions, a.pipeline, a.step_time) == (b.decisions, b.pipeline, b.step_time)
  assert a.simulations == 20 and a.stopped_by == "simulations"
  assert (
    alpa.search(p, CONFIG, budget=Simulations(20), seed=7).decisions == a.decisions
  )  # Deterministic.
  stopped = alpa.search(p, CONFIG, budget=Seconds(0.01))
  assert stopped.stopped_by == "seconds" and stopped.simulations >= 1
  assert float(stopped.cost.step_time) == float(
    p.plan_cost(stopped.decisions, stopped.pipeline).step_time
  )


def test_partition_returns_a_pipelined_plan_whose_report_shows_the_pipeline_terms():
  workload = workloads.make_workload(SCANNED, abstract=True)
  plan = agents.partition(
    workload.step,
    *workload.args,
    mesh=MESH,
    hardware=H100_WORK_ONLY,
    agent="alpa",
    budget=100_000,
    config=CONFIG,
    arg_names=workload.arg_names,
    arg_roles=workload.arg_roles,
  )
  assert plan.pipeline == planned(SCANNED).pipeline
  report = plan.report()
  assert str(plan.pipeline) in report and "bubble" in report
