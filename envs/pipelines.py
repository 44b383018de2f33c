"""The environment's pipeline options: a small menu of `Pipeline`s of one program on one mesh.

With `EnvConfig.pipelines = P > 0` an episode starts with a pipeline action: one of P
options, option 0 "no pipeline", then 1F1B pipelines of the program's largest scanned
layer stack, the ones `xla.pipeline_lower` runs (padded to P with options never legal; an
unrolled stack is priced when asked for, `Problem.plan_cost`, but offered only once it is
lowered). Each pipelines over one mesh axis (slowest link
first) with S equal to that axis's size (when S divides the stack's layers), so the stages
take the axis whole: the intra-op decisions after it may not use the stage axis (its
actions are masked) and resolve as without a pipeline, on the full mesh; no stage-mesh
resolution is needed. Microbatch counts: S and 4 S where they divide the batch.

A pipelined plan must divide at microbatch and stage size (`PipelineProblem`): an intra-op
action is legal under an option only if no slot that could take its axis would then not
divide at that size (`slot_divisible`, the divisibility of every signature that shares
the slot's owner, at microbatch and stage size).
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import sharding, simulator
from automap_rl.pipeline import Pipeline, batch_size
from automap_rl.problem import Problem
from automap_rl.stages import EVERY_STAGE, Phase

# Fills of padded rows that add nothing (as `simulator.build_pipeline_tables` pads; -1: the
# simulator's never-sharded factor), by field; 0 otherwise.
_FILL = {
  "in_flight": 1.0,
  "value_phase": int(Phase.STEP),
  "op_phase": int(Phase.STEP),
  "op_dense_factor": -1,
  "reduction_partial_sums": 1.0,
  "loop_repeats": 1.0,
  "edge_dim_factors": -1,
  "stacked_signatures": -1,
}


@chex.dataclass(frozen=True)
class PipelineOptions:
  """The P pipeline options of an environment as arrays (row 0: no pipeline; padding rows
  are never legal). Uv, Uo, Q, W as in `envs.tables`.

  Attributes:
    valid: which options are real, bool [P].
    axis: the stage axis of each (-1: none), int32 [P].
    stages, microbatches: S and M of each (1 for none), f32 [P].
    slot_divisible: `EnvTables.slot_divisible` at each option's microbatch and stage size
      (the AND over the signatures of each owner slot), int32 [P, Q, W].
    value_stage, op_stage: the mean stage of each signature's values (ops) as (s + 1) / S,
      a scanned stack's (on every stage) (S + 1) / 2S, 0 without a pipeline, f32 [P, Uv], [P, Uo].
    tables: each option's `simulator.PipelineTables`, padded to common shapes and stacked,
      [P, ...] (rows without a pipeline repeat row 1); None when no option pipelines.
  """

  valid: jax.Array
  axis: jax.Array
  stages: jax.Array
  microbatches: jax.Array
  slot_divisible: jax.Array
  value_stage: jax.Array
  op_stage: jax.Array
  tables: simulator.PipelineTables | None


def menu(problem: Problem, count: int) -> tuple[Pipeline | None, ...]:
  """At most `count` options (see the module docstring): None (no pipeline) first, then the
  pipelines that `problem.pipelined` accepts; `count` 0 gives none at all."""
  if count < 1:
    return ()
  stacks = problem.layer_stacks
  scanned = [i for i, stack in enumerate(stacks) if stack.scanned]
  if not scanned:
    return (None,)
  index = max(scanned, key=lambda i: stacks[i].layers)
  mesh, batch = problem.mesh, batch_size(problem.program)
  axes = sorted(mesh.axis_names, key=lambda a: (mesh.link(a).bandwidth, mesh.axis_index(a)))
  out: list[Pipeline | None] = [None]
  for axis in axes:
    size = mesh.axis_size(axis)
    if size < 2 or stacks[index].layers % size:
      continue
    for m in (size, 4 * size):
      if batch % m == 0:
        pipeline = Pipeline(axis, stages=size, microbatches=m, schedule="1f1b", stack=index)
        try:
          problem.pipelined(pipeline)
        except ValueError:
          continue
        out.append(pipeline)
  return tuple(out[:count])


def _micro_sizes(full: np.ndarray, source: np.ndarray, sizes: np.ndarray) -> np.ndarray:
  """Per full-program signature, the gcd of its sizes at microbatch and stage size over the
  split signatures `source` points it to (its full sizes where none does), [U, R]."""
  out = np.zeros_like(full)
  np.gcd.at(out, source, sizes[:, : full.shape[1]].astype(full.dtype))
  return np.where(out == 0, full, out)


def _owner_slot_bits(problem: Problem, flat_bits: np.ndarray) -> np.ndarray:
  """`flat_bits` (per value dim then op factor, flattened) ANDed over the slots that share
  an owner slot (`sharding.Owners`), int [Uv * Rv + Uo * Rf]."""
  owners = problem.owners
  owner = np.concatenate([owners.value_owner.ravel(), owners.op_owner.ravel()])
  slot = np.concatenate([owners.value_slot.ravel(), owners.op_slot.ravel()])
  key = np.where(owner >= 0, owner * owners.classes.shape[1] + slot, -1)
  _, inverse = np.unique(key, return_inverse=True)
  acc = np.full(inverse.max() + 1, -1, np.int64)
  np.bitwise_and.at(acc, inverse, flat_bits.astype(np.int64))
  return np.where(key >= 0, acc[inverse], flat_bits)


def _positions(stage: np.ndarray, sig: np.ndarray, num_sigs: int, stages: int) -> np.ndarray:
  """The mean stage position of each signature's members (see `PipelineOptions`), f32 [U]."""
  position = np.where(stage == EVERY_STAGE, (stages + 1) / (2 * stages), (stage + 1) / stages)
  real = sig >= 0
  total, count = np.zeros(num_sigs), np.zeros(num_sigs)
  np.add.at(total, sig[real], position[real])
  np.add.at(count, sig[real], 1.0)
  return (total / np.maximum(count, 1.0)).astype(np.float32)


def _padded_alike(tables: Sequence[simulator.PipelineTables]) -> list[simulator.PipelineTables]:
  """`tables` (of any one leading shape) padded to their largest shapes, field by field,
  with rows that add nothing."""
  flat = [jax.tree_util.tree_flatten_with_path(t) for t in tables]
  columns = []
  for column in zip(*(leaves for leaves, _ in flat)):
    fill = _FILL.get(column[0][0][-1].name, 0)
    arrays = [np.asarray(a) for _, a in column]
    shape = tuple(max(n) for n in zip(*(a.shape for a in arrays)))
    columns.append(
      [
        np.pad(a, [(0, n - m) for n, m in zip(shape, a.shape)], constant_values=fill)
        if a.ndim
        else a
        for a in arrays
      ]
    )
  return [jax.tree_util.tree_unflatten(flat[0][1], leaves) for leaves in zip(*columns)]


def _stacked(tables: list[simulator.PipelineTables]) -> simulator.PipelineTables:
  """`tables` padded to their largest shapes (`_padded_alike`) and stacked [n, ...]."""
  return jax.tree.map(lambda *xs: np.stack(xs), *_padded_alike(tables))


def alike(options: Sequence[PipelineOptions]) -> list[PipelineOptions]:
  """The options of several programs (each [P, ...], one P) with pricing tables of one
  shape, to be stacked into a batch: each padded to the largest; a program none of whose
  options pipelines takes another's tables (never read: its options price nothing)."""
  priced = [o.tables for o in options if o.tables is not None]
  if not priced:
    return list(options)
  padded = _padded_alike(priced)
  rest = iter(padded)
  return [o.replace(tables=next(rest) if o.tables is not None else padded[0]) for o in options]


def build_options(
  problem: Problem,
  options: tuple[Pipeline | None, ...],
  count: int,
  axis_sizes: np.ndarray,
  slot_order: np.ndarray,
  slot_divisible: np.ndarray,
) -> PipelineOptions:
  """The arrays of `options` (`menu`'s) padded to `count` rows, for tables whose mesh axes
  are `axis_sizes` [X] and whose slots are `slot_order`, `slot_divisible` [Q, W]."""
  sigs, names = problem.sigs, problem.mesh.axis_names
  uv, uo = len(sigs.value_keys), len(sigs.op_class)
  valid = np.arange(count) < len(options)
  axis = np.full(count, -1, np.int32)
  stages, microbatches = np.ones(count, np.float32), np.ones(count, np.float32)
  slots = np.repeat(slot_divisible[None], count, axis=0)
  value_stage, op_stage = np.zeros((count, uv), np.float32), np.zeros((count, uo), np.float32)
  priced = []
  for k, pipeline in enumerate(options):
    if pipeline is None:
      continue
    pipelined = problem.pipelined(pipeline)
    t, staged = pipelined.tables, pipelined.staged
    axis[k], stages[k], microbatches[k] = (
      names.index(pipeline.axis),
      pipeline.stages,
      pipeline.microbatches,
    )
    value_size = _micro_sizes(sigs.value_size, np.asarray(t.value_source), np.asarray(t.value_size))
    op_size = _micro_sizes(sigs.op_size, np.asarray(t.op_source), np.asarray(t.op_size))
    flat = np.concatenate(
      [
        sharding.divisibility_bits(value_size, axis_sizes).ravel(),
        sharding.divisibility_bits(op_size, axis_sizes).ravel(),
      ]
    )
    slots[k] = np.where(slot_divisible == 1, 1, _owner_slot_bits(problem, flat)[slot_order])
    value_stage[k] = _positions(staged.value_stage, sigs.value_sig, uv, pipeline.stages)
    op_stage[k] = _positions(staged.op_stage, sigs.op_sig, uo, pipeline.stages)
    priced.append((k, t))
  tables = None
  if priced:
    rows = {k: t for k, t in priced}
    tables = _stacked([rows.get(k, priced[0][1]) for k in range(count)])
  return PipelineOptions(
    valid=valid,
    axis=axis,
    stages=stages,
    microbatches=microbatches,
    slot_divisible=slots.astype(np.int32),
    value_stage=value_stage,
    op_stage=op_stage,
    tables=tables,
  )


def select(options: PipelineOptions, option: jax.Array) -> simulator.PipelineTables:
  """The pricing tables of `option` (int32 [], at least 0)."""
  return jax.tree.map(lambda x: x[option], options.tables)


def pipelined_cost(
  options: PipelineOptions, option: jax.Array, value_mask: jax.Array, op_mask: jax.Array
) -> simulator.PipelineCost:
  """`simulator.pipeline_cost` of `option`'s pipeline for the resolution `value_mask`,
  `op_mask` (int32 [Uv, Rv], [Uo, Rf], bucket padding allowed)."""
  t = select(options, jnp.maximum(option, 0))
  rv, rf = t.value_size.shape[-1], t.op_size.shape[-1]
  return simulator.pipeline_cost(t, value_mask[:, :rv], op_mask[:, :rf])


def describe(pipeline: Pipeline | None) -> str:
  """An option for people."""
  return "no pipeline" if pipeline is None else str(pipeline)
