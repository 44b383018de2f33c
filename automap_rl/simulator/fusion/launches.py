"""The kernels a step launches, as `memory_traffic` sees XLA's fusions: each value a fusion
or an unfused op writes to memory ends a kernel."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import numpy as np

from automap_rl.ir.program import Program
from automap_rl.simulator.fusion.primitives import NO_OPS


def kernel_launches(
  program: Program,
  traffic: list[tuple[tuple[float, ...], tuple[float, ...]]],
  dead: AbstractSet[int],
) -> np.ndarray:
  """Kernels each op launches per step, [num_ops]: its repeat count where it writes a
  result to memory (`traffic`, `memory_traffic`'s bytes per operand and result): the op
  that ends a fusion, or one that runs as a kernel of its own (a dot, a convolution, a
  scatter); 0 for an op fused into a kernel another op ends, a no-op, and an op XLA removes
  (`dead`). A multi-output fusion that writes several results counts once per result."""
  launches = np.zeros(program.num_ops, np.float64)
  for op in program.ops:
    writes = traffic[op.id][1]
    if op.id not in dead and op.primitive not in NO_OPS and any(w > 0 for w in writes):
      launches[op.id] = op.repeat
  return launches
