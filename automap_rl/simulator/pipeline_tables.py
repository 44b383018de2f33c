"""The tables a pipelined plan is priced from (`PipelineTables`), built once per program,
mesh and pipeline with numpy: the microbatch program's signatures split by stage and phase,
each stage's live-bytes rows, its residuals, gradient sums and transfers per signature,
padded to a few shapes so that `simulator.pipeline.pipeline_cost` compiles once for each."""

from __future__ import annotations

import chex
import numpy as np

from automap_rl import sharding
from automap_rl.batching import next_power_of_two
from automap_rl.ir import NamedDims
from automap_rl.ir.stacks import OUTSIDE
from automap_rl.sharding import Signatures
from automap_rl.simulator.tables import (
  MAX_LOOP_GROUPS,
  CostTables,
  build_cost_tables,
  live_matrix,
  probe_rows,
)
from automap_rl.stages import EVERY_STAGE, Phase, StagedProgram, layers_loop


@chex.dataclass(frozen=True)
class PipelineTables:
  """What pricing a pipelined plan needs besides the resolution, as arrays.

  Shapes: S stages; Uv, Uo the microbatch program's value and op signatures split by
  stage and phase (`tables`'s); E edges, R reduction edges, T live rows. Each is padded
  (S to the mesh's largest axis, the others to powers of two) with rows that add nothing,
  so that the pipelines of a program on a mesh share a few shapes: `pipeline_cost` jits
  once for each.

  Attributes:
    tables: the simulator's cost tables of the microbatch program on the stage mesh (its
      whole-program `live_bytes` left out: the stages' are `live_rows`).
    value_source, op_source: the full program's signature of each split signature (the
      resolution's rows), int32 [Uv], [Uo].
    value_size, op_size: their dim (factor) sizes at microbatch and stage size, which the
      resolution must divide, int32 [Uv, Rv], [Uo, Rf].
    value_example, op_example: a value (op) id of each, to name it in messages, [Uv], [Uo].
    value_stages, op_stages: the stages each signature runs on (a scanned stack's: all),
      float32 [Uv, S], [Uo, S].
    value_phase, op_phase: `stages.Phase` of each signature, int32 [Uv], [Uo].
    value_looped, op_looped: whether each signature runs in the stages' loop
      (`StagedProgram.looped`; a value: its producer), bool [Uv], [Uo].
    edge_invariant: operand edges of microbatch ops that read a value made once per
      step (resharded once, before the microbatch loop), bool [E].
    edge_weight_read: operand edges of microbatch ops that read a value the batch does
      not reach (`StagedProgram.weight_reads`), bool [E].
    gather_weights_once: `Pipeline.gather_weights_once`, bool [].
    live_rows: per stage, its values' live-bytes rows (other stages' columns zero; rows of
      zeros pad T to a power of two, at least 64), float32 [S, T, Uv].
    residual_bytes: per stage, the global bytes of the residuals it keeps for one
      microbatch, per signature, float32 [S, Uv].
    accumulator_bytes: per stage, the global bytes of its accumulated partial sums (its
      weights' gradients), per signature, float32 [S, Uv].
    transfer_bytes: per kind (forward per microbatch, backward per microbatch, once per
      step) and sending stage, the global bytes of the values sent, float32 [3, S, Uv].
    stage_summed_bytes: the global bytes of the gradient sums of the parameters outside
      the stack, summed over the stage axis once per step, per signature, float32 [Uv].
    batch_signature: the full program's signature of the batch (the first batched input),
      whose dim 0 the plan's batch axes shard; -1 without one, int32 [].
    stacked_signatures: the full program's signatures of the stack's stacked weights
      (inputs [L, ...]), -1 where padded, int32 [K].
    reduction_once: per reduction, the share of its runs a step that a reduction deferred
      to once per step still runs: its distinct sums over its runs, float32 [R]. A
      loop inside a layer (a recurrence over time) adds each iteration's partial sum of a
      weight's gradient into one sum, reduced once; a scanned stack's loop makes one sum
      per layer.
    in_flight: `Pipeline.in_flight`, float32 [S].
    inner_loop: 1 where each stage runs its layers in a loop of its own (a scanned stack
      with more than one layer per stage and chunk), else 0, float32 [].
    stages, microbatches, chunks: S, M and V, float32 [].
    ticks: the iterations of the lowered schedule's loop (`Pipeline.ticks`), float32 [].
    permute_seconds_per_byte, permute_latency: the stage axis's link, float32 [].
    hbm_seconds_per_byte: the device's memory, float32 [].
  """

  tables: CostTables
  value_source: np.ndarray
  op_source: np.ndarray
  value_size: np.ndarray
  op_size: np.ndarray
  value_example: np.ndarray
  op_example: np.ndarray
  value_stages: np.ndarray
  op_stages: np.ndarray
  value_phase: np.ndarray
  op_phase: np.ndarray
  value_looped: np.ndarray
  op_looped: np.ndarray
  edge_invariant: np.ndarray
  edge_weight_read: np.ndarray
  gather_weights_once: np.ndarray
  live_rows: np.ndarray
  residual_bytes: np.ndarray
  accumulator_bytes: np.ndarray
  transfer_bytes: np.ndarray
  stage_summed_bytes: np.ndarray
  batch_signature: np.ndarray
  stacked_signatures: np.ndarray
  reduction_once: np.ndarray
  in_flight: np.ndarray
  inner_loop: np.ndarray
  stages: np.ndarray
  microbatches: np.ndarray
  chunks: np.ndarray
  ticks: np.ndarray
  permute_seconds_per_byte: np.ndarray
  permute_latency: np.ndarray
  hbm_seconds_per_byte: np.ndarray


def build_pipeline_tables(
  staged: StagedProgram, named: NamedDims, full: Signatures
) -> PipelineTables:
  """The tables of `staged` (its program's ops and values are those of the program
  `full` are the signatures of, by id)."""
  program, pipeline = staged.program, staged.pipeline
  num_stages = pipeline.stages
  value_phase, looped_value = _value_phases(staged)
  sigs, value_rep, op_rep = _split_signatures(staged, named, value_phase, looped_value)
  tables = build_cost_tables(program, sigs, staged.mesh)
  value_stages = _stages_of(staged.value_stage[value_rep], num_stages)
  op_stages = _stages_of(staged.op_stage[op_rep], num_stages)
  edge_invariant = _operand_edges(staged, sigs, staged.loop_invariant)
  edge_weight_read = _operand_edges(staged, sigs, staged.weight_reads)
  residuals, accumulated, sent = _stage_bytes(staged, sigs)
  # Padded to the largest mesh axis and to power-of-two sizes, with rows that add nothing:
  # every pipeline of a program on a mesh has tables of a few shapes (one compile each).
  capacity = max(
    n * (num_stages if name == pipeline.axis else 1)
    for name, n in zip(staged.mesh.axis_names, staged.mesh.axis_sizes)
  )
  uv, uo = next_power_of_two(len(value_rep), 16), next_power_of_two(len(op_rep), 16)
  kinds = value_phase[value_rep] * 2 + looped_value[value_rep]
  zeros = lambda x, *shape: np.pad(
    x, [(0, n - m) for n, m in zip(shape, x.shape)]
  )  # Zeros up to `shape`.
  batched, stacked = program.batch_inputs, staged.stack.stacked_inputs(program, named)
  once = _reduction_once(staged, sigs, tables, len(op_rep))
  link = staged.mesh.link(pipeline.axis)
  return PipelineTables(
    tables=_padded(tables, uv, uo),
    value_source=_pad(full.value_sig[value_rep].astype(np.int32), uv, 0),
    op_source=_pad(full.op_sig[op_rep].astype(np.int32), uo, 0),
    value_size=zeros(sigs.value_size, uv, sigs.value_size.shape[1]),
    op_size=zeros(sigs.op_size, uo, sigs.op_size.shape[1]),
    value_example=_pad(value_rep, uv, 0),
    op_example=_pad(op_rep, uo, 0),
    value_stages=zeros(value_stages, uv, capacity),
    op_stages=zeros(op_stages, uo, capacity),
    value_phase=_pad(value_phase[value_rep].astype(np.int32), uv, Phase.STEP),
    op_phase=_pad(staged.op_phase[op_rep].astype(np.int32), uo, Phase.STEP),
    value_looped=_pad(looped_value[value_rep], uv, False),
    op_looped=_pad(staged.looped[op_rep], uo, False),
    edge_invariant=_pad(edge_invariant, next_power_of_two(len(edge_invariant), 16), False),
    edge_weight_read=_pad(edge_weight_read, next_power_of_two(len(edge_weight_read), 16), False),
    gather_weights_once=np.bool_(pipeline.gather_weights_once),
    live_rows=_live_rows(staged, sigs, value_stages, kinds, capacity, uv),
    residual_bytes=zeros(residuals, capacity, uv),
    accumulator_bytes=zeros(accumulated, capacity, uv),
    transfer_bytes=np.stack([zeros(x, capacity, uv) for x in sent]),
    stage_summed_bytes=zeros(_stage_summed(staged, sigs), uv),
    batch_signature=np.int32(full.value_sig[batched[0]] if batched else -1),
    stacked_signatures=full.value_sig[stacked].astype(np.int32),
    reduction_once=_pad(once, next_power_of_two(len(once), 16), 1.0),
    in_flight=_pad(pipeline.in_flight().astype(np.float32), capacity, 1.0),
    inner_loop=np.float32(
      staged.stack.scanned and max(pipeline.chunk_layers(staged.stack.layers)) > 1
    ),
    stages=np.float32(num_stages),
    microbatches=np.float32(pipeline.microbatches),
    chunks=np.float32(pipeline.chunks),
    ticks=np.float32(pipeline.ticks()),
    permute_seconds_per_byte=np.float32(1.0 / link.bandwidth),
    permute_latency=np.float32(link.latency),
    hbm_seconds_per_byte=np.float32(1.0 / staged.mesh.hardware.hbm_bandwidth),
  )


def _value_phases(staged: StagedProgram) -> tuple[np.ndarray, np.ndarray]:
  """Each value's `Phase` and whether it runs in the stages' loop (its producer's), int
  and bool [num_values]."""
  program = staged.program
  value_phase = np.full(program.num_values, Phase.STEP, np.int64)
  looped_value = np.zeros(program.num_values, bool)
  for op in program.ops:
    value_phase[list(op.results)] = staged.op_phase[op.id]
    looped_value[list(op.results)] = staged.looped[op.id]
  return value_phase, looped_value


def _stages_of(stage: np.ndarray, num_stages: int) -> np.ndarray:
  """Per entry of `stage` ([N]), the stages it runs on (`EVERY_STAGE`: all), float32 [N, S]."""
  return ((stage[:, None] == np.arange(num_stages)) | (stage[:, None] == EVERY_STAGE)).astype(
    np.float32
  )


def _operand_edges(
  staged: StagedProgram, sigs: Signatures, reads: tuple[tuple[bool, ...], ...]
) -> np.ndarray:
  """Per edge of the split signatures, the flag `reads` gives its op's operand (a
  `StagedProgram` per-op, per-operand table, by which the signatures are split; results'
  edges: False), bool [E]."""
  flags = np.zeros(len(sigs.op_keys), object)
  for op in staged.program.ops:
    if sigs.op_sig[op.id] >= 0:
      flags[sigs.op_sig[op.id]] = reads[op.id]
  return np.concatenate(
    [
      np.array([*flags[sig], *[False] * len(results)], bool)
      for sig, (_, _, _, results, _) in enumerate(sigs.op_keys)
    ]
    or [np.zeros(0, bool)]
  )


def _stage_bytes(
  staged: StagedProgram, sigs: Signatures
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
  """Per stage and signature, global bytes of: the residuals it keeps for one microbatch,
  [S, Uv]; the sums its loop carries (its ops' results that a step op reads: the stage's
  weight gradients, stacked by a scanned stack's loop), [S, Uv]; and what it sends, per
  kind (forward and backward per microbatch, once per step), 3 x [S, Uv]."""
  program = staged.program
  nbytes = np.array([v.nbytes for v in program.values], np.float64)
  per_stage = lambda pairs: _by_stage(
    pairs, sigs.value_sig, nbytes, staged.pipeline.stages, len(sigs.value_keys)
  )
  residuals = per_stage((v, s) for v, stages in staged.residual_stages.items() for s in stages)
  read_per_step = {
    v for op in program.ops if staged.op_phase[op.id] == Phase.STEP for v in op.operands
  }
  accumulated = per_stage(
    (v, staged.op_stage[op.id])
    for op in program.ops
    if staged.looped[op.id]
    for v in op.results
    if v in read_per_step
  )
  sent = [
    per_stage((t.value, t.stage) for t in staged.transfers if (t.per_step, t.backward) == kind)
    for kind in ((False, False), (False, True))
  ]
  sent.append(per_stage((t.value, t.stage) for t in staged.transfers if t.per_step))
  return residuals, accumulated, sent


def _stage_summed(staged: StagedProgram, sigs: Signatures) -> np.ndarray:
  """Per value signature, the global bytes of the gradient sums of the parameters outside
  the stack (the embedding's, the head's): the lowered loop keeps them whole on every
  stage and sums them over the stage axis once per step, float32 [Uv] (zeros for one
  stage)."""
  program, stack = staged.program, staged.stack
  read_per_step = {
    v for op in program.ops if staged.op_phase[op.id] == Phase.STEP for v in op.operands
  }
  out = np.zeros(len(sigs.value_keys), np.float64)
  if staged.pipeline.stages == 1:
    return out.astype(np.float32)
  for op in program.ops:
    if not staged.looped[op.id] or staged.op_stage[op.id] == EVERY_STAGE:
      continue
    if stack.op_layer[op.id] != OUTSIDE:
      continue
    for v in op.results:
      if v in read_per_step:
        out[sigs.value_sig[v]] += program.values[v].nbytes
  return out.astype(np.float32)


def _live_rows(
  staged: StagedProgram,
  sigs: Signatures,
  value_stages: np.ndarray,
  kinds: np.ndarray,
  capacity: int,
  uv: int,
) -> np.ndarray:
  """Per stage, the live-bytes rows of its values (`tables.probe_rows` of `value_stages`
  [Uv, S] by `kinds` [Uv]), zero rows padding to a power of two (at least 64), float32
  [capacity, T, uv]. With a loop of more than one iteration, its residual sets and
  gradient sums are terms of their own, not the rows'; with one, the step is the
  unpipelined one."""
  pipeline = staged.pipeline
  iterations = pipeline.microbatches * pipeline.chunks + pipeline.stages - 1
  live = live_matrix(
    staged.program, sigs, loops=iterations == 1, fused_kernels=staged.mesh.hardware.fused_kernels
  )
  rows = [probe_rows(live * value_stages[:, s], kinds=kinds) for s in range(pipeline.stages)]
  out = np.zeros((capacity, next_power_of_two(max(len(r) for r in rows), 64), uv), np.float32)
  for stage, r in enumerate(rows):
    out[stage, : len(r), : r.shape[1]] = r
  return out


def _reduction_once(
  staged: StagedProgram, sigs: Signatures, tables: CostTables, num_op_sigs: int
) -> np.ndarray:
  """Per reduction, the share of its runs a step that a reduction deferred to once per step
  still runs: its op's distinct sums (a scanned stack's layers on a stage, or one) over
  its runs, float32 [R]."""
  program, stack = staged.program, staged.stack
  distinct = np.where(
    layers_loop(program, stack), max(stack.layers // staged.pipeline.stages, 1), 1
  )
  sums, runs = np.zeros(num_op_sigs), np.zeros(num_op_sigs)
  for op in program.ops:
    if sigs.op_sig[op.id] >= 0:
      sums[sigs.op_sig[op.id]] += distinct[op.id]
      runs[sigs.op_sig[op.id]] += op.repeat
  reduction_op = tables.edge_op[tables.reduction_edge]
  return np.minimum(sums[reduction_op] / np.maximum(runs[reduction_op], 1.0), 1.0).astype(
    np.float32
  )


def _pad(x: np.ndarray, size: int, fill) -> np.ndarray:
  """`x` padded with `fill` along its first axis to `size` rows."""
  return np.concatenate([x, np.full((size - len(x), *x.shape[1:]), fill, x.dtype)])


def _padded(t: CostTables, uv: int, uo: int) -> CostTables:
  """`t` with rows that cost nothing up to `uv` value and `uo` op signatures, power-of-two
  edges, reductions, unique edges and shared reads, every combining group, and no live rows (the
  stages' are `PipelineTables.live_rows`)."""
  edges, unique, reductions = (
    next_power_of_two(len(x), 16) for x in (t.edge_op, t.unique_edge, t.reduction_edge)
  )
  slots, pairs = (
    next_power_of_two(len(t.shared_slot_edge), 16),
    next_power_of_two(t.shared_pairs.shape[1], 16),
  )
  rf = t.op_reduction.shape[1]
  return t.replace(
    value_bytes=_pad(t.value_bytes, uv, 0.0),
    value_compute_s=_pad(t.value_compute_s, uv, 0.0),
    value_memory_s=_pad(t.value_memory_s, uv, 0.0),
    op_compute_s=_pad(t.op_compute_s, uo, 0.0),
    value_launch_s=_pad(t.value_launch_s, uv, 0.0),
    op_launch_s=_pad(t.op_launch_s, uo, 0.0),
    op_reduction=_pad(t.op_reduction, uo, False),
    op_reduction_source=_pad(t.op_reduction_source, uo, 0),
    op_deferred=_pad(t.op_deferred, uo, False),
    op_dense_factor=_pad(t.op_dense_factor, uo, -1),
    edge_op=_pad(t.edge_op, edges, 0),
    edge_value=_pad(t.edge_value, edges, 0),
    edge_result=_pad(t.edge_result, edges, False),
    edge_dim_factors=_pad(t.edge_dim_factors, edges, rf),
    edge_weight=_pad(t.edge_weight, edges, 0.0),
    edge_buffers=_pad(t.edge_buffers, edges, 0.0),
    edge_transient=_pad(t.edge_transient, edges, 0.0),
    edge_memory_s=_pad(t.edge_memory_s, edges, 0.0),
    edge_unique=_pad(t.edge_unique, edges, 0),
    unique_edge=_pad(t.unique_edge, unique, 0),
    unique_weight=_pad(t.unique_weight, unique, 0.0),
    unique_weighted_bytes=_pad(t.unique_weighted_bytes, unique, 0.0),
    unique_buffer_bytes=_pad(t.unique_buffer_bytes, unique, 0.0),
    unique_transient_bytes=_pad(t.unique_transient_bytes, unique, 0.0),
    shared_slot_edge=_pad(t.shared_slot_edge, slots, 0),
    shared_slot_runs=_pad(t.shared_slot_runs, slots, 0.0),
    shared_slot_share=_pad(t.shared_slot_share, slots, 0.0),
    shared_pairs=_pad(t.shared_pairs.T, pairs, -1).T,
    reduction_edge=_pad(t.reduction_edge, reductions, 0),
    reduction_weight=_pad(t.reduction_weight, reductions, 0.0),
    reduction_partial_sums=_pad(t.reduction_partial_sums, reductions, 1.0),
    reduction_dot=_pad(t.reduction_dot, reductions, False),
    op_dot_reduction=_pad(t.op_dot_reduction, uo, reductions),
    reduction_combines=_pad(t.reduction_combines, reductions, 0.0),
    reduction_loop=_pad(t.reduction_loop, reductions, 0),
    loop_repeats=_pad(t.loop_repeats, MAX_LOOP_GROUPS, 1.0),
    edge_hideable=_pad(t.edge_hideable, edges, False),
    unique_hideable=_pad(t.unique_hideable, unique, False),
    reduction_hideable=_pad(t.reduction_hideable, reductions, False),
    live_bytes=np.zeros((1, uv), np.float32),
    value_dim_class=_pad(t.value_dim_class, uv, -1),
    value_count=_pad(t.value_count, uv, 0.0),
  )


def _by_stage(
  pairs, value_sig: np.ndarray, nbytes: np.ndarray, num_stages: int, num_sigs: int
) -> np.ndarray:
  """Global bytes per stage and value signature of (value, stage) pairs (stage
  `EVERY_STAGE`: every stage), float32 [S, Uv]."""
  out = np.zeros((num_stages, num_sigs), np.float64)
  for v, stage in pairs:
    out[slice(None) if stage == EVERY_STAGE else stage, value_sig[v]] += nbytes[v]
  return out.astype(np.float32)


def _split_signatures(
  staged: StagedProgram, named: NamedDims, value_phase: np.ndarray, looped_value: np.ndarray
) -> tuple[Signatures, np.ndarray, np.ndarray]:
  """The microbatch program's signatures (`sharding.signatures`) split by stage, phase and
  whether they run in the stages' loop (`value_phase`, `looped_value`: of each value,
  [num_values]), and op signatures also by which operand reads are loop-invariant and which
  read weights; with
  one value and one op of each (value and op ids, int [Uv], [Uo])."""
  program = staged.program
  base = sharding.signatures(program, named)
  value_index: dict[tuple, int] = {}
  value_sig = np.array(
    [
      value_index.setdefault(
        (
          int(base.value_sig[v]),
          int(staged.value_stage[v]),
          int(value_phase[v]),
          bool(looped_value[v]),
        ),
        len(value_index),
      )
      for v in range(program.num_values)
    ],
    np.int32,
  )
  value_rep = np.zeros(len(value_index), np.int64)
  value_rep[value_sig[::-1]] = np.arange(program.num_values - 1, -1, -1)
  deferred, carried, buffers = sharding.pending_partial_sums(program)
  op_index: dict[tuple, int] = {}
  op_keys, op_rep = [], []
  op_sig = np.full(program.num_ops, -1, np.int32)
  for op in program.ops:
    sig = base.op_sig[op.id]
    if sig < 0:
      continue
    matmul, factors = base.op_keys[sig][:2]
    operands = tuple(
      (int(value_sig[v]), dims) for v, dims in zip(op.operands, op.rule.operand_dims)
    )
    results = tuple((int(value_sig[v]), dims) for v, dims in zip(op.results, op.rule.result_dims))
    partial = (
      op.id in deferred,
      int(op_sig[carried[op.id]]) if op.id in carried else -1,
      buffers.get(op.id, 1),
    )
    key = (matmul, factors, operands, results, partial)
    split = (
      key,
      int(staged.op_stage[op.id]),
      int(staged.op_phase[op.id]),
      bool(staged.looped[op.id]),
      staged.loop_invariant[op.id],
      staged.weight_reads[op.id],
    )
    if split not in op_index:
      op_index[split] = len(op_keys)
      op_keys.append(key)
      op_rep.append(op.id)
    op_sig[op.id] = op_index[split]

  def rows(column: int, fill: int) -> np.ndarray:
    out = np.full((len(op_keys), base.op_class.shape[1]), fill, np.int32)
    for i, (_, factors, _, _, _) in enumerate(op_keys):
      out[i, : len(factors)] = [f[column] for f in factors]
    return out

  split_sigs = Signatures(
    value_sig=value_sig,
    value_class=base.value_class[base.value_sig[value_rep]],
    value_size=base.value_size[base.value_sig[value_rep]],
    value_keys=tuple(base.value_keys[base.value_sig[v]] for v in value_rep),
    op_sig=op_sig,
    op_class=rows(0, -1),
    op_size=rows(1, 1),
    op_keys=tuple(op_keys),
  )
  return split_sigs, value_rep, np.array(op_rep, np.int64)
