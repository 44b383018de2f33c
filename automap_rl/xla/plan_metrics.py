"""A plan's figures as the simulator sees them and as XLA compiled them: comm bytes and
collective counts by kind, flops and peak memory per device (`simulated_metrics`,
`compiled_metrics`), the figures `automap_rl.xla.validate` compares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from automap_rl import ir
from automap_rl.mesh import Hardware
from automap_rl.pipeline import Pipeline
from automap_rl.problem import PipelineProblem, Problem
from automap_rl.sharding import Decision
from automap_rl.simulator import KINDS
from automap_rl.simulator.tables import dense_group_factors, program_flops
from automap_rl.stages import EVERY_STAGE, Phase
from automap_rl.xla.hlo import CompiledStats


def _op_device_flops(
  program: ir.Program, sigs: Any, mask_group: np.ndarray, hardware: Hardware, resolution: Any
) -> np.ndarray:
  """Per-device flops of each op of `program` under a resolved plan, its repeat count
  included (see `simulated_flops`), float [num_ops]. `mask_group`: devices of each mesh
  axes mask of the mesh the plan resolves on."""
  group = np.asarray(mask_group)
  op_shards = group[np.bitwise_or.reduce(np.asarray(resolution.op_mask), axis=1)]  # [Uo]
  value_masks = np.asarray(resolution.value_mask)  # [Uv, Rv]
  value_shards = group[np.bitwise_or.reduce(value_masks, axis=1)]  # [Uv]
  shapes = [
    tuple(d // int(group[m]) for d, m in zip(v.shape, value_masks[sigs.value_sig[v.id]]))
    for v in program.values
  ]
  flops = program_flops(program, shapes)
  dense = dense_group_factors(program, hardware)

  def shards(op) -> float:
    if sigs.op_sig[op.id] >= 0:
      return op_shards[sigs.op_sig[op.id]]
    return value_shards[sigs.value_sig[op.results[0]]] if op.results else 1.0

  def local_groups(op) -> float:  # A dense batch-grouped conv's groups on one device.
    if dense[op.id] < 0 or sigs.op_sig[op.id] < 0:
      return 1.0
    factor_mask = np.asarray(resolution.op_mask)[sigs.op_sig[op.id], dense[op.id]]
    return op.rule.factor_sizes[dense[op.id]] / group[factor_mask]

  return np.array(
    [op.repeat * flops[op.id] * local_groups(op) / shards(op) for op in program.ops], np.float64
  )


def simulated_flops(problem: Problem, resolution: Any) -> float:
  """Per-device flops of a resolved plan: `program_flops * repeat / shards` summed over
  program ops, with XLA's fusion decisions taken on the plan's per-device value shapes
  (which reductions are large enough for a library kernel depends on them; see
  `simulator.fusion.fusion_copies`). An op's shard count is the product of the mesh
  axes its factors are sharded on; an op without a signature of its own (`op_sig == -1`:
  it follows its values) is sharded like its first result. A batch-grouped convolution
  that the backend computes dense counts its device's groups times (see
  `simulator.tables.dense_group_factors`)."""
  return float(
    _op_device_flops(
      problem.program, problem.sigs, problem.tables.mask_group, problem.mesh.hardware, resolution
    ).sum()
  )


def pipelined_flops(pipelined: PipelineProblem, resolution: Any) -> float:
  """Per-device flops of a pipelined plan on its busiest stage, as the simulator places
  the ops (`stages.StagedProgram`): its microbatch program's ops (at microbatch size, a
  scanned stack's loops at L / S layers) M times (the bubble's ticks run none), its step
  ops once; `simulated_flops`'s rules per op, on the stage mesh. `resolution`:
  `PipelineProblem.resolution`'s."""
  staged, pipeline = pipelined.staged, pipelined.pipeline
  per_op = _op_device_flops(
    staged.program,
    pipelined.problem.sigs,
    pipelined.tables.tables.mask_group,
    staged.mesh.hardware,
    resolution,
  )
  per_op = per_op * np.where(staged.op_phase == Phase.STEP, 1, pipeline.microbatches)
  on = lambda s: (staged.op_stage == s) | (staged.op_stage == EVERY_STAGE)
  return float(max(per_op[on(s)].sum() for s in range(pipelined.pipeline.stages)))


def simulated_metrics(
  problem: Problem, decisions: Sequence[Decision], pipeline: Pipeline | None = None
) -> dict[str, Any]:
  """The simulator's view of a plan (see `validate.ValidatedPlan`); with a pipeline, of the
  pipelined step
  (`Problem.plan_cost`: comm per device of the pace-setting stage, peak of the largest
  stage; `pipelined_flops`); collective-permutes (reshardings', split dots' and a
  pipeline's stage transfers) apart, as `collective_permute_bytes` and `_count`."""
  if pipeline is None:
    cost, flops = problem.cost(decisions), simulated_flops(problem, problem.resolution(decisions))
  else:
    pipelined = problem.pipelined(pipeline)
    cost, flops = (
      pipelined.cost(decisions),
      pipelined_flops(pipelined, pipelined.resolution(decisions)),
    )
  comm_bytes, comm_count = np.asarray(cost.comm_bytes), np.asarray(cost.comm_count)
  by_kind = {k: float(b) for k, b in zip(KINDS, comm_bytes)}
  return {
    "comm_bytes": sum(by_kind.values()),
    "comm_bytes_by_kind": by_kind,
    "comm_count_by_kind": {k: float(c) for k, c in zip(KINDS, comm_count)},
    "collective_permute_bytes": float(comm_bytes[len(KINDS) :].sum()),
    "collective_permute_count": float(comm_count[len(KINDS) :].sum()),
    "flops": flops,
    "peak_memory": float(cost.peak_memory),
  }


def compiled_metrics(stats: CompiledStats) -> dict[str, Any]:
  """XLA's view of a plan (see `validate.ValidatedPlan`), loop iterations included
  (`Collective.repeat`).
  Counts are collective instructions run: a combined collective (several buffers,
  tuple-shaped) counts once, as the simulator counts what XLA's combiners merge;
  collective-permutes are reported apart.
  `comm_bytes_by_axes` keys are the mesh axes a collective spans joined by `+`
  (`?` where its groups match no set of axes)."""
  by_kind = {k: 0.0 for k in KINDS}
  count = {k: 0.0 for k in KINDS}
  by_axes: dict[str, float] = {}
  permute_bytes = permute_count = 0.0
  for c in stats.collectives:
    moved = float(c.repeat * c.bytes)
    axes = "?" if c.mesh_axes is None else "+".join(c.mesh_axes)
    by_axes[axes] = by_axes.get(axes, 0.0) + moved
    if c.kind in by_kind:
      by_kind[c.kind] += moved
      count[c.kind] += c.repeat
    else:
      permute_bytes += moved
      permute_count += c.repeat
  return {
    "comm_bytes": sum(by_kind.values()),
    "comm_bytes_by_kind": by_kind,
    "comm_count_by_kind": count,
    "comm_bytes_by_axes": by_axes,
    "collective_permute_bytes": permute_bytes,
    "collective_permute_count": permute_count,
    "flops": stats.flops,
    "peak_memory": float(stats.peak_bytes),
  }
