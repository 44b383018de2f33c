"""Fused (flash) attention: the same numbers as the models' attention, its intermediates
kept on chip where the backend fuses it, priced as written on XLA:CPU."""

import jax
import numpy as np
import pytest

from automap_rl.ir import kernels
from automap_rl.mesh import get_hardware, make_mesh
from automap_rl.problem import Problem
from automap_rl.simulator.fusion import kernel_intermediates, memory_traffic
from automap_rl.workloads import spec as spec_lib

_SMALL = "layers=2,d_model=32,heads=4,seq=16,vocab=64,batch=4"


@pytest.mark.parametrize(
  "spec",
  [
    f"gpt:{_SMALL}",
    f"gpt:{_SMALL},scan=true,remat=true",
    f"llama:{_SMALL},kv_heads=2,remat=true",
    f"moe:{_SMALL},scan=true",
  ],
)
def test_fused_attention_has_the_loss_and_gradients_of_the_models_attention(spec):
  results = []
  for fused in ("false", "true"):
    workload = spec_lib.make_workload(f"{spec},fused_attention={fused}")
    results.append(jax.value_and_grad(workload.loss_fn)(workload.params, workload.batch))
  (loss, grads), (fused_loss, fused_grads) = results
  np.testing.assert_allclose(fused_loss, loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _program(fused: bool, seq: int = 128):
  spec = f"llama:layers=2,d_model=64,heads=4,kv_heads=2,seq={seq},vocab=64,batch=2,remat=true"
  return spec_lib.make_workload(f"{spec},fused_attention={str(fused).lower()}", abstract=True)


def test_the_kernels_keep_their_scores_on_chip_and_hand_on_only_flash_attentions_residuals():
  program = _program(True).trace()
  tagged = {op.kernel for op in program.ops} - {""}
  assert tagged == set(kernels.FUSED_KERNELS)
  inside = kernel_intermediates(program)
  seq = 128
  scores = {v for v in inside if program.values[v].shape[-2:] == (seq, seq)}
  assert scores, "the kernels' [.., s, s] scores are on chip"
  # What leaves a kernel is at most [b, s, heads, head_dim]: no [.., s, s] value is read
  # outside the kernel that made it.
  made_by = {v: op.kernel for op in program.ops for v in op.results}
  for op in program.ops:
    for v in op.operands:
      if made_by.get(v) and op.kernel != made_by[v]:
        assert program.values[v].shape[-2:] != (seq, seq)
  traffic = memory_traffic(program, on_chip=inside)
  for op in program.ops:
    for v, nbytes in zip(op.results, traffic[op.id][1]):
      if v in inside:
        assert nbytes == 0.0


def test_a_gpu_prices_the_fused_kernel_and_xla_cpu_the_ops_it_runs():
  def cost(fused: bool, hardware):
    problem = Problem.build(_program(fused, seq=256).trace(), make_mesh("data=1", hardware))
    return problem.plan_cost([])

  h100 = get_hardware("h100")
  cpu_compiled = h100.compiled_by(get_hardware("cpu"))
  scores = 2 * 4 * 256 * 256 * 4  # One layer's float32 scores: batch x heads x s x s.
  fused, plain = cost(True, h100), cost(False, h100)
  assert float(fused.peak_memory) <= float(plain.peak_memory) - scores
  assert float(fused.step_time) < float(plain.step_time)
  on_cpu = cost(True, cpu_compiled)
  assert float(on_cpu.peak_memory) >= float(fused.peak_memory) + scores
