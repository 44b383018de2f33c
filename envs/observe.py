"""The observation: a `jraph.GraphsTuple` over the compressed program and the targets.

Computed from the state by a pure function rather than stored on it: the graph is
hundreds of times larger than the state and only the network at a search node's
expansion needs it.

Layout (same for every model and mesh, so one network serves all):

* nodes `[value signatures (Uv) | op signatures (Uo) | targets (T) | one padding node]`;
* edges `[value -> op for operands and op -> value for results (E) | target -> each value
  or op signature holding one of its classes (G)]`; padded edges are self-loops on the
  padding node; `n_node = [N]`, `n_edge = [E + G]` (one graph).

Node features (`NODE_FEATURES` columns, X = `EnvConfig.max_axes`):
  0-3: real, is value, is op, is target;
  values: log2 bytes / 40, share of bytes, rank / 8, role fractions (input, parameter,
    optimizer state, intermediate, output, constant);
  ops: log10 seconds / 12 + 1, share of time, kind fractions (contraction, reduction,
    layout, elementwise), has a reduction factor, factors / 8;
  targets: log2(1 + classes) / 4, log2 largest class size / 16, share of slots covered;
  then per axis: sharded on it (values and ops; for targets the fraction of their slots);
  per axis: a reduction factor sharded on it (ops), the action is legal (targets);
  last: log shard count / log device count (values and ops).
  With pipeline options (`EnvConfig.pipelines` > 0) one more: the stage membership of
  values and ops under the chosen pipeline (`envs.pipelines.PipelineOptions.value_stage`,
  0 without one).
Edge features: operand, result, coverage, log2(1 + runs per step) / 16.
Globals: log2 axis sizes / 4 [X], log10 link bandwidth / 12 [X], log2 devices / 8,
  log10 HBM bytes / 12, objective, capacity used, step time and peak memory relative to
  the replicated plan; with pipeline options also: a pipeline is chosen, log2 S / 4 and
  log2 M / 8 of the chosen one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jraph

from envs.core import State
from envs.tables import (
  BASE_PEAK_MEMORY,
  BASE_STEP_TIME,
  NUM_OP_FEATURES,
  NUM_TARGET_FEATURES,
  NUM_VALUE_FEATURES,
  EnvTables,
)

_STATIC = 4 + NUM_VALUE_FEATURES + NUM_OP_FEATURES + NUM_TARGET_FEATURES
EDGE_FEATURES = 4


def node_features(max_axes: int, pipelines: bool = False) -> int:
  """Columns of the node features (`pipelines`: with pipeline options)."""
  return _STATIC + 2 * max_axes + 1 + pipelines


def global_features(max_axes: int, pipelines: bool = False) -> int:
  """Columns of the global features (`pipelines`: with pipeline options)."""
  return 2 * max_axes + 6 + 3 * pipelines


def _axis_bits(mask: jax.Array, num_axes: int) -> jax.Array:
  """Whether each slot uses each axis, f32 [owners, slots, X]."""
  return ((mask.astype(jnp.int32)[..., None] >> jnp.arange(num_axes)) & 1).astype(jnp.float32)


def _place(block: jax.Array, start: int) -> jax.Array:
  """Puts `block` [n, f] at columns `start:start + f` of a row of `_STATIC` columns."""
  return jnp.pad(block, ((0, 0), (start, _STATIC - start - block.shape[1])))


def observe(tables: EnvTables, state: State) -> jraph.GraphsTuple:
  """The graph observation of `state` (see the module docstring for the layout)."""
  x = tables.axis_sizes.shape[0]
  uv, uo, t = tables.value_class.shape[0], tables.op_class.shape[0], tables.target_classes.shape[0]
  num_classes = tables.target_rank.shape[1]
  log_sizes = jnp.log(tables.axis_sizes.astype(jnp.float32))  # [X]
  log_devices = jnp.maximum(log_sizes.sum(), 1e-6)

  def owner(kind: int, features, classes, mask, extra):
    bits = _axis_bits(mask, x)
    real = (classes >= 0).any(axis=1) | (features != 0).any(axis=1)
    fraction = bits.max(axis=1) @ log_sizes / log_devices  # log shard count / log devices
    head = jnp.stack(
      [
        real,
        jnp.full(real.shape, kind == 0),
        jnp.full(real.shape, kind == 1),
        jnp.zeros(real.shape),
      ],
      axis=1,
    ).astype(jnp.float32)
    start = 4 if kind == 0 else 4 + NUM_VALUE_FEATURES
    static = _place(head, 0) + _place(features, start)
    return jnp.concatenate([static, bits.max(axis=1), extra, fraction[:, None]], axis=1), bits

  values, value_bits = owner(
    0, tables.value_features, tables.value_class, state.value_mask, jnp.zeros((uv, x))
  )
  reduction = tables.cost.op_reduction[..., None] * _axis_bits(state.op_mask, x)
  ops, op_bits = owner(1, tables.op_features, tables.op_class, state.op_mask, reduction.max(axis=1))

  # Fraction of each target's slots sharded on each axis.
  sharded, counts = [], []
  for classes, bits in ((tables.value_class, value_bits), (tables.op_class, op_bits)):
    ids = jnp.where(classes >= 0, classes, num_classes).reshape(-1)
    # Segment C collects slots without a class (and targets' -1 padding reads it): empty.
    for out, rows in ((sharded, bits.reshape(-1, x)), (counts, jnp.ones(ids.shape))):
      out.append(
        jax.ops.segment_sum(rows, ids, num_segments=num_classes + 1).at[num_classes].set(0.0)
      )
  covered = jnp.where(tables.target_classes >= 0, tables.target_classes, num_classes)
  target_sharded = (sharded[0] + sharded[1])[covered].sum(axis=1)
  target_slots = (counts[0] + counts[1])[covered].sum(axis=1)
  real = (tables.target_classes >= 0).any(axis=1)
  head = jnp.stack([real, jnp.zeros(t), jnp.zeros(t), real], axis=1).astype(jnp.float32)
  static = _place(head, 0) + _place(
    tables.target_features, 4 + NUM_VALUE_FEATURES + NUM_OP_FEATURES
  )
  legal = state.legal_action_mask[: t * x].reshape(t, x).astype(jnp.float32)
  targets = jnp.concatenate(
    [static, target_sharded / jnp.maximum(target_slots, 1.0)[:, None], legal, jnp.zeros((t, 1))],
    axis=1,
  )
  nodes = jnp.concatenate([values, ops, targets, jnp.zeros((1, values.shape[1]))], axis=0)
  options = tables.pipeline
  if options is not None:
    option = jnp.maximum(state.pipeline, 0)
    stage = jnp.concatenate(
      [options.value_stage[option], options.op_stage[option], jnp.zeros(t + 1)]
    )
    nodes = jnp.concatenate([nodes, stage[:, None]], axis=1)
  pad_node = nodes.shape[0] - 1

  cost = tables.cost
  result = cost.edge_result
  value_node, op_node = cost.edge_value, uv + cost.edge_op
  edge_real = tables.edge_real
  senders = jnp.where(edge_real, jnp.where(result, op_node, value_node), pad_node)
  receivers = jnp.where(edge_real, jnp.where(result, value_node, op_node), pad_node)
  edge_features = jnp.stack(
    [~result, result, jnp.zeros_like(result), jnp.log2(1.0 + cost.edge_weight) / 16.0], axis=1
  )
  edge_features = jnp.where(edge_real[:, None], edge_features.astype(jnp.float32), 0.0)
  cover = tables.cover_real
  cover_senders = jnp.where(cover, uv + uo + tables.cover_target, pad_node)
  cover_receivers = jnp.where(
    cover, jnp.where(tables.cover_is_op, uv + tables.cover_index, tables.cover_index), pad_node
  )
  cover_features = (
    jnp.zeros((cover.shape[0], EDGE_FEATURES)).at[:, 2].set(cover.astype(jnp.float32))
  )

  globals_ = jnp.concatenate(
    [
      tables.mesh_features,
      jnp.stack(
        [
          state.objective,
          state.num_decisions / state.dec_class.shape[0],
          state.step_time / tables.base[BASE_STEP_TIME],
          state.peak_memory / tables.base[BASE_PEAK_MEMORY],
        ]
      ),
    ]
  ).astype(jnp.float32)
  if options is not None:
    globals_ = jnp.concatenate(
      [
        globals_,
        jnp.stack(
          [
            (options.axis[option] >= 0).astype(jnp.float32),
            jnp.log2(options.stages[option]) / 4.0,
            jnp.log2(options.microbatches[option]) / 8.0,
          ]
        ),
      ]
    )
  num_edges = senders.shape[0] + cover_senders.shape[0]
  return jraph.GraphsTuple(
    nodes=nodes.astype(jnp.float32),
    edges=jnp.concatenate([edge_features, cover_features]),
    senders=jnp.concatenate([senders, cover_senders]).astype(jnp.int32),
    receivers=jnp.concatenate([receivers, cover_receivers]).astype(jnp.int32),
    globals=globals_[None],
    n_node=jnp.array([nodes.shape[0]], jnp.int32),
    n_edge=jnp.array([num_edges], jnp.int32),
  )
