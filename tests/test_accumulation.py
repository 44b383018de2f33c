"""Gradient accumulation runs as it is priced: the sums reduced over the batch axes once a
step, and weights stored split over them (ZeRO) gathered once a step with
`Pipeline.gather_weights_once`; the compiled collectives are the simulator's."""

import functools

import numpy as np
import pytest

from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.plan import Plan
from automap_rl.problem import Problem

GPT = "gpt:layers=4,d_model=64,heads=4,seq=16,vocab=64,batch=64,scan=true"
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2  # `simulator.COMM_KINDS` order.


@functools.cache
def _problem(mesh: str) -> tuple[workloads.Workload, Problem]:
  w = workloads.make_workload(GPT)
  return w, Problem.build(w.trace(), make_mesh(mesh, "h100"))


def _plan(mesh: str, tactic, microbatches: int, once: bool) -> Plan:
  w, p = _problem(mesh)
  pipeline = Pipeline("data", 1, microbatches, gather_weights_once=once)
  return Plan(w.step, w.args, p, tactic(p), pipeline=pipeline, loss_fn=w.loss_fn,
              optimizer=w.optimizer)  # fmt: skip


def _compiled_bytes(plan: Plan) -> dict[str, float]:
  """Per kind, the bytes over `data` a compiled step moves, loops' repeats counted, after
  its numerics check against the unpartitioned step."""
  out: dict[str, float] = {}
  for c in plan.check().stats.collectives:
    if c.mesh_axes == ("data",):
      out[c.kind] = out.get(c.kind, 0.0) + c.bytes * c.repeat
  return out


def test_data_parallel_accumulation_all_reduces_its_gradients_once_a_step():
  plan = _plan("data=8", tactics.data_parallel, 4, once=False)
  compiled = _compiled_bytes(plan)
  assert set(compiled) == {"all-reduce"}
  assert compiled["all-reduce"] == pytest.approx(float(plan.cost.comm_bytes[ALL_REDUCE]), 1e-3)


def test_zero_weights_gathered_once_a_step_move_the_priced_bytes():
  plan = _plan("data=4,model=2", tactics.fsdp, 4, once=True)
  compiled = _compiled_bytes(plan)
  sim = np.asarray(plan.cost.comm_bytes)
  assert compiled["all-gather"] == pytest.approx(sim[ALL_GATHER], 1e-2)
  assert compiled["reduce-scatter"] == pytest.approx(sim[REDUCE_SCATTER], 1e-2)


@pytest.mark.parametrize("microbatches", [2, 4, 8])
def test_gathering_once_prices_one_gather_and_one_reduction_whatever_the_microbatches(
  microbatches,
):
  """ZeRO storage per microbatch gathers and reduces M times; gathered once, once, at the
  cost of holding the weights and their sums whole."""
  once = _plan("data=4,model=2", tactics.fsdp, microbatches, once=True).cost
  each = _plan("data=4,model=2", tactics.fsdp, microbatches, once=False).cost
  single = _plan("data=4,model=2", tactics.fsdp, 2, once=True).cost
  for kind in (ALL_GATHER, REDUCE_SCATTER):
    assert float(once.comm_bytes[kind]) == pytest.approx(float(single.comm_bytes[kind]))
  # Per microbatch, the weights are gathered in the forward and the backward pass.
  assert float(each.comm_bytes[ALL_GATHER]) >= microbatches * float(once.comm_bytes[ALL_GATHER])
  assert float(each.comm_bytes[REDUCE_SCATTER]) == pytest.approx(
    microbatches * float(once.comm_bytes[REDUCE_SCATTER]), 1e-3
  )
  assert float(once.peak_memory) > float(each.peak_memory)
