"""Pipelined plans run: a GPipe lowering of a scanned GPT computes the unpartitioned step's
numbers, moves activations between stages with collective-permutes over the stage axis and
stores the stacked weights split over it."""

import dataclasses
import functools

import pytest

from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.plan import Plan
from automap_rl.problem import Problem

GPT = "gpt:layers=4,d_model=64,heads=4,seq=16,vocab=64,batch=8,scan=true"


@functools.cache
def workload() -> workloads.Workload:
  return workloads.make_workload(GPT)


@functools.cache
def problem(mesh: str) -> Problem:
  return Problem.build(workload().trace(), make_mesh(mesh, "h100"))


def pipelined_plan(mesh: str, tactic, microbatches: int, bare: bool = False) -> Plan:
  """The tactic's plan on `mesh`, run as GPipe with `microbatches`."""
  p = problem(mesh)
  decisions, pipeline = tactic(p)
  pipeline = dataclasses.replace(pipeline, microbatches=microbatches, schedule="gpipe")
  w = workload()
  training = {} if bare else {"loss_fn": w.loss_fn, "optimizer": w.optimizer}
  return Plan(w.step, w.args, p, decisions, pipeline=pipeline, **training)


@pytest.mark.parametrize("mesh,tactic,microbatches", [
    ("stage=2,data=2,model=2", tactics.megatron_3d, 4),
    ("stage=2,data=2,model=2", tactics.megatron_3d, 8),
    ("stage=4,data=2", tactics.pipeline, 4),
    ("stage=4,data=2", tactics.pipeline, 8),
])
def test_pipelined_gpt_matches_the_unpartitioned_step(mesh, tactic, microbatches):
  plan = pipelined_plan(mesh, tactic, microbatches)
  assert plan.pipeline.stages == plan.mesh.axis_size("stage")
  lowered = plan.check()  # Outputs, parameters and optimizer state against the unpartitioned step.
  in_loop = [c for c in lowered.stats.collectives if c.kind == "collective-permute" and c.repeat > 1]
  assert len(in_loop) >= 2 and all(c.mesh_axes == ("stage",) for c in in_loop)  # Forward and backward transfers.
  assert all(c.repeat == microbatches + plan.pipeline.stages - 1 for c in in_loop)
  stacked = lowered.in_shardings[0]["blocks"]["mlp"]["fc1"]["kernel"]  # [L, d_model, hidden]
  assert stacked.spec[0] == "stage" or stacked.spec[0][0] == "stage"
  assert stacked.shard_shape((4, 64, 256))[0] == 4 // plan.pipeline.stages
  assert lowered.out_shardings[0]["blocks"]["mlp"]["fc1"]["kernel"] == stacked
  mu = lowered.in_shardings[1][0].mu["blocks"]["mlp"]["fc1"]["kernel"]  # Adam's state follows its weight.
  assert mu == stacked


def test_pipelined_gpt_jit_runs_with_the_plans_shardings():
  plan = pipelined_plan("stage=4,data=2", tactics.pipeline, 4)
  params, opt_state, loss = plan.jit()(*workload().args)
  assert params["blocks"]["attn"]["query"]["kernel"].sharding.spec[0] == "stage"
  assert float(loss) > 0


def test_bare_step_pipeline_plan_says_what_to_pass():
  plan = pipelined_plan("stage=2,data=2,model=2", tactics.megatron_3d, 4, bare=True)
  for run in (plan.jit, plan.check):
    with pytest.raises(ValueError, match="pass the loss function and optimizer it is built from") as e:
      run()
    assert "\n" not in str(e.value)


def test_partition_with_the_forward_gives_a_pipelined_plan_that_runs():
  """`partition(..., loss_fn=, optimizer=)` with a pipelined tactic: the plan jits and checks."""
  import agents
  from automap_rl import workloads

  w = workloads.make_workload("gpt:layers=4,d_model=64,heads=4,seq=16,vocab=64,batch=8,scan=true")
  plan = agents.partition(w.step, *w.args, mesh="data=2,fsdp=2,model=2", agent="megatron_3d",
                          arg_names=w.arg_names, arg_roles=w.arg_roles, loss_fn=w.loss_fn, optimizer=w.optimizer)
  assert plan.pipeline is not None and plan.pipeline.stages == 2
  plan.check()  # Raises NumericsError on a mismatch.
