"""A pipelined Mamba SSM priced as XLA compiles it: its embedding is also its output
projection, a weight the first stage owns and the last stage reads. The head's gradient of
it runs on the last stage, where the head's activations and their gradients are, and is
summed over the stage axis once a step; only the residual stream and its gradient cross
between stages in every tick."""

import functools

import pytest

from automap_rl.hardware import HARDWARE
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import ArgDim, Decision
from automap_rl.stages import Phase, StagedProgram
from automap_rl.workloads.spec import make_workload

SSM = "ssm:layers=8,d_model=32,seq=32,batch=16,vocab=256"
MESH = "data=2,model=4"
PIPELINE = Pipeline("model", 4, 4, "1f1b")
# A searched plan of the full-size SSM (ssm-790m-4x4-tpu-v4): the batch, the layer dims of
# the input, output and B/C/step-size projections' stacked weights, and the vocabulary
# over `data`; four stages over `model`.
PLAN = [
  Decision(ArgDim("batch/inputs", 0), "data"),
  Decision(ArgDim("params/layers/mixer/out_proj/weight", 0), "data"),
  Decision(ArgDim("params/layers/mixer/in_proj/weight", 0), "data"),
  Decision(ArgDim("params/layers/mixer/x_proj/weight", 0), "data"),
  Decision(ArgDim("params/embedding/weight", 0), "data"),
]


@functools.cache
def _case():
  from automap_rl.mesh import make_mesh
  from automap_rl.xla.validate import trace_workload

  workload = make_workload(SSM, abstract=True)
  hardware = HARDWARE["tpu-v4"].compiled_by(HARDWARE["cpu"])
  return workload, Problem.build(trace_workload(workload), make_mesh(MESH, hardware))


def test_the_heads_gradient_of_the_tied_embedding_runs_on_the_last_stage():
  _, problem = _case()
  staged = StagedProgram.build(problem.program, problem.named, problem.mesh, PIPELINE)
  program, last = staged.program, PIPELINE.stages - 1
  embedding = next(v for v in program.inputs if program.values[v].path == "params/embedding/weight")
  shape = sorted(program.values[embedding].shape)
  gradients = [
    op.id
    for op in program.ops
    if op.primitive == "dot_general"
    and staged.op_phase[op.id] == Phase.ACCUMULATED
    and sorted(program.values[op.results[0]].shape) == shape
  ]
  assert len(gradients) == 1 and staged.op_stage[gradients[0]] == last
  # Per microbatch, only the residual stream crosses: forward, and its gradient backward.
  sent = sorted((t.backward, program.values[t.value].shape) for t in staged.transfers)
  assert sent == [(False, (4, 32, 32)), (True, (4, 32, 32))]


def test_stage_transfers_and_flops_are_those_xla_compiles():
  from automap_rl.mesh import to_jax_mesh
  from automap_rl.xla import fullsize
  from automap_rl.xla.pipeline_lower import lower_pipelined
  from automap_rl.xla.plan_metrics import compiled_metrics, simulated_metrics
  from automap_rl.xla.validate import DONATE_ARGNUMS

  workload, problem = _case()
  lowered = lower_pipelined(
    problem,
    PLAN,
    PIPELINE,
    workload.loss_fn,
    workload.optimizer,
    workload.args,
    to_jax_mesh(problem.mesh),
    DONATE_ARGNUMS,
    executable=False,
  )
  simulated = simulated_metrics(problem, PLAN, PIPELINE)
  compiled = compiled_metrics(lowered.stats)
  permutes = problem.plan_cost(PLAN, PIPELINE).terms.permute_bytes
  assert float(permutes) == fullsize.stage_permute_bytes(lowered.stats, PIPELINE) > 0
  assert simulated["collective_permute_bytes"] == compiled["collective_permute_bytes"]
  assert simulated["flops"] == pytest.approx(compiled["flops"], rel=0.02)
