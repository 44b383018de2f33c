"""The compiled-implied cost prices what XLA compiled with the simulator's own model:
every compiled collective (collective-permutes included) in the alpha-beta model of
`simulator.collective_seconds`, times the loop trip counts around it, plus compute as a
roofline over the compiled kernels (`hlo.kernel_costs`: each fusion or unfused
instruction, times its loop trip counts), each at the larger of its flops at the
hardware's matmul peak and its bytes accessed at HBM bandwidth, as the simulator prices
its ops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from automap_rl.mesh import Mesh
from automap_rl.problem import Problem
from automap_rl.simulator import COMM_KINDS, collective_seconds
from automap_rl.simulator.tables import program_flops
from automap_rl.xla.hlo import CompiledStats

__all__ = ["implied_cost", "peak_flops", "with_bubble"]


def _axes_mask(mesh: Mesh, axes: Sequence[str] | None) -> int:
  """Bit mask of mesh axes; every axis (the slowest link) where XLA's groups match no set
  of axes."""
  names = mesh.axis_names if axes is None else axes
  return sum(1 << mesh.axis_names.index(a) for a in names)


@functools.cache
def peak_flops(problem: Problem) -> float:
  """The flop/s of the op with the most flops (a matmul, in the matmuls' dtype), as the
  simulator prices it (`Hardware.achievable_flops`)."""
  program = problem.program
  flops = program_flops(program)
  heaviest = max(program.ops, key=lambda op: op.repeat * flops[op.id])
  dtype = program.values[heaviest.results[0]].dtype if heaviest.results else "float32"
  return problem.mesh.hardware.achievable_flops(heaviest.primitive, dtype)


def implied_cost(problem: Problem, stats: CompiledStats) -> dict[str, Any]:
  """The compiled module priced with the simulator's model (see the module docstring):
  `step_time = compute_time + comm_time`, seconds per step per device; `comm_time_by_kind`
  (`COMM_KINDS`) and, per kind, `op_by_kind`: the jax op whose collectives of that kind
  take the most time."""
  hardware = problem.mesh.hardware
  by_kind = {k: 0.0 for k in COMM_KINDS}
  by_op: dict[tuple[str, str], float] = {}
  for c in stats.collectives:
    mask = _axes_mask(problem.mesh, c.mesh_axes)
    group = c.group_size if c.mesh_axes is None and c.kind != "collective-permute" else None
    seconds = c.repeat * collective_seconds(problem.tables, c.kind, c.bytes, mask, group)
    by_kind[c.kind] += seconds
    by_op[c.kind, c.op_name] = by_op.get((c.kind, c.op_name), 0.0) + seconds
  peak = peak_flops(problem)
  compute = sum(
    max(flops / peak, nbytes / hardware.hbm_bandwidth) for flops, nbytes in stats.kernels
  )
  comm = sum(by_kind.values())
  return {
    "step_time": compute + comm,
    "compute_time": compute,
    "comm_time": comm,
    "comm_time_by_kind": by_kind,
    "op_by_kind": {
      kind: max((s, op) for (k, op), s in by_op.items() if k == kind)[1]
      for kind in {k for k, _ in by_op}
    },
  }


def with_bubble(implied: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
  """A pipelined plan's `implied_cost` with the schedule's bubble: the compiled module
  holds the busiest stage's kernels (each tick's branch counted in the ticks that run
  it), not the waits of the pipeline's fill and drain, which a compile cannot show. They
  are (S - 1) / V stage-times of the loop, the simulator's share of its step
  (`bubble_time`) at the compiled stage's pace: `step_time` grows by step / (step -
  bubble), and `bubble_time` says by how much."""
  busy = simulated["step_time"] - simulated["bubble_time"]
  scale = simulated["step_time"] / busy if busy > 0 else 1.0
  step = implied["step_time"] * scale
  return {**implied, "step_time": step, "bubble_time": step - implied["step_time"]}
