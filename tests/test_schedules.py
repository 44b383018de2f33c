"""Pipelines run as they are priced: gradient accumulation (one stage), 1F1B and the
interleaved schedule compute the unpartitioned step's numbers, with the first stage
embedding and the last computing head and loss per microbatch; their tick tables keep
the microbatches in flight that Megatron-LM's schedules keep."""

import functools

import numpy as np
import pytest

from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.plan import Plan
from automap_rl.problem import Problem
from automap_rl.xla.schedules import BACKWARD, FORWARD, FORWARD_BACKWARD, tick_table

GPT = "gpt:layers=4,d_model=64,heads=4,seq=16,vocab=64,batch=8,scan=true"
FAMILIES = {
  "gpt": GPT,
  "llama": "llama:layers=4,d_model=64,heads=4,kv_heads=2,d_ff=128,seq=16,vocab=64,batch=8",
  "ssm": "ssm:layers=4,d_model=32,seq=16,vocab=64,batch=8",
  # Its blocks unrolled: the loss's repeated segments are the stack.
  "gpt-unrolled": GPT.replace(",scan=true", ""),
}


def test_1f1b_keeps_s_minus_s_microbatches_in_flight_and_gpipe_all_of_them():
  one_f = tick_table(Pipeline("stage", 4, 8, "1f1b"))
  # The last stage runs forward, head, loss and backward of a microbatch in one tick.
  assert one_f.in_flight().tolist() == [4, 3, 2, 0]
  assert (one_f.kind[:, 3] != FORWARD).all() and (one_f.kind[:, 3] != BACKWARD).all()
  assert (one_f.kind[:, 3] == FORWARD_BACKWARD).sum() == 8
  assert tick_table(Pipeline("stage", 4, 8, "gpipe")).in_flight().tolist() == [8, 8, 8, 0]
  # Every stage runs each microbatch's forward and backward once.
  for s in range(3):
    assert (one_f.kind[:, s] == FORWARD).sum() == (one_f.kind[:, s] == BACKWARD).sum() == 8


def test_interleaved_keeps_megatrons_warm_up_count_in_flight():
  pipeline = Pipeline("stage", 4, 8, "interleaved", chunks=2)
  ticks = tick_table(pipeline)
  # Chunk-microbatches; the pricing counts them in units of a stage's whole share (1 / V).
  priced = pipeline.in_flight() * pipeline.chunks
  assert ticks.in_flight()[:-1].tolist() == priced[:-1].tolist()
  assert np.all(ticks.in_flight() <= priced)


@pytest.mark.parametrize(
  "pipeline",
  [
    Pipeline("stage", 4, 8, "1f1b"),
    Pipeline("stage", 4, 8, "gpipe"),
    Pipeline("stage", 4, 8, "interleaved", chunks=2),
    Pipeline("stage", 2, 4, "1f1b"),
  ],
  ids=str,
)
def test_the_residual_buffer_has_a_slot_per_set_in_flight_and_no_tick_overwrites_one(pipeline):
  """A stage's residual buffer has as many slots as it holds residual sets at once (no
  scratch slot: a microbatch's residuals cost their size once per set in flight). Every
  tick writes its `save` slot: a forward into a free slot, a backward the slot it loads,
  any other operation what the slot holds; a backward finds there its microbatch's
  residuals."""
  ticks = tick_table(pipeline)
  assert ticks.slots[2] == max(1, ticks.in_flight().max())
  for s in range(pipeline.stages):
    held: list[tuple[int, int] | None] = [None] * ticks.slots[2]
    for t in range(ticks.ticks):
      kind, save, load = ticks.kind[t, s], ticks.save[t, s], ticks.load[t, s]
      op = (int(ticks.micro[t, s]), int(ticks.chunk[t, s]))
      if kind == FORWARD:
        assert held[save] is None
        held[save] = op
      elif kind == BACKWARD:
        assert save == load and held[load] == op
        held[load] = None
    assert held == [None] * ticks.slots[2]


@functools.cache
def _problem(spec: str, mesh: str) -> tuple[workloads.Workload, Problem]:
  w = workloads.make_workload(spec)
  return w, Problem.build(w.trace(), make_mesh(mesh, "h100"))


def _check(spec: str, mesh: str, pipeline: Pipeline):
  w, p = _problem(spec, mesh)
  decisions = tactics.data_megatron(p) if pipeline.stages == 1 else tactics.pipeline(p)[0]
  plan = Plan(
    w.step, w.args, p, decisions, pipeline=pipeline, loss_fn=w.loss_fn, optimizer=w.optimizer
  )
  return plan, plan.check()  # Raises NumericsError on a mismatch with the unpartitioned step.


CASES = {
  "accumulation": ("data=2,model=4", Pipeline("data", 1, 4)),
  "1f1b": ("stage=4,data=2", Pipeline("stage", 4, 4, "1f1b")),
  "interleaved": ("stage=2,data=2,model=2", Pipeline("stage", 2, 4, "interleaved", chunks=2)),
}


@pytest.mark.parametrize(
  "family,case",
  [
    pytest.param(
      f, c, marks=[] if (f, c) in {("gpt", c), ("gpt-unrolled", "1f1b")} else [pytest.mark.slow]
    )
    for f in sorted(FAMILIES)
    for c in sorted(CASES)
  ],
)
def test_scheduled_step_matches_the_unpartitioned_step(family, case):
  mesh, pipeline = CASES[case]
  plan, lowered = _check(FAMILIES[family], mesh, pipeline)
  assert lowered.schedule == ("accumulation" if pipeline.stages == 1 else pipeline.schedule)
  if pipeline.stages > 1:
    # Activations and gradients cross between stages once a tick each way, a microbatch's
    # [8 / M rows, seq 16, width] at a time (its rows over `data` where they divide).
    permutes = [
      c
      for c in lowered.stats.collectives
      if c.kind == "collective-permute" and c.mesh_axes == ("stage",) and c.repeat > 1
    ]
    ticks = tick_table(pipeline).ticks
    assert len(permutes) >= 2 and all(c.repeat == ticks for c in permutes)


@pytest.mark.parametrize(
  "spec,mesh,pipeline,why",
  [
    # Batch norm: each microbatch normalized by its own statistics is not the step.
    (
      "wresnet:width=4,image_size=16",
      "stage=2,data=4",
      Pipeline("stage", 2, 4, "1f1b"),
      r"model state \(batch norm\) are not pipelined: each microbatch would be normalized",
    ),
    (
      "wresnet:width=4,image_size=16",
      "stage=2,data=4",
      Pipeline("data", 1, 4),
      r"model state \(batch norm\) are not accumulated",
    ),
  ],
)
def test_what_is_not_lowered_says_why_in_one_line(spec, mesh, pipeline, why):
  w, p = _problem(spec, mesh)
  plan = Plan(w.step, w.args, p, [], pipeline=pipeline, loss_fn=w.loss_fn, optimizer=w.optimizer)
  with pytest.raises(NotImplementedError, match=why) as e:
    plan.jit()
  assert "\n" not in str(e.value)


def test_the_priced_tick_count_is_the_tick_tables():
  for stages in (2, 3, 4, 8):
    for microbatches in (1, 2, 3, 4, 8, 16):
      pipelines = [Pipeline("stage", stages, microbatches, s) for s in ("gpipe", "1f1b")]
      if microbatches % stages == 0:
        pipelines += [Pipeline("stage", stages, microbatches, "interleaved", chunks=2)]
      for pipeline in pipelines:
        assert pipeline.ticks() == tick_table(pipeline).ticks, pipeline


def _checked_stage_permutes(plan: Plan, axis: str):
  """`plan.check()` (NumericsError on a mismatch with the unpartitioned step), which ran
  1F1B, and the collective-permutes over the stage `axis` it runs every tick."""
  lowered = plan.check()
  assert lowered.schedule == "1f1b"
  permutes = [
    c
    for c in lowered.stats.collectives
    if c.kind == "collective-permute" and c.mesh_axes == (axis,) and c.repeat > 1
  ]
  return lowered, permutes


def test_fewer_stages_than_the_axis_has_devices_run_with_the_rest_inside_the_stages():
  """Two stages on the four devices of `stage`: the mesh's stage axis is split in two, the
  stages over one part (`stage_stages`), the plan's decisions over the other, here the
  batch's rows (over the rest of `stage` and over `data`)."""
  from automap_rl.sharding import ArgDim, Decision

  w, p = _problem(GPT, "stage=4,data=2")
  pipeline = Pipeline("stage", 2, 2, "1f1b")
  decisions = [Decision(ArgDim("batch/inputs", 0), a) for a in ("stage", "data")]
  plan = Plan(
    w.step, w.args, p, decisions, pipeline=pipeline, loss_fn=w.loss_fn, optimizer=w.optimizer
  )
  _, permutes = _checked_stage_permutes(plan, "stage_stages")
  # A microbatch's [4 rows over 4 devices, seq 16, d_model 64] each way, once a tick (GPT's
  # per-layer auxiliary losses travel with the activations).
  assert all(c.repeat == pipeline.ticks() for c in permutes)
  assert sum(c.bytes == 1 * 16 * 64 * 4 for c in permutes) >= 2


def test_a_rematerialized_stack_pipelined_over_the_batch_axis_with_tensor_parallel_layers():
  """Llama's rematerialized layers, 1F1B over `data` with the MLP's hidden dim and the
  key/value heads over `model`: the backward of each tick rebuilds the chunk's pullback
  from the residuals its forward saved, of one structure wherever the chunk is traced,
  and the stages pass each other the activations only."""
  from automap_rl.sharding import ArgDim, Decision

  spec = FAMILIES["llama"] + ",remat=true"
  w, p = _problem(spec, "data=4,model=2")
  pipeline = Pipeline("data", 4, 4, "1f1b")
  layers = "params/layers"
  decisions = [
    Decision(ArgDim(f"{layers}/mlp/gate_proj/kernel/value", 2), "model"),
    Decision(ArgDim(f"{layers}/attn/k_proj/kernel/value", 2), "model"),
  ]
  plan = Plan(
    w.step, w.args, p, decisions, pipeline=pipeline, loss_fn=w.loss_fn, optimizer=w.optimizer
  )
  lowered, permutes = _checked_stage_permutes(plan, "data")
  # Once a tick each way, a microbatch's activations [8 / M rows, seq 16, d_model 64] and
  # nothing else: the module state the rematerialized layers return per layer, which the
  # loss does not read, stays on its stage.
  assert all(c.repeat == pipeline.ticks() for c in permutes)
  assert [c.bytes for c in permutes] == [2 * 16 * 64 * 4] * 2
  assert any("model" in c.mesh_axes for c in lowered.stats.collectives)
