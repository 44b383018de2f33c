"""The values a fused kernel keeps on chip (`ir.kernels`): made by one of its ops and read
by its ops alone, they move no HBM bytes and take no memory on a backend that runs the
kernel fused (`Hardware.fused_kernels`)."""

from __future__ import annotations

from automap_rl.ir.program import Program
from automap_rl.simulator.fusion.traffic import consumers


def kernel_intermediates(program: Program) -> frozenset[int]:
  """Ids of the values an op of a fused kernel makes and only ops of that kernel read
  (not outputs): a flash-attention forward's scores and softmax weights, its backward's
  recomputed weights and their gradients."""
  readers = consumers(program)
  outputs = set(program.outputs)
  inside = set()
  for op in program.ops:
    if not op.kernel:
      continue
    for v in op.results:
      ops = readers.get(v, ())
      if v not in outputs and ops and all(r.kernel == op.kernel for r in ops):
        inside.add(v)
  return frozenset(inside)
