"""Dropout in the zoo's GPT: masks drawn per sequence from the batch's seeds (the same on
any partitioning), fused by XLA into the op it applies to, priced as XLA counts it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from automap_rl import ir, tactics
from automap_rl.mesh import make_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.plan import Plan
from automap_rl.problem import Problem
from automap_rl.simulator.fusion import memory_traffic
from automap_rl.workloads import spec as spec_lib

_GPT = "gpt:layers=2,d_model=32,heads=4,seq=16,vocab=64,batch=8"


def _plan(spec: str, mesh: str, tactic, pipeline: Pipeline | None = None) -> Plan:
  workload = spec_lib.make_workload(spec)
  problem = Problem.build(workload.trace(), make_mesh(mesh, "h100"))
  return Plan(
    workload.step,
    workload.args,
    problem,
    tactic(problem),
    pipeline=pipeline,
    loss_fn=workload.loss_fn,
    optimizer=workload.optimizer,
  )


def test_dropout_changes_the_loss_and_runs_alike_partitioned():
  """The masks depend on the seeds, and a data x Megatron plan computes the unpartitioned
  step's numbers (`Plan.check`)."""
  spec = f"{_GPT},dropout=0.1,scan=true"
  workload = spec_lib.make_workload(spec)
  plain = spec_lib.make_workload(spec.replace(",dropout=0.1", ""))
  loss = workload.loss_fn(workload.params, workload.batch)
  assert float(loss) != pytest.approx(float(plain.loss_fn(plain.params, workload.batch)))
  reseeded = dict(workload.batch, dropout_seeds=workload.batch["dropout_seeds"] + 1)
  assert float(workload.loss_fn(workload.params, reseeded)) != pytest.approx(float(loss))
  _plan(spec, "data=2,model=4", tactics.data_megatron).check()


def test_a_pipeline_of_a_dropout_stack_says_it_does_not_lower():
  """The stack's loop reads the sequences' keys, made from the batch: the scheduled
  lowering says so in one line rather than run something else."""
  spec = f"{_GPT},dropout=0.1,scan=true"
  pipeline = Pipeline("data", stages=2, microbatches=4, schedule="1f1b")
  plan = _plan(spec, "data=2,model=4", tactics.megatron, pipeline)
  with pytest.raises(NotImplementedError, match="constants computed from the batch"):
    plan.lower()


def test_the_seeds_are_a_batch_input_split_with_the_tokens():
  """One seed per sequence: the seeds' dim is the tokens' batch dim, so a plan splits them
  alike (and a pipeline's microbatches take their own seeds)."""
  workload = spec_lib.make_workload(f"{_GPT},dropout=0.1")
  seeds = workload.batch["dropout_seeds"]
  assert seeds.shape == (8,) and seeds.dtype == jnp.uint32
  problem = Problem.build(workload.trace(), make_mesh("data=2,model=4", "h100"))
  batch = {problem.named.class_of(v, 0) for v in problem.program.batch_inputs}
  assert len(problem.program.batch_inputs) == 3 and len(batch) == 1


def test_bad_dropout_is_a_one_line_error():
  with pytest.raises(ValueError, match=r"^dropout=1\.0 must be in \[0, 1\)$"):
    spec_lib.make_workload(f"{_GPT},dropout=1.0")
  with pytest.raises(ValueError, match="^dropout on fused attention is not modelled"):
    spec_lib.make_workload(f"{_GPT},dropout=0.1,fused_attention=true")


def test_a_dropout_chain_fuses_into_one_pass_over_its_input():
  """Random bits, the uniform they make, the comparison and the select fuse: the chain
  reads `x` once and writes its result once, as XLA's GPU fusion runs it."""

  def drop(seed, x):
    keep = jax.random.bernoulli(jax.random.key(seed), 0.9, x.shape)
    return jnp.where(keep, x / 0.9, 0.0)

  x = jnp.ones((64, 256), jnp.bfloat16)
  program = ir.trace(drop, jnp.uint32(0), x)
  traffic = memory_traffic(program)
  read = sum(sum(r) for r, _ in traffic)
  written = sum(sum(w) for _, w in traffic)
  assert read == pytest.approx(x.nbytes, abs=64)  # And the seed and the key, a few bytes.
  assert written == pytest.approx(x.nbytes, abs=64)


def test_random_bits_cost_the_flops_xla_counts():
  """Threefry's rounds: the traced program's flops of `random_bits` against XLA's cost
  analysis of JAX's lowering, within 1%."""

  def bits(seed):
    return jax.random.bits(jax.random.key(seed), (1 << 16,), jnp.uint32)

  program = ir.trace(bits, jnp.uint32(0))
  simulated = sum(op.flops for op in program.ops)
  compiled = jax.jit(bits).lower(jnp.uint32(0)).compile().cost_analysis()["flops"]
  assert simulated == pytest.approx(compiled, rel=0.01)


def test_dropout_is_priced_where_the_scores_are_made():
  """On a Megatron plan each device draws the masks of its heads only: no collective more
  than without dropout; where the seq x seq scores dominate, the step costs more."""
  mesh = make_mesh("data=2,model=4", "h100")
  costs = {}
  for rate in ("0.0", "0.1"):
    program = spec_lib.make_workload(
      f"gpt:layers=1,d_model=128,heads=16,seq=1024,vocab=256,batch=8,dropout={rate}",
      abstract=True,
    ).trace()
    problem = Problem.build(program, mesh)
    costs[rate] = problem.cost(tactics.data_megatron(problem))
  np.testing.assert_allclose(costs["0.1"].comm_bytes, costs["0.0"].comm_bytes)
  assert float(costs["0.1"].step_time) > float(costs["0.0"].step_time)
