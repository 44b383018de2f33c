"""Pipeline stages: layer stacks, stage placement, the typed pipeline cost terms, bad input."""

import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from automap_rl import ir, tactics, workloads
from automap_rl.ir.stacks import OUTSIDE, layer_stacks
from automap_rl.mesh import make_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.plan import Plan, cost_dict, plan_from_json, plan_to_json
from automap_rl.problem import Problem
from automap_rl.sharding import ArgDim, Decision, Group
from automap_rl.simulator import COMM_KINDS, PipelineCost
from automap_rl.stages import EVERY_STAGE, Phase, StagedProgram

GPT = "gpt:layers=4,d_model=32,heads=2,seq=16,vocab=64,batch=16"
LLAMA = "llama:layers=4,batch=16"  # Scanned layers (flax.nnx).
MESH = "data=4,fsdp=2,model=2"  # Stages over `data`; intra-op decisions over `fsdp` and `model`.
INNER_AXES = ("fsdp", "model")


@functools.cache
def problem(spec: str, mesh: str = MESH) -> Problem:
  return Problem.build(
    workloads.make_workload(spec, abstract=True).trace(), make_mesh(mesh, "h100")
  )


def expert_plan(p: Problem) -> list[Decision]:
  """data_megatron on the axes the stages leave: the batch over `fsdp`, Megatron over `model`."""
  return [Decision(d.target, "fsdp") for d in tactics.data_parallel(p)] + tactics.megatron(p)


@st.composite
def pipelined_plans(draw):
  """A workload, a pipeline over `data` and intra-op decisions over the other axes: the
  expert plan or random named-dimension decisions."""
  p = problem(draw(st.sampled_from([GPT, LLAMA])))
  if draw(st.booleans()):
    decisions = expert_plan(p)
  else:
    classes = st.integers(0, len(p.named.classes) - 1)
    decisions = [
      Decision(c, a)
      for c, a in draw(
        st.lists(st.tuples(classes, st.sampled_from(INNER_AXES)), min_size=1, max_size=10)
      )
    ]
  stages = draw(st.sampled_from([1, 2, 4]))
  schedule = draw(st.sampled_from(["gpipe", "1f1b"] + ["interleaved"] * (stages == 2)))
  chunks = 2 if schedule == "interleaved" else 1
  microbatches = draw(
    st.sampled_from([m for m in (1, 2, 4) if m % stages == 0 or schedule != "interleaved"])
  )
  return p, decisions, Pipeline("data", stages, microbatches, schedule, chunks)


def priced(p: Problem, decisions, pipeline: Pipeline) -> PipelineCost:
  """The pipelined cost; an example whose plan does not divide at microbatch size is
  rejected (after checking its error is the one-line divisibility error)."""
  try:
    return p.pipelined(pipeline).cost(decisions)
  except ValueError as e:
    assert "does not divide over" in str(e) and "\n" not in str(e)
    reject()


@settings(
  max_examples=24,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(pipelined_plans())
def test_pipelined_cost_is_the_sum_of_its_terms_and_memory_within_the_in_flight_activations(
  case,
):
  p, decisions, pipeline = case
  cost = priced(p, decisions, pipeline)
  t = cost.terms
  # Step time is the sum of its typed terms, exactly.
  assert (
    cost.step_time == t.steady_s + t.bubble_s + t.transfer_s + t.gradient_reduction_s + t.update_s
  )
  m, bubble_share = pipeline.microbatches, (pipeline.stages - 1) / pipeline.chunks
  microbatch = t.microbatch_compute_s + t.microbatch_comm_s
  # Every microbatch op runs in the stages' loop: the embedding and the head on their stages.
  assert np.allclose(t.loop_s, microbatch, rtol=1e-5)
  # The slowest stage sets the pace: M microbatches, and its loop in the bubble's iterations.
  pace_stage = np.argmax(m * microbatch + bubble_share * t.loop_s)
  assert t.pace_s == microbatch[pace_stage]
  assert t.steady_s == pytest.approx(m * t.pace_s)
  assert t.bubble_s == pytest.approx(bubble_share * t.loop_s[pace_stage])
  assert t.gradient_reduction_s + t.update_s == pytest.approx(
    (t.gradient_reduction_stage_s + t.update_stage_s).max()
  )
  assert cost.comm_time == pytest.approx(cost.step_time - cost.compute_time)
  assert len(cost.comm_bytes) == len(COMM_KINDS)
  assert (cost.comm_bytes[-1] > 0) == (
    pipeline.stages > 1
  )  # Collective-permutes between stages only.
  # Memory per stage: its one-microbatch peak plus its residual buffer, a slot per
  # microbatch in flight (none for one stage), plus the gradient sums.
  assert np.array_equal(t.residual_sets, t.in_flight if pipeline.stages > 1 else 0 * t.in_flight)
  assert np.allclose(
    t.peak_memory,
    t.live_bytes + t.gathered_bytes + t.residual_sets * t.residual_bytes + t.accumulator_bytes,
    rtol=1e-6,
  )
  assert cost.peak_memory == t.peak_memory.max()
  assert np.array_equal(t.in_flight, pipeline.in_flight())
  # ... never more than the unpipelined plan's plus the in-flight activations.
  unpipelined = p.cost(decisions)
  assert np.all(
    t.peak_memory
    <= unpipelined.peak_memory + t.in_flight * t.residual_bytes + t.accumulator_bytes + 1.0
  )


@settings(
  max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=pipelined_plans())
def test_one_stage_and_one_microbatch_is_todays_cost(case):
  p, decisions, _ = case
  trivial = Pipeline("data", 1, 1)
  today = p.cost(decisions)
  for name, value in cost_dict(p.plan_cost(decisions, trivial)).items():
    assert value == cost_dict(today)[name], name  # The same code path: equal, not close.
  # The pipeline's own terms price it alike: a signature's step and microbatch ops apart.
  staged = priced(p, decisions, trivial)
  assert staged.step_time == pytest.approx(today.step_time, rel=1e-3)
  assert staged.peak_memory == pytest.approx(today.peak_memory, rel=1e-6)
  assert np.allclose(staged.comm_bytes, today.comm_bytes, rtol=1e-6)


def test_more_microbatches_shrink_the_bubble_and_interleaving_divides_it():
  p = problem(GPT)
  plan = expert_plan(p)
  costs = {m: p.plan_cost(plan, Pipeline("data", 2, m)) for m in (1, 2, 4)}
  # The bubble runs a stage's loop (its layers), once per stage less one.
  assert [float(c.terms.bubble_s / c.terms.loop_s.max()) for c in costs.values()] == pytest.approx(
    [1, 1, 1]
  )
  bubbles = [
    float(c.terms.bubble_s / (c.terms.steady_s + c.terms.bubble_s)) for c in costs.values()
  ]
  assert bubbles[0] > bubbles[1] > bubbles[2]
  assert costs[4].terms.pace_s < costs[1].terms.pace_s
  interleaved = p.plan_cost(plan, Pipeline("data", 2, 4, "interleaved", chunks=2))
  assert interleaved.terms.bubble_s == pytest.approx(interleaved.terms.loop_s.max() / 2)
  gpipe, one_f_one_b = (p.plan_cost(plan, Pipeline("data", 2, 4, s)) for s in ("gpipe", "1f1b"))
  # The same microbatches and bubble; GPipe's loop runs one tick more (9 against 8): one
  # more transfer each way, one more write and read of its slot buffers.
  ticks = [Pipeline("data", 2, 4, s).ticks() for s in ("gpipe", "1f1b")]
  assert ticks == [9, 8]
  assert gpipe.terms.permute_bytes / one_f_one_b.terms.permute_bytes == pytest.approx(9 / 8)
  assert gpipe.terms.transfer_s >= one_f_one_b.terms.transfer_s
  assert gpipe.step_time > one_f_one_b.step_time
  assert gpipe.peak_memory > one_f_one_b.peak_memory
  # GPipe holds every microbatch's residuals before its first backward; the last stage runs
  # each microbatch's forward and backward at once.
  assert gpipe.terms.in_flight.tolist() == [4, 1]


def test_a_stage_of_a_proper_divisor_of_the_axis_keeps_the_rest_for_its_decisions():
  p = problem(GPT)
  pipeline = Pipeline("data", 2, 2)  # Two stages of two `data` devices each.
  plan = expert_plan(p)
  over_data = p.plan_cost([Decision(ArgDim("batch/inputs", 0), "data")] + plan, pipeline)
  assert over_data.terms.pace_s < p.plan_cost(plan, pipeline).terms.pace_s


def test_stage_placement_cuts_the_residual_stream():
  """Unrolled layers: what crosses a stage boundary is the residual stream forward and its
  gradient backward; scanned: the loop's carries; every op on a stage."""
  p = problem(GPT)
  staged = StagedProgram.build(p.program, p.named, p.mesh, Pipeline("data", 2, 4))
  shapes = sorted((t.backward, staged.program.values[t.value].shape) for t in staged.transfers)
  assert shapes == [(False, (4, 16, 32)), (True, (4, 16, 32))]
  assert set(staged.op_stage.tolist()) == {
    0,
    1,
  }  # Embedding on the first stage, head and loss on the last.
  assert staged.program.values[staged.program.inputs[-1]].shape == (4, 16)  # The microbatch.
  scanned = problem(LLAMA)
  staged = StagedProgram.build(scanned.program, scanned.named, scanned.mesh, Pipeline("data", 4, 2))
  assert all(t.stage == EVERY_STAGE for t in staged.transfers if not t.per_step)
  # The layers on every stage, each its own, in the stages' loop; the embedding on the first
  # stage and the head and loss on the last, per microbatch, in the loop too.
  assert set(staged.op_stage.tolist()) == {EVERY_STAGE, 0, 3}
  program = staged.program
  gathers = [op.id for op in program.ops if op.primitive == "gather"]
  # The embedding's lookup, then the loss's lookup of the labels' log-probabilities.
  assert staged.op_stage[gathers[0]] == 0 and staged.op_stage[gathers[-1]] == 3
  outside = staged.stack.op_layer == OUTSIDE
  assert set(staged.op_stage[outside & (staged.op_phase != Phase.STEP)].tolist()) == {0, 3}
  assert all(not t.per_step for t in staged.transfers)  # No weight is read on two stages.
  looped = staged.looped
  assert (
    looped[staged.op_phase != Phase.STEP].all() and not looped[staged.op_phase == Phase.STEP].any()
  )


def test_a_stage_slices_its_stacked_weights_and_stacks_their_gradients_in_every_iteration():
  """A stage runs its layers' loop in every iteration of the stages' loop, so what the
  loop body does with a layer's weights runs there too, not once per step: slicing each
  layer's weights out of the stack (per microbatch: its work reads them), stacking their
  gradients (accumulated); and their sums are those stacked gradients, as many bytes as
  the stage's layers' weights."""
  p = problem(LLAMA)
  staged = StagedProgram.build(p.program, p.named, p.mesh, Pipeline("data", 2, 4))
  program = staged.program
  stacked = set(staged.stack.stacked_inputs(program, p.named))
  weights = [v for v in stacked if program.values[v].role == ir.Role.PARAMETER]
  slices = [op for op in program.ops if op.primitive == "scan_slice" and op.operands[0] in weights]
  assert slices and all(
    staged.looped[op.id] and staged.op_phase[op.id] == Phase.MICROBATCH for op in slices
  )
  step_reads = {
    v for op in program.ops if staged.op_phase[op.id] == Phase.STEP for v in op.operands
  }
  gradients = [
    op for op in program.ops if op.primitive == "scan_stack" and op.results[0] in step_reads
  ]
  assert gradients and all(
    staged.looped[op.id] and staged.op_phase[op.id] == Phase.ACCUMULATED for op in gradients
  )
  # The sums the loop carries: per stage, the stage's layers' weight gradients; the first
  # stage's also the embedding's, the last's the head's (every other parameter's).
  tables = p.pipelined(Pipeline("data", 2, 4)).tables
  weight_bytes = sum(program.values[v].nbytes for v in weights)
  others = [
    v for v in program.inputs if program.values[v].role == ir.Role.PARAMETER and v not in stacked
  ]
  other_bytes = sum(program.values[v].nbytes for v in others)
  sums = tables.accumulator_bytes[:2].sum(axis=1)
  assert np.all(sums > weight_bytes)
  assert np.isclose(sums.sum(), 2 * weight_bytes + other_bytes, atol=16)  # And the loss's sum.


def test_layer_stacks_scanned_and_unrolled():
  for spec, scanned in ((GPT, False), (LLAMA, True), (GPT + ",scan=true,remat=true", True)):
    program = workloads.make_workload(spec, abstract=True).trace()
    (stack,) = layer_stacks(program, ir.analyze(program))
    assert (stack.scanned, stack.layers) == (scanned, 4)
    if not scanned:
      assert set(stack.op_layer[stack.op_layer != OUTSIDE].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(
  "spec,small,pipeline",
  [
    (GPT, GPT.replace("batch=16", "batch=4"), Pipeline("data", 1, 4)),
    (
      GPT + ",scan=true,remat=true",
      GPT.replace("layers=4", "layers=2").replace("batch=16", "batch=8") + ",scan=true,remat=true",
      Pipeline("data", 2, 2),
    ),
  ],
)
def test_the_microbatch_program_is_the_trace_at_microbatch_and_stage_size(spec, small, pipeline):
  """Shapes, factor sizes, trip counts and flops of everything read, as a trace gives them."""
  program = workloads.make_workload(spec, abstract=True).trace()
  staged = StagedProgram.build(
    program, ir.analyze(program), make_mesh(MESH, "h100"), pipeline
  ).program
  traced = workloads.make_workload(small, abstract=True).trace()
  assert staged.num_ops == traced.num_ops
  read = {v for op in traced.ops for v in op.operands} | set(traced.inputs) | set(traced.outputs)
  assert all(staged.values[v].shape == traced.values[v].shape for v in read)
  for a, b in zip(staged.ops, traced.ops):
    if set(b.results) & read:
      assert (a.rule.factor_sizes, a.repeat) == (
        b.rule.factor_sizes,
        b.repeat,
      ) and a.flops == pytest.approx(b.flops)


def one_line_error(fn, match: str) -> None:
  with pytest.raises(ValueError, match=match) as e:
    fn()
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "pipeline,match",
  [
    (lambda: Pipeline("pipe", 2), "pipeline axis 'pipe' is not a mesh axis"),
    (lambda: Pipeline("data", 3), "stages=3 does not divide the 4 devices of mesh axis 'data'"),
    (lambda: Pipeline("data", 2, 32), "microbatches=32 is more than the batch of 16"),
    (lambda: Pipeline("data", 2, 3), "microbatches=3 does not divide the batch of 16"),
    (
      lambda: Pipeline("data", 4, 8, "interleaved", chunks=2),
      r"4 stages x 2 chunks do not divide the 4 layers",
    ),
    (
      lambda: Pipeline("data", 2, stack=1),
      r"stack=1 but the program has 1 layer stack\(s\): 0: unrolled stack",
    ),
    (lambda: Pipeline("data", 2, layers_per_chunk=(1, 2)), r"layers_per_chunk=\[1, 2\] sums to 3"),
  ],
)
def test_bad_pipelines_get_one_line_errors(pipeline, match):
  p = problem(GPT)
  one_line_error(lambda: p.pipelined(pipeline()), match)


def test_bad_pipeline_fields_get_one_line_errors():
  one_line_error(
    lambda: Pipeline("data", 2, schedule="zero-bubble"),
    "unknown pipeline schedule 'zero-bubble'; valid schedules: gpipe, 1f1b, interleaved",
  )
  one_line_error(lambda: Pipeline("data", 0), "pipeline stages=0 must be a positive integer")
  one_line_error(
    lambda: Pipeline("data", 4, 6, "interleaved", chunks=2), r"multiple of stages \(4\)"
  )
  one_line_error(lambda: Pipeline("data", 2, chunks=2), "chunks=2 needs the interleaved schedule")
  one_line_error(
    lambda: Pipeline.from_json({"axis": "data", "stages": 2, "stage": 1}), r"unknown pipeline key"
  )


def test_layer_counts_and_uneven_scanned_stages_get_one_line_errors():
  p = problem(GPT.replace("layers=4", "layers=3"))
  one_line_error(
    lambda: p.pipelined(Pipeline("data", 2)),
    "2 stages do not divide the 3 layers of the unrolled stack",
  )
  p.pipelined(Pipeline("data", 2, layers_per_chunk=(2, 1)))  # Unrolled layers may split unevenly.
  scanned = problem(LLAMA)
  one_line_error(
    lambda: scanned.pipelined(Pipeline("data", 2, layers_per_chunk=(3, 1))),
    "a scanned layer stack splits into equal chunks only",
  )


def test_a_program_without_repeated_layers_says_what_was_looked_for():
  program = ir.trace(lambda x, w: jnp.tanh(x @ w).sum(), jnp.ones((16, 8)), jnp.ones((8, 8)))
  p = Problem.build(program, make_mesh(MESH, "h100"))
  one_line_error(
    lambda: p.pipelined(Pipeline("data", 2)),
    "no repeated layer stack to pipeline: looked for a loop \\(scan\\) whose body slices stacked "
    "parameters, or groups of two or more per-layer parameter dimensions",
  )


def test_decisions_on_the_stage_axis_and_indivisible_microbatches_get_one_line_errors():
  p = problem(GPT)
  batch = ArgDim("batch/inputs", 0)
  one_line_error(
    lambda: p.plan_cost([Decision(batch, "data")], Pipeline("data", 4, 2)),
    "shards over mesh axis 'data', which the pipeline's 4 stages take whole",
  )
  one_line_error(
    lambda: p.plan_cost(
      [Decision(batch, "fsdp"), Decision(batch, "model")], Pipeline("data", 2, 8)
    ),
    r"dim 0 of batch/inputs \[2, 16\] .* does not divide over \('fsdp', 'model'\)",
  )


def test_plan_carries_its_pipeline_and_json_round_trips_it():
  workload = workloads.make_workload(GPT, abstract=True)
  p = problem(GPT)
  decisions = expert_plan(p) + [Decision(Group(0), "model"), Decision(3, "fsdp")]
  pipeline = Pipeline("data", 2, 2, "interleaved", chunks=2)
  plan = Plan(workload.step, workload.args, p, decisions, pipeline=pipeline)
  assert isinstance(plan.cost, PipelineCost) and str(pipeline) in plan.report()
  assert cost_dict(plan.cost)["comm_bytes"]["collective-permute"] > 0
  assert plan_from_json(json.loads(json.dumps(plan.to_json()))) == (decisions, pipeline)
  assert plan_from_json(plan_to_json(decisions)) == (decisions, None)
  for run in (plan.jit, plan.lower):
    with pytest.raises(ValueError, match="pass the loss function and optimizer"):
      run()
  one_line_error(
    lambda: Plan(workload.step, workload.args, p, decisions, pipeline=Pipeline("data", 3)),
    "stages=3 does not divide",
  )
  unpipelined = Plan(workload.step, workload.args, p, decisions, pipeline=Pipeline("data", 1, 1))
  assert cost_dict(unpipelined.cost) == cost_dict(p.cost(decisions))


@pytest.mark.parametrize("weight_dim, manual", [(None, True), (0, True), (1, False)])
def test_the_loop_is_manual_over_the_batch_axes_unless_a_stacked_weight_is_split_over_them(
  weight_dim, manual
):
  """`manual_axes`: the batch over `fsdp` keeps the pipelined loop manual over `fsdp`
  (its layers' gradients reduced once), also with a stacked weight split over `fsdp` on
  its layer dim (gathered before the loop), not with one split over it on another dim.
  Tables padded for a mixed batch (`envs.pipelines`: -1 for stacked weights a program
  lacks) decide the same."""
  from automap_rl.simulator.pipeline import manual_axes

  p = problem(GPT + ",scan=true")
  decisions = [Decision(d.target, "fsdp") for d in tactics.data_parallel(p)]
  if weight_dim is not None:
    decisions.append(Decision(ArgDim("params/blocks/mlp/fc1/kernel", weight_dim), "fsdp"))
  staged = p.pipelined(Pipeline("data", 2, 2, "gpipe"))
  mask = staged.resolution(decisions).value_mask
  fsdp = 1 << p.mesh.axis_index("fsdp")
  padded = staged.tables.replace(
    stacked_signatures=np.concatenate([staged.tables.stacked_signatures, [-1, -1]])
  )
  assert (
    int(manual_axes(staged.tables, mask))
    == int(manual_axes(padded, mask))
    == (fsdp if manual else 0)
  )
