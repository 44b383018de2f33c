"""The cost of a pipelined plan: typed pipeline terms over the existing per-op terms.

A pipelined step (`automap_rl.stages.StagedProgram`) is priced on its microbatch program
(the step at microbatch size, a scanned stack cut to one stage's layers) on the stage
mesh. Its signatures are split by stage and phase, so that one evaluation of the
simulator's per-op and per-edge terms (`simulator.terms`, the same rooflines and
alpha-beta collectives as any plan's) gives every stage's share of one microbatch, and
the intra-op resolution is the full program's (same values and ops, checked to divide at
microbatch size). From those terms:

* per stage, per microbatch: the compute and collectives of its microbatch ops (the
  forward and backward of its layers; the first stage also the embedding, the last the
  head and loss), without the reductions of accumulated partial sums and the reshards of
  loop-invariant operands (weights), which run once per step;
* `loop`: per stage, the part of its microbatch time in the stages' loop
  (`StagedProgram.looped`: every microbatch op's compute and collectives), which the
  bubble's iterations run too;
* `stacking`: per stage, per iteration of the loop: the stages' loop keeps every
  iteration's residuals for the backward pass in a buffer of all iterations' and slices
  them back out (a dynamic-update-slice and a dynamic slice, each reading and writing the
  residuals: four passes over one microbatch's residuals of the loop's ops at HBM
  bandwidth), in the loop's time;
* `accumulation`: per stage, per iteration of the loop: the backward pass adds the
  iteration's gradients of the stage's weights into their sums (three passes over the
  loop's accumulated gradients: the sum and the gradient read, the sum written), in the
  loop's time. Where a stage runs its layers in a loop of its own (a scanned stack with
  more than one layer per stage), every iteration first fills that loop's stacked outputs
  with zeros: one more pass over the gradients here, and one over the residuals in
  `stacking`;
* the pace-setting stage: the one whose M microbatches plus (S - 1) / V bubble loop
  times are longest; `pace` its microbatch time; `steady` = M x pace; `bubble` =
  (S - 1) / V x its loop time (interleaved: Megatron-LM's (S - 1) / V stage-times);
* `transfer`: the loop's M V + S - 1 iterations each send the boundary activations
  forward and their gradients backward with a collective-permute on the stage axis's
  link (alpha-beta: one hop of each device's shard), the stages at once (the slowest
  boundary counts); values summed on another stage once per step (a tied weight's
  gradient) once;
* `gradient_reduction` and `update`: once per step after the last microbatch, on every
  stage at once (the stage whose sum is largest counts): the reduction of the
  accumulated gradients, and the step ops (optimizer update, weight casts, reshards of
  loop invariants). The lowered loop defers a reduction of its layers' gradients only
  over the axes it is manual over (`manual_axes`): the stage axis, and the batch axes
  where no stacked weight is split over them other than on its layer dim. A reduction
  over any other axis XLA runs in every iteration, where the gradient is made: it is a
  microbatch collective of the loop.

step time = steady + bubble + transfer + gradient_reduction + update, exactly.

Peak memory per stage: the largest live-bytes row of its values for one microbatch (its
parameters, optimizer state and one microbatch's activations, as `simulator.total`
counts them; a scanned stack's rows at L / S layers; the first stage's embedding and the
last stage's head and loss at microbatch size) plus its gathered operand copies, plus
(in flight - 1) sets of its residuals (the activations its forward makes for its
backward: with remat only the layer inputs; `Pipeline.in_flight`: M under GPipe, S - s
on stage s under 1F1B), plus the accumulated gradients (as stored) where the loop runs
more than one iteration (it sums the gradients over its iterations, the bubble's
included). The step's peak is the largest stage's. With S = 1 this is gradient
accumulation: one microbatch's activations and the gradient sums.

The terms are a pure function of arrays (`pipeline_cost` jits with the tables as
arguments: one compile per table shape). Building the tables (placing the ops, the
microbatch program's signatures, per-stage live rows) is numpy, once per program, mesh
and pipeline.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import sharding
from automap_rl.batching import next_power_of_two
from automap_rl.ir import NamedDims
from automap_rl.sharding import Resolution, Signatures
from automap_rl.simulator.cost import KINDS, Cost, terms
from automap_rl.simulator.tables import (
  MAX_LOOP_GROUPS,
  CostTables,
  build_cost_tables,
  live_matrix,
  probe_rows,
)
from automap_rl.stages import EVERY_STAGE, Phase, StagedProgram, layers_loop

PIPELINE_KINDS = (
  *KINDS,
  "collective-permute",
)  # `PipelineCost.comm_bytes` order: `KINDS`, then permutes.


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
    live_rows: per stage, its values' live-bytes rows (other stages' columns zero; rows of
      zeros pad T to a power of two, at least 64), float32 [S, T, Uv].
    residual_bytes: per stage, the global bytes of the residuals it keeps for one
      microbatch, per signature, float32 [S, Uv].
    accumulator_bytes: per stage, the global bytes of its accumulated partial sums (its
      weights' gradients), per signature, float32 [S, Uv].
    transfer_bytes: per kind (forward per microbatch, backward per microbatch, once per
      step) and sending stage, the global bytes of the values sent, float32 [3, S, Uv].
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
  live_rows: np.ndarray
  residual_bytes: np.ndarray
  accumulator_bytes: np.ndarray
  transfer_bytes: np.ndarray
  batch_signature: np.ndarray
  stacked_signatures: np.ndarray
  reduction_once: np.ndarray
  in_flight: np.ndarray
  inner_loop: np.ndarray
  stages: np.ndarray
  microbatches: np.ndarray
  chunks: np.ndarray
  permute_seconds_per_byte: np.ndarray
  permute_latency: np.ndarray
  hbm_seconds_per_byte: np.ndarray


@chex.dataclass(frozen=True)
class PipelineTerms:
  """The typed terms of a pipelined step (seconds and bytes per device).

  Per stage, [S]: `microbatch_compute_s`, `microbatch_comm_s` (one microbatch's compute,
  its loop residuals' `stacking_s` and its gradients' `accumulation_s` included, and
  intra-op collectives), `stacking_s`, `accumulation_s`, `loop_s` (the part of the two in
  the stages' loop),
  `gradient_reduction_stage_s` (its accumulated gradients' reduction, once per step),
  `update_stage_s` (its step ops' compute and collectives), `live_bytes` (largest live
  row for one microbatch), `gathered_bytes` (gathered operand copies: those reads share,
  and the stage's largest one made for one read), `residual_bytes`
  (one microbatch's residuals), `in_flight` (sets of them held), `accumulator_bytes` (accumulated gradients, 0 for M = 1), `peak_memory`.
  Inside `pipeline_cost` these have the tables' padded stage count; `for_stages` cuts
  them to S.
  Scalars: `pace_s` (the pace-setting stage's microbatch time), `steady_s` (M x pace),
  `bubble_s` ((S - 1) / V x its `loop_s`), `transfer_s`, `gradient_reduction_s` and `update_s` (of
  the stage whose
  sum of the two is largest), `permute_bytes` (collective-permute bytes per device).
  """

  microbatch_compute_s: jax.Array
  microbatch_comm_s: jax.Array
  stacking_s: jax.Array
  accumulation_s: jax.Array
  loop_s: jax.Array
  gradient_reduction_stage_s: jax.Array
  update_stage_s: jax.Array
  live_bytes: jax.Array
  gathered_bytes: jax.Array
  residual_bytes: jax.Array
  in_flight: jax.Array
  accumulator_bytes: jax.Array
  peak_memory: jax.Array
  pace_s: jax.Array
  steady_s: jax.Array
  bubble_s: jax.Array
  transfer_s: jax.Array
  gradient_reduction_s: jax.Array
  update_s: jax.Array
  permute_bytes: jax.Array


@chex.dataclass(frozen=True)
class PipelineCost(Cost):
  """A pipelined plan's cost: `simulator.Cost`'s fields, read for the pipelined step, and
  its terms.

  Attributes:
    step_time: the sum of `terms`' `steady_s`, `bubble_s`, `transfer_s`,
      `gradient_reduction_s` and `update_s`.
    compute_time: its compute: the pace-setting stage's microbatch compute times M
      plus its loop's compute times (S - 1) / V, plus the step ops' compute.
    comm_time: the rest.
    peak_memory: the largest stage's peak.
    fits: whether every stage fits in the device's memory.
    comm_bytes, comm_count: per device of the pace-setting stage, per step, in
      `PIPELINE_KINDS` order (a collective-permute entry after `KINDS`), [5].
    terms: the breakdown.
  """

  terms: PipelineTerms


STAGE_TERMS = (
  "microbatch_compute_s",
  "microbatch_comm_s",
  "stacking_s",
  "accumulation_s",
  "loop_s",
  "gradient_reduction_stage_s",
  "update_stage_s",
  "live_bytes",
  "gathered_bytes",
  "residual_bytes",
  "in_flight",
  "accumulator_bytes",
  "peak_memory",
)


def for_stages(cost: PipelineCost, stages: int) -> PipelineCost:
  """`cost` with its per-stage terms cut to the first `stages` (the rest pad the tables)."""
  return cost.replace(
    terms=cost.terms.replace(**{name: getattr(cost.terms, name)[:stages] for name in STAGE_TERMS})
  )


def build_pipeline_tables(
  staged: StagedProgram, named: NamedDims, full: Signatures
) -> PipelineTables:
  """The tables of `staged` (its program's ops and values are those of the program
  `full` are the signatures of, by id)."""
  program = staged.program
  num_stages = staged.pipeline.stages
  value_phase = np.full(program.num_values, Phase.STEP, np.int64)
  looped_value = np.zeros(program.num_values, bool)
  for op in program.ops:
    value_phase[list(op.results)] = staged.op_phase[op.id]
    looped_value[list(op.results)] = staged.looped[op.id]
  sigs, value_rep, op_rep = _split_signatures(staged, named, value_phase, looped_value)
  tables = build_cost_tables(program, sigs, staged.mesh)

  def stages_of(stage: np.ndarray) -> np.ndarray:
    return ((stage[:, None] == np.arange(num_stages)) | (stage[:, None] == EVERY_STAGE)).astype(
      np.float32
    )

  value_stages, op_stages = (
    stages_of(staged.value_stage[value_rep]),
    stages_of(staged.op_stage[op_rep]),
  )
  invariant = np.zeros(len(sigs.op_keys), object)
  for op in program.ops:
    if sigs.op_sig[op.id] >= 0:
      invariant[sigs.op_sig[op.id]] = staged.loop_invariant[op.id]
  edge_invariant = np.concatenate(
    [
      np.array([*invariant[sig], *[False] * len(results)], bool)
      for sig, (_, _, _, results, _) in enumerate(sigs.op_keys)
    ]
    or [np.zeros(0, bool)]
  )
  nbytes = np.array([v.nbytes for v in program.values], np.float64)
  per_stage = lambda pairs: _by_stage(
    pairs, sigs.value_sig, nbytes, num_stages, len(sigs.value_keys)
  )
  residuals = per_stage((v, s) for v, stages in staged.residual_stages.items() for s in stages)
  # The sums the loop carries: its ops' results that a step op reads (the stage's weight
  # gradients, stacked by a scanned stack's loop).
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
  # With a loop of more than one iteration, its residual sets and gradient sums are terms
  # of their own (below), not the rows'; with one, the step is the unpipelined one.
  pipeline = staged.pipeline
  live = live_matrix(
    program, sigs, loops=pipeline.microbatches * pipeline.chunks + pipeline.stages - 1 == 1
  )
  kinds = value_phase[value_rep] * 2 + looped_value[value_rep]
  rows = [probe_rows(live * value_stages[:, s], kinds=kinds) for s in range(num_stages)]
  link = staged.mesh.link(staged.pipeline.axis)
  # Padded to the largest mesh axis and to power-of-two sizes, with rows that add nothing:
  # every pipeline of a program on a mesh has tables of a few shapes (one compile each).
  capacity = max(
    n * (num_stages if name == staged.pipeline.axis else 1)
    for name, n in zip(staged.mesh.axis_names, staged.mesh.axis_sizes)
  )
  uv, uo = next_power_of_two(len(value_rep), 16), next_power_of_two(len(op_rep), 16)
  live_rows = np.zeros((capacity, next_power_of_two(max(len(r) for r in rows), 64), uv), np.float32)
  for stage, r in enumerate(rows):
    live_rows[stage, : len(r), : r.shape[1]] = r
  zeros = lambda x, *shape: np.pad(
    x, [(0, n - m) for n, m in zip(shape, x.shape)]
  )  # Zeros up to `shape`.
  batched, stacked = program.batch_inputs, staged.stack.stacked_inputs(program, named)
  # Distinct sums of each op: a scanned stack's layers on a stage, or one.
  distinct = np.where(
    layers_loop(program, staged.stack), max(staged.stack.layers // num_stages, 1), 1
  )
  sums, runs = np.zeros(len(op_rep)), np.zeros(len(op_rep))
  for op in program.ops:
    if sigs.op_sig[op.id] >= 0:
      sums[sigs.op_sig[op.id]] += distinct[op.id]
      runs[sigs.op_sig[op.id]] += op.repeat
  reduction_op = tables.edge_op[tables.reduction_edge]
  once = np.minimum(sums[reduction_op] / np.maximum(runs[reduction_op], 1.0), 1.0).astype(
    np.float32
  )
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
    live_rows=live_rows,
    residual_bytes=zeros(residuals, capacity, uv),
    accumulator_bytes=zeros(accumulated, capacity, uv),
    transfer_bytes=np.stack([zeros(x, capacity, uv) for x in sent]),
    batch_signature=np.int32(full.value_sig[batched[0]] if batched else -1),
    stacked_signatures=full.value_sig[stacked].astype(np.int32),
    reduction_once=_pad(once, next_power_of_two(len(once), 16), 1.0),
    in_flight=_pad(staged.pipeline.in_flight().astype(np.float32), capacity, 1.0),
    inner_loop=np.float32(
      staged.stack.scanned and max(pipeline.chunk_layers(staged.stack.layers)) > 1
    ),
    stages=np.float32(num_stages),
    microbatches=np.float32(staged.pipeline.microbatches),
    chunks=np.float32(staged.pipeline.chunks),
    permute_seconds_per_byte=np.float32(1.0 / link.bandwidth),
    permute_latency=np.float32(link.latency),
    hbm_seconds_per_byte=np.float32(1.0 / staged.mesh.hardware.hbm_bandwidth),
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
    live_bytes=np.zeros((1, uv), np.float32),
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
  [num_values]), and op signatures also by which operand reads are loop-invariant; with
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


def _permute(t: PipelineTables, nbytes: jax.Array) -> jax.Array:
  """Seconds of collective-permutes of `nbytes` per device (one hop), 0 for none."""
  return jnp.where(nbytes > 0, nbytes * t.permute_seconds_per_byte + t.permute_latency, 0.0)


def manual_axes(t: PipelineTables, value_mask: jax.Array) -> jax.Array:
  """The mesh axes (bit mask of the stage mesh's) the lowered loop is manual over besides
  the stage axis: the plan's batch axes (its mask of the batch's dim 0), where no stacked
  weight is split over them other than on its layer dim; else none. `value_mask` is the
  full program's [Uv_full, Rv]; int8 []."""
  value_mask = value_mask.astype(jnp.int8)
  rows = jnp.where(
    t.batch_signature >= 0, value_mask[jnp.maximum(t.batch_signature, 0), 0], 0
  ).astype(jnp.int8)
  weights = jnp.where(
    (t.stacked_signatures >= 0)[:, None], value_mask[jnp.maximum(t.stacked_signatures, 0), 1:], 0
  )
  return jnp.where(jnp.any((weights & rows) != 0), jnp.int8(0), rows)


def pipeline_cost(t: PipelineTables, value_mask: jax.Array, op_mask: jax.Array) -> PipelineCost:
  """The cost of a pipelined plan from the full program's resolution (`value_mask`
  [Uv_full, Rv], `op_mask` [Uo_full, Rf] on the stage mesh, as `sharding.resolve` gives
  them). Pure: jit it with the tables as arguments."""
  plan = terms(
    t.tables, Resolution(value_mask=value_mask[t.value_source], op_mask=op_mask[t.op_source])
  )
  num_stages, m, v = t.stages, t.microbatches, t.chunks
  step_op, step_value = t.op_phase == Phase.STEP, t.value_phase == Phase.STEP
  edge_op = t.tables.edge_op
  reduction_op = edge_op[t.tables.reduction_edge]  # [R]
  edge_stages, reduction_stages = t.op_stages[edge_op], t.op_stages[reduction_op]
  per_microbatch = ~step_op[edge_op] & ~t.edge_invariant  # [E]
  # The loop's reductions of accumulated gradients over axes it is not manual over run in
  # every iteration, like its microbatch reductions.
  deferred = (plan.reduced_axes & ~manual_axes(t, value_mask)) == 0  # [R]
  accumulated = t.op_phase[reduction_op] == Phase.ACCUMULATED
  reduction_phase = jnp.where(
    accumulated & t.op_looped[reduction_op] & ~deferred, Phase.MICROBATCH, t.op_phase[reduction_op]
  )

  def by_stage(x: jax.Array, where: jax.Array, stages: jax.Array) -> jax.Array:
    return jnp.where(where, x, 0.0) @ stages

  def compute(step: bool, looped: bool = False) -> jax.Array:
    """Per stage: the compute of its step ops or of its microbatch ops (`looped`: those
    of the stages' loop only)."""
    op_in, value_in = step_op == step, step_value == step
    if looped:
      op_in, value_in = op_in & t.op_looped, value_in & t.value_looped
    return by_stage(plan.op_compute_s, op_in, t.op_stages) + by_stage(
      plan.value_compute_s, value_in, t.value_stages
    )

  reshard = plan.gather.seconds + plan.all_to_all.seconds
  reduce = plan.reduce_scatter.seconds + plan.all_reduce.seconds
  inverse_shards = 1.0 / plan.value_shards
  residual = t.residual_bytes @ inverse_shards  # [S]
  looped_accumulator = t.accumulator_bytes @ inverse_shards  # [S]
  iterations = m * v + num_stages - 1
  # [S] each, per iteration.
  stacking = jnp.where(
    iterations > 1, (4.0 + t.inner_loop) * residual * t.hbm_seconds_per_byte, 0.0
  )
  accumulation = jnp.where(
    iterations > 1, (3.0 + t.inner_loop) * looped_accumulator * t.hbm_seconds_per_byte, 0.0
  )
  microbatch_compute = compute(False) + stacking + accumulation
  microbatch_comm = by_stage(reshard, per_microbatch, edge_stages) + by_stage(
    reduce, reduction_phase == Phase.MICROBATCH, reduction_stages
  )
  gradient_reduction = by_stage(
    reduce * t.reduction_once, reduction_phase == Phase.ACCUMULATED, reduction_stages
  )
  update = (
    compute(True)
    + by_stage(reshard, ~per_microbatch, edge_stages)
    + by_stage(reduce, reduction_phase == Phase.STEP, reduction_stages)
  )
  loop_compute = compute(False, looped=True) + stacking + accumulation
  loop = loop_compute + (
    by_stage(reshard, per_microbatch & t.op_looped[edge_op], edge_stages)
    + by_stage(
      reduce, (reduction_phase == Phase.MICROBATCH) & t.op_looped[reduction_op], reduction_stages
    )
  )
  microbatch = microbatch_compute + microbatch_comm
  pace_stage = jnp.argmax(m * microbatch + (num_stages - 1) / v * loop)
  flush_stage = jnp.argmax(gradient_reduction + update)
  pace = microbatch[pace_stage]

  sent = t.transfer_bytes @ inverse_shards  # [3, S]
  transfer = iterations * (jnp.max(_permute(t, sent[0])) + jnp.max(_permute(t, sent[1]))) + jnp.max(
    _permute(t, sent[2])
  )
  permute_bytes = iterations * (sent[0] + sent[1]) + sent[2]  # [S]
  permute_count = iterations * ((sent[0] > 0).astype(jnp.float32) + (sent[1] > 0)) + (sent[2] > 0)

  live = jnp.max(t.live_rows @ inverse_shards, axis=1)
  largest_transient = jnp.max(plan.transient_bytes[:, None] * edge_stages, axis=0, initial=0.0)
  gathered = plan.gathered_bytes @ edge_stages + largest_transient
  accumulator = jnp.where(iterations > 1, looped_accumulator, 0.0)
  peak = live + gathered + (t.in_flight - 1.0) * residual + accumulator

  # Per step: a microbatch op off the loop runs M times, one in the loop every iteration
  # (M + (S - 1) / V microbatches' worth, the bubble's included), a step op once.
  loop_runs = m + (num_stages - 1) / v
  edge_runs = jnp.where(per_microbatch, jnp.where(t.op_looped[edge_op], loop_runs, m), 1.0)
  reduction_runs = jnp.where(
    reduction_phase == Phase.MICROBATCH,
    jnp.where(t.op_looped[reduction_op], loop_runs, m),
    jnp.where(reduction_phase == Phase.ACCUMULATED, t.reduction_once, 1.0),
  )
  kinds = (plan.all_reduce, plan.gather, plan.reduce_scatter, plan.all_to_all)  # In `KINDS` order.
  runs = (reduction_runs, edge_runs, reduction_runs, edge_runs)
  stages = (reduction_stages, edge_stages, reduction_stages, edge_stages)
  comm_bytes = jnp.stack(
    [(k.bytes * r) @ s for k, r, s in zip(kinds, runs, stages)] + [permute_bytes]
  )  # [5, S]
  comm_count = jnp.stack(
    [(k.count * r) @ s for k, r, s in zip(kinds, runs, stages)] + [permute_count]
  )

  steady, bubble = m * pace, (num_stages - 1) / v * loop[pace_stage]
  pipeline_terms = PipelineTerms(
    microbatch_compute_s=microbatch_compute,
    microbatch_comm_s=microbatch_comm,
    stacking_s=stacking,
    accumulation_s=accumulation,
    loop_s=loop,
    gradient_reduction_stage_s=gradient_reduction,
    update_stage_s=update,
    live_bytes=live,
    gathered_bytes=gathered,
    residual_bytes=residual,
    in_flight=t.in_flight,
    accumulator_bytes=accumulator,
    peak_memory=peak,
    pace_s=pace,
    steady_s=steady,
    bubble_s=bubble,
    transfer_s=transfer,
    gradient_reduction_s=gradient_reduction[flush_stage],
    update_s=update[flush_stage],
    permute_bytes=permute_bytes[pace_stage],
  )
  step_time = steady + bubble + transfer + gradient_reduction[flush_stage] + update[flush_stage]
  compute_time = (
    m * microbatch_compute[pace_stage]
    + (num_stages - 1) / v * loop_compute[pace_stage]
    + compute(True)[flush_stage]
  )
  return PipelineCost(
    step_time=step_time,
    compute_time=compute_time,
    comm_time=step_time - compute_time,
    peak_memory=jnp.max(peak),
    fits=jnp.all(peak <= t.tables.hbm_bytes),
    comm_bytes=comm_bytes[:, pace_stage],
    comm_count=comm_count[:, pace_stage],
    terms=pipeline_terms,
  )
