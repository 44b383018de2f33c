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
* `stacking`: per stage, per tick of the lowered loop (T ticks, `Pipeline.ticks`,
  spread over the loop's M + (S - 1) / V microbatch times): each tick writes the
  residuals its forward saves into a slot of the stage's residual buffer and reads those
  its backward needs out of another (a dynamic-update-slice and a dynamic slice, each
  reading and writing the residuals: four passes over one chunk's share, 1 / V, of a
  microbatch's residuals of the loop's ops at HBM bandwidth), in the loop's time;
* `accumulation`: per stage, per tick: the tick adds its gradients of the stage's
  weights into their sums (three passes over one chunk's accumulated gradients: the sum
  and the gradient read, the sum written), in the loop's time. Where a stage runs its
  layers in a loop of its own (a scanned stack with more than one layer per stage),
  every tick first fills that loop's stacked outputs with zeros: one more pass over the
  gradients here, and one over the residuals in `stacking`;
* the pace-setting stage: the one whose M microbatches plus (S - 1) / V bubble loop
  times are longest; `pace` its microbatch time; `steady` = M x pace; `bubble` =
  (S - 1) / V x its loop time (interleaved: Megatron-LM's (S - 1) / V stage-times);
* `transfer`: each of the T ticks of the lowered schedule's loop (`Pipeline.ticks`)
  sends the boundary activations forward and their gradients backward with a
  collective-permute on the stage axis's link (alpha-beta: one hop of each device's
  shard), every stage at once, a ring whose idle ticks send zeros (the largest boundary
  counts); values summed on another stage once per step (a tied weight's gradient) once.
  With `Hardware.async_collectives` a tick's sends run behind the next tick's compute
  (they add what exceeds a tick's share of the loop's compute), except the S - 1 of the
  pipeline's fill and drain;
* `gradient_reduction` and `update`: once per step after the last microbatch, on every
  stage at once (the stage whose sum is largest counts): the reduction of the
  accumulated gradients (with the sum over the stage axis of the gradients of the
  parameters outside the stack, which every stage of the lowered loop keeps whole: a
  ring all-reduce on the stage axis's link), and the step ops (optimizer update, weight
  casts, reshards of loop invariants). The lowered loop defers a reduction of its layers'
  gradients only over the axes it is manual over (`manual_axes`): the stage axis, and the
  batch axes where no stacked weight is split over them other than on its layer dim. A
  reduction over any other axis XLA runs in every tick, where the gradient is made: it
  is a microbatch collective of the loop. With `Pipeline.gather_weights_once` the loop is
  manual over the batch axes whatever the weights' storage, and the reads of weights
  (`StagedProgram.weight_reads`) reshard once a step, before the loop.

step time = steady + bubble + transfer + gradient_reduction + update, exactly.

Peak memory per stage: the largest live-bytes row of its values for one microbatch (its
parameters, optimizer state and one microbatch's activations, as `simulator.total`
counts them; a scanned stack's rows at L / S layers; the first stage's embedding and the
last stage's head and loss at microbatch size) plus its gathered operand copies, plus
the residual buffer (`residual_sets` sets of its residuals: the activations its forward
makes for its backward, with remat only the layer inputs), plus the accumulated
gradients where the loop runs more than one iteration (it sums the gradients over its
iterations, the bubble's included). The residual buffer is what the lowered loop
(`xla.scheduled`) allocates for the stage: a slot per microbatch in flight
(`Pipeline.in_flight`: M under GPipe, S - s on stage s under 1F1B), every one besides the
live row's microbatch, whose residuals are a copy of its slot's: a forward makes them
before the tick writes them into their slot, and a backward's pullback (a scanned
stack's loop over the stage's layers) reads a copy of its slot, which stays allocated.
With one stage there is no buffer (`residual_sets` 0): the live row's microbatch. The loop
receives its weights whole over the axes it is manual over and sums their gradients so:
a stage whose weights are stored split over those axes holds a gathered copy of them and
its sums at that size. The step's peak is the largest stage's. With S = 1 this is gradient
accumulation: one microbatch's activations and the gradient sums.

The terms are a pure function of arrays (`pipeline_cost` jits with the tables as
arguments: one compile per table shape). Building the tables
(`simulator.pipeline_tables`: placing the ops, the microbatch program's signatures,
per-stage live rows) is numpy, once per program, mesh and pipeline.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from automap_rl.sharding import Resolution
from automap_rl.simulator.collectives import axes_of, group_size
from automap_rl.simulator.cost import Cost, CostTerms, terms
from automap_rl.simulator.overlap import unhidden
from automap_rl.simulator.pipeline_tables import PipelineTables
from automap_rl.stages import Phase


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
  the stage's largest one made for one read, and the weights the loop receives gathered),
  `residual_bytes` (one microbatch's residuals), `in_flight` (sets of them held),
  `residual_sets` (sets of them the residual buffer allocates besides the live row's),
  `accumulator_bytes` (accumulated gradients as the loop sums them, 0 for M = 1),
  `peak_memory`.
  Inside `pipeline_cost` these have the tables' padded stage count; `for_stages` cuts
  them to S.
  Scalars: `pace_s` (the pace-setting stage's microbatch time), `steady_s` (M x pace),
  `bubble_s` ((S - 1) / V x its `loop_s`), `transfer_s`, `gradient_reduction_s` and `update_s` (of
  the stage whose
  sum of the two is largest), `permute_bytes` (the stage transfers' collective-permute bytes
  per device of the pace-setting stage).
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
  residual_sets: jax.Array
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
      `COMM_KINDS` order (collective-permutes last: stage transfers and the
      stages' own), [5].
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
  "residual_sets",
  "accumulator_bytes",
  "peak_memory",
)


def for_stages(cost: PipelineCost, stages: int) -> PipelineCost:
  """`cost` with its per-stage terms cut to the first `stages` (the rest pad the tables)."""
  return cost.replace(
    terms=cost.terms.replace(**{name: getattr(cost.terms, name)[:stages] for name in STAGE_TERMS})
  )


def _permute(t: PipelineTables, nbytes: jax.Array) -> jax.Array:
  """Seconds of collective-permutes of `nbytes` per device (one hop), 0 for none."""
  return jnp.where(nbytes > 0, nbytes * t.permute_seconds_per_byte + t.permute_latency, 0.0)


def manual_axes(t: PipelineTables, value_mask: jax.Array) -> jax.Array:
  """The mesh axes (bit mask of the stage mesh's) the lowered loop is manual over besides
  the stage axis: the plan's batch axes (its mask of the batch's dim 0), where no stacked
  weight is split over them other than on its layer dim or the weights are gathered once
  a step (`Pipeline.gather_weights_once`); else none. `value_mask` is the full program's
  [Uv_full, Rv]; int8 []."""
  value_mask = value_mask.astype(jnp.int8)
  rows = jnp.where(
    t.batch_signature >= 0, value_mask[jnp.maximum(t.batch_signature, 0), 0], 0
  ).astype(jnp.int8)
  weights = jnp.where(
    (t.stacked_signatures >= 0)[:, None], value_mask[jnp.maximum(t.stacked_signatures, 0), 1:], 0
  )
  split = jnp.any((weights & rows) != 0) & ~t.gather_weights_once
  return jnp.where(split, jnp.int8(0), rows)


def _gathered_weight_bytes(
  t: PipelineTables, value_mask: jax.Array, inverse_shards: jax.Array
) -> jax.Array:
  """Per stage, the bytes per device of its accumulated gradients' sums (as many as its
  weights') held whole over the axes the loop is manual over, as the loop holds them, and
  its weights gathered once a step (`Pipeline.gather_weights_once`), [S]. `value_mask`:
  the full program's [Uv_full, Rv]; `inverse_shards`: 1 / each split value signature's
  shards, [Uv]."""
  masks = value_mask.astype(jnp.int8)[t.value_source]  # [Uv, Rv]
  axes = functools.reduce(jnp.bitwise_or, [masks[:, d] for d in range(masks.shape[1])])
  over_manual = group_size(t.tables, axes_of(t.tables, axes & manual_axes(t, value_mask)))
  return t.accumulator_bytes @ (inverse_shards * over_manual)


def _without_weight_gathers(plan: CostTerms, edges: jax.Array) -> CostTerms:
  """`plan` without the all-gathers of the `edges` [E] and their gathered copies: the
  reads of weights a loop receives gathered once a step (`_weight_gather` prices that)."""
  keep = (~edges).astype(jnp.float32)
  gather = plan.gather
  return plan.replace(
    gather=type(gather)(*(field * keep for field in gather)),
    gathered_bytes=plan.gathered_bytes * keep,
    transient_bytes=plan.transient_bytes * keep,
  )


def _weight_gather(
  t: PipelineTables, value_mask: jax.Array, received: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Bytes per device and seconds, per stage [S] each, of gathering a stage's weights over
  the axes the loop is manual over once a step, before it (`Pipeline.gather_weights_once`):
  a ring all-gather over n devices in which each receives `received` [S] bytes (its
  weights whole less its own shard). Its bytes are the gathered buffer's, received n /
  (n - 1) (the convention of `xla.hlo.collectives`). Zero without `gather_weights_once`."""
  manual = manual_axes(t, value_mask).astype(jnp.uint8)
  devices = jnp.asarray(t.tables.mask_group)[manual]
  per_byte = jnp.asarray(t.tables.mask_seconds_per_byte)[manual]
  latency = (devices - 1.0) * jnp.asarray(t.tables.mask_latency)[manual]
  received = jnp.where(t.gather_weights_once & (devices > 1), received, 0.0)
  gathered = received * devices / jnp.maximum(devices - 1.0, 1.0)
  return gathered, jnp.where(received > 0, received * per_byte + latency, 0.0)


class _Placement(NamedTuple):
  """Where a plan's collectives run: per edge and per reduction, its stages ([E, S], [R, S])
  and when it runs (`per_microbatch` [E]; `reduction_phase`, a `Phase` per reduction [R])."""

  edge_stages: jax.Array
  reduction_stages: jax.Array
  per_microbatch: jax.Array
  reduction_phase: jax.Array


def _placement(t: PipelineTables, plan: CostTerms, value_mask: jax.Array) -> _Placement:
  """Each collective's stages and phase. The loop's reductions of accumulated gradients
  over axes it is not manual over run in every iteration, like its microbatch reductions."""
  edge_op = t.tables.edge_op
  reduction_op = edge_op[t.tables.reduction_edge]  # [R]
  deferred = (plan.reduced_axes & ~manual_axes(t, value_mask)) == 0  # [R]
  accumulated = t.op_phase[reduction_op] == Phase.ACCUMULATED
  return _Placement(
    edge_stages=t.op_stages[edge_op],
    reduction_stages=t.op_stages[reduction_op],
    per_microbatch=(t.op_phase[edge_op] != Phase.STEP) & ~t.edge_invariant,
    reduction_phase=jnp.where(
      accumulated & t.op_looped[reduction_op] & ~deferred,
      Phase.MICROBATCH,
      t.op_phase[reduction_op],
    ),
  )


def _by_stage(x: jax.Array, where: jax.Array, stages: jax.Array) -> jax.Array:
  """Per stage, the sum of `x` where `where` ([N] each) over the entries' stages [N, S]."""
  return jnp.where(where, x, 0.0) @ stages


def _compute(t: PipelineTables, plan: CostTerms, step: bool, looped: bool = False) -> jax.Array:
  """Per stage: the compute of its step ops or of its microbatch ops (`looped`: those of
  the stages' loop only), [S]."""
  op_in, value_in = (t.op_phase == Phase.STEP) == step, (t.value_phase == Phase.STEP) == step
  if looped:
    op_in, value_in = op_in & t.op_looped, value_in & t.value_looped
  return _by_stage(plan.op_compute_s, op_in, t.op_stages) + _by_stage(
    plan.value_compute_s, value_in, t.value_stages
  )


class _Comm(NamedTuple):
  """Per stage [S], seconds of a set of collectives: those on the path of the ops that read
  them (`exposed`), those an asynchronous runtime can hide behind compute (`hideable`:
  `CostTables.edge_hideable`, `reduction_hideable`), and one run of the longest hideable
  one (`one_run`), which has nothing to run behind."""

  exposed: jax.Array
  hideable: jax.Array
  one_run: jax.Array


def _comm(
  t: PipelineTables, plan: CostTerms, where: _Placement, edge_in: jax.Array, reduction_in: jax.Array
) -> _Comm:
  """The collectives of the edges `edge_in` [E] and the reductions `reduction_in` [R]
  (float: their share of a step, 1 for all of it) by stage."""
  tables = t.tables
  reshard = (plan.gather.seconds + plan.all_to_all.seconds + plan.permute.seconds) * edge_in
  reduce = (
    plan.reduce_scatter.seconds + plan.all_reduce.seconds + plan.dot_permute.seconds
  ) * reduction_in
  edge_hide, reduction_hide = tables.edge_hideable, tables.reduction_hideable
  by_edge = lambda mask: _by_stage(reshard, mask, where.edge_stages)
  by_reduction = lambda mask: _by_stage(reduce, mask, where.reduction_stages)
  longest = lambda x, runs, stages: jnp.max(
    x[:, None] / jnp.maximum(runs, 1.0)[:, None] * stages, axis=0, initial=0.0
  )
  return _Comm(
    exposed=by_edge(~edge_hide) + by_reduction(~reduction_hide),
    hideable=by_edge(edge_hide) + by_reduction(reduction_hide),
    one_run=jnp.maximum(
      longest(jnp.where(edge_hide, reshard, 0.0), tables.edge_weight, where.edge_stages),
      longest(
        jnp.where(reduction_hide, reduce, 0.0), tables.reduction_weight, where.reduction_stages
      ),
    ),
  )


def _unhidden(t: PipelineTables, hideable: jax.Array, compute: jax.Array, one_run: jax.Array):
  """`overlap.unhidden` on the tables' backend, [S]."""
  return unhidden(t.tables.async_collectives, hideable, compute, one_run)


def _stage_seconds(
  t: PipelineTables, plan: CostTerms, where: _Placement, residual: jax.Array, sums: jax.Array
) -> dict[str, jax.Array]:
  """Per stage [S]: the typed times of `PipelineTerms` (`microbatch_compute_s`,
  `microbatch_comm_s`, `stacking_s`, `accumulation_s`, `loop_s`,
  `gradient_reduction_stage_s`, `update_stage_s`) and the loop's compute (`loop_compute`),
  from one microbatch's `residual` and gradient `sums` bytes per device [S].

  A microbatch's hideable collectives run behind its compute. The last microbatch's
  compute and the step ops' compute also hide the hideable collectives of the step (the
  accumulated gradients' reduction, the step ops' reshards): what they leave unhidden
  counts in `gradient_reduction_stage_s`."""
  edge_op, reduction_op = t.tables.edge_op, t.tables.edge_op[t.tables.reduction_edge]
  # Per microbatch time of the loop (M + (S - 1) / V of them), its share of the T ticks,
  # each of which passes over one chunk's residuals and gradient sums (1 / V of a stage's).
  per_tick = t.ticks / (t.microbatches * t.chunks + t.stages - 1.0) * t.hbm_seconds_per_byte
  stacking = jnp.where(t.ticks > 1, (4.0 + t.inner_loop) * residual * per_tick, 0.0)
  accumulation = jnp.where(t.ticks > 1, (3.0 + t.inner_loop) * sums * per_tick, 0.0)
  microbatch_reduction = where.reduction_phase == Phase.MICROBATCH
  ones = lambda mask: mask.astype(jnp.float32)
  microbatch_compute = _compute(t, plan, False) + stacking + accumulation
  loop_compute = _compute(t, plan, False, looped=True) + stacking + accumulation
  update_compute = _compute(t, plan, True)
  microbatch = _comm(t, plan, where, ones(where.per_microbatch), ones(microbatch_reduction))
  loop = _comm(
    t,
    plan,
    where,
    ones(where.per_microbatch & t.op_looped[edge_op]),
    ones(microbatch_reduction & t.op_looped[reduction_op]),
  )
  reduction = _comm(
    t,
    plan,
    where,
    jnp.zeros_like(t.tables.edge_weight),
    jnp.where(where.reduction_phase == Phase.ACCUMULATED, t.reduction_once, 0.0),
  )
  update = _comm(
    t, plan, where, ones(~where.per_microbatch), ones(where.reduction_phase == Phase.STEP)
  )
  microbatch_unhidden = _unhidden(t, microbatch.hideable, microbatch_compute, microbatch.one_run)
  step_unhidden = _unhidden(
    t,
    microbatch.hideable + reduction.hideable + update.hideable,
    microbatch_compute + update_compute,
    jnp.maximum(jnp.maximum(microbatch.one_run, reduction.one_run), update.one_run),
  )
  return {
    "microbatch_compute_s": microbatch_compute,
    "microbatch_comm_s": microbatch.exposed + microbatch_unhidden,
    "stacking_s": stacking,
    "accumulation_s": accumulation,
    "loop_compute": loop_compute,
    "loop_s": loop_compute + loop.exposed + _unhidden(t, loop.hideable, loop_compute, loop.one_run),
    "gradient_reduction_stage_s": reduction.exposed + step_unhidden - microbatch_unhidden,
    "update_stage_s": update_compute + update.exposed,
  }


def _transfers(t: PipelineTables, sent: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each stage's bytes and count of stage transfers a step, from the stages' sends `sent`
  [3, S] (forward and backward per tick, once per step): every stage sends the largest
  boundary's shapes each tick (`transfer` in the module docstring), [S] each."""
  ring = jnp.max(sent[:2], axis=1)  # [2]
  nbytes = t.ticks * (ring[0] + ring[1]) + sent[2]
  count = t.ticks * ((ring[0] > 0).astype(jnp.float32) + (ring[1] > 0)) + (sent[2] > 0)
  return nbytes, count


def _collectives(
  t: PipelineTables,
  plan: CostTerms,
  where: _Placement,
  sent: jax.Array,
  per_step: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
  """Bytes and counts per device a step, per kind (`COMM_KINDS`) and stage, [5, S]
  each. A microbatch op runs M times (the bubble's ticks wait: they run none); a step op
  once; `sent` [3, S] is each stage's sends (forward and backward per tick, once per
  step); `per_step`: the bytes of the all-reduce over the stage axis ([] or [S]) and of
  the weights' all-gather ([S]) that run once a step, one collective each."""
  m = t.microbatches
  edge_runs = jnp.where(where.per_microbatch, m, 1.0)
  reduction_runs = jnp.where(
    where.reduction_phase == Phase.MICROBATCH,
    m,
    jnp.where(where.reduction_phase == Phase.ACCUMULATED, t.reduction_once, 1.0),
  )
  kinds = (plan.all_reduce, plan.gather, plan.reduce_scatter, plan.all_to_all)  # `KINDS` order.
  runs = (reduction_runs, edge_runs, reduction_runs, edge_runs)
  stages = (where.reduction_stages, where.edge_stages, where.reduction_stages, where.edge_stages)
  transfer_bytes, transfer_count = _transfers(t, sent)
  permute_bytes = (
    transfer_bytes
    + (plan.permute.bytes * edge_runs) @ where.edge_stages
    + (plan.dot_permute.bytes * reduction_runs) @ where.reduction_stages
  )  # [S]
  permute_count = (
    transfer_count
    + (plan.permute.count * edge_runs) @ where.edge_stages
    + (plan.dot_permute.count * reduction_runs) @ where.reduction_stages
  )
  comm_bytes = jnp.stack(
    [(k.bytes * r) @ s for k, r, s in zip(kinds, runs, stages)] + [permute_bytes]
  )
  comm_count = jnp.stack(
    [(k.count * r) @ s for k, r, s in zip(kinds, runs, stages)] + [permute_count]
  )
  for kind, nbytes in enumerate(per_step):  # `COMM_KINDS`: all-reduce, then all-gather.
    comm_bytes = comm_bytes.at[kind].add(nbytes)
    comm_count = comm_count.at[kind].add((nbytes > 0).astype(jnp.float32))
  return comm_bytes, comm_count


def _stage_sum(t: PipelineTables, inverse_shards: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Bytes per device and seconds of the sum over the stage axis of the gradients of the
  parameters outside the stack (`PipelineTables.stage_summed_bytes`): a ring all-reduce
  over the S stages on the stage axis's link, [] each."""
  nbytes = t.stage_summed_bytes @ inverse_shards
  hops = 2.0 * (t.stages - 1.0)
  seconds = hops / t.stages * nbytes * t.permute_seconds_per_byte + hops * t.permute_latency
  return nbytes, jnp.where(nbytes > 0, seconds, 0.0)


def _transfer_seconds(t: PipelineTables, sent: jax.Array, loop_compute: jax.Array) -> jax.Array:
  """Seconds of the step's stage transfers from the stages' sends `sent` [3, S] and the
  pace-setting stage's loop compute per microbatch []: a tick's sends run behind the next
  tick's compute where collectives are asynchronous, but the pipeline's fill and drain
  wait for theirs."""
  hop = jnp.max(_permute(t, sent[0])) + jnp.max(_permute(t, sent[1]))
  tick_compute = loop_compute * (t.microbatches + (t.stages - 1) / t.chunks) / t.ticks
  behind = jnp.maximum(hop - tick_compute, 0.0)
  sends = jnp.where(
    t.tables.async_collectives,
    (t.stages - 1) * hop + (t.ticks - t.stages + 1) * behind,
    t.ticks * hop,
  )
  return sends + jnp.max(_permute(t, sent[2]))


def pipeline_cost(t: PipelineTables, value_mask: jax.Array, op_mask: jax.Array) -> PipelineCost:
  """The cost of a pipelined plan from the full program's resolution (`value_mask`
  [Uv_full, Rv], `op_mask` [Uo_full, Rf] on the stage mesh, as `sharding.resolve` gives
  them). Pure: jit it with the tables as arguments."""
  plan = terms(
    t.tables, Resolution(value_mask=value_mask[t.value_source], op_mask=op_mask[t.op_source])
  )
  plan = _without_weight_gathers(plan, t.gather_weights_once & t.edge_weight_read)
  num_stages, m, v = t.stages, t.microbatches, t.chunks
  where = _placement(t, plan, value_mask)
  inverse_shards = 1.0 / plan.value_shards
  residual = t.residual_bytes @ inverse_shards  # [S]
  stored_sums = t.accumulator_bytes @ inverse_shards  # [S]
  sums = _gathered_weight_bytes(t, value_mask, inverse_shards)  # As the loop sums them.
  iterations = m * v + num_stages - 1
  stage = _stage_seconds(t, plan, where, residual, sums)
  weight_gather_bytes, weight_gather_s = _weight_gather(t, value_mask, sums - stored_sums)
  stage["update_stage_s"] = stage["update_stage_s"] + weight_gather_s
  stage_summed, stage_sum_s = _stage_sum(t, inverse_shards)
  stage["gradient_reduction_stage_s"] = stage["gradient_reduction_stage_s"] + stage_sum_s
  microbatch = stage["microbatch_compute_s"] + stage["microbatch_comm_s"]
  flush = stage["gradient_reduction_stage_s"] + stage["update_stage_s"]
  pace_stage = jnp.argmax(m * microbatch + (num_stages - 1) / v * stage["loop_s"])
  flush_stage = jnp.argmax(flush)

  sent = t.transfer_bytes @ inverse_shards  # [3, S]
  transfer = _transfer_seconds(t, sent, stage["loop_compute"][pace_stage])
  comm_bytes, comm_count = _collectives(t, plan, where, sent, (stage_summed, weight_gather_bytes))

  live = jnp.max(t.live_rows @ inverse_shards, axis=1)
  # The loop's weights enter it whole over its manual axes and their gradients are summed
  # whole: a stage whose weights are stored split over those axes holds a gathered copy.
  largest_transient = jnp.max(
    plan.transient_bytes[:, None] * where.edge_stages, axis=0, initial=0.0
  )
  gathered = plan.gathered_bytes @ where.edge_stages + largest_transient + sums - stored_sums
  accumulator = jnp.where(iterations > 1, sums, 0.0)
  # The residual buffer's slots (the module docstring); none for one stage.
  residual_sets = jnp.where(num_stages > 1, t.in_flight, 0.0)
  peak = live + gathered + residual_sets * residual + accumulator

  steady, bubble = m * microbatch[pace_stage], (num_stages - 1) / v * stage["loop_s"][pace_stage]
  loop_compute = stage.pop("loop_compute")
  pipeline_terms = PipelineTerms(
    **stage,
    live_bytes=live,
    gathered_bytes=gathered,
    residual_bytes=residual,
    in_flight=t.in_flight,
    residual_sets=residual_sets,
    accumulator_bytes=accumulator,
    peak_memory=peak,
    pace_s=microbatch[pace_stage],
    steady_s=steady,
    bubble_s=bubble,
    transfer_s=transfer,
    gradient_reduction_s=stage["gradient_reduction_stage_s"][flush_stage],
    update_s=stage["update_stage_s"][flush_stage],
    permute_bytes=_transfers(t, sent)[0][pace_stage],
  )
  step_time = (
    steady
    + bubble
    + transfer
    + stage["gradient_reduction_stage_s"][flush_stage]
    + stage["update_stage_s"][flush_stage]
  )
  compute_time = (
    m * stage["microbatch_compute_s"][pace_stage]
    + (num_stages - 1) / v * loop_compute[pace_stage]
    + _compute(t, plan, True)[flush_stage]
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
