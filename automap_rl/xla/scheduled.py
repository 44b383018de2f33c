"""A pipeline run as its schedule's tick table (`schedules.tick_table`), per microbatch.

Under `jax.shard_map`, manual over the stage axis, one `jax.lax.scan` runs the table's
ticks. In each tick a stage runs, by `jax.lax.switch`, one of: a forward of one of its
chunks on one microbatch (`jax.vjp` of the chunk's layers, its residuals kept in a buffer
slot; on global chunk 0 its input is the embedding of the microbatch, which runs there
only), a backward (the residuals' pullback: the chunk's weight gradients added into their
sums, the input's gradient sent back; on chunk 0 the embedding's parameter gradients),
on the last chunk the forward, the head, the loss and the backward at once (the loss's
parameter gradients), or nothing. Activations go to the next stage and gradients to the
one before with one `jax.lax.ppermute` each per tick (a ring: interleaved chunks wrap
from the last stage to the first); they wait in buffer slots until read. Nothing runs at
the whole batch: the first stage embeds and the last computes the head and the loss, per
microbatch. The stacked weights' gradients leave the loop split over the stages, the
other parameters' are summed over the stage axis once; one optimizer update follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.pipeline import Pipeline
from automap_rl.xla.schedules import Ticks, tick_table

__all__ = ["run_schedule"]


def _zeros(shapes: Sequence[Any]) -> list[Any]:
  return [jnp.zeros(s.shape, s.dtype) for s in shapes]


def _at(buffers: Sequence[Any], slot: Any) -> list[Any]:
  return [jax.lax.dynamic_index_in_dim(b, slot, keepdims=False) for b in buffers]


def _put(buffers: Sequence[Any], values: Sequence[Any], slot: Any) -> list[Any]:
  return [jax.lax.dynamic_update_index_in_dim(b, v, slot, 0) for b, v in zip(buffers, values)]


def run_schedule(
  pipeline: Pipeline,
  mesh: jax.sharding.Mesh,
  embed: Callable[[list[Any], Any], list[Any]],
  chunk: Callable[[list[Any], list[Any], list[Any]], list[Any]],
  head: Callable[[list[Any], Any, list[Any]], Any],
  others: list[Any],
  weights: list[Any],
  consts: list[Any],
  micro: Any,
) -> tuple[Any, list[Any], list[Any]]:
  """The loss and gradients of a pipelined loss, run as `pipeline`'s schedule.

  Args:
    pipeline: S stages, M microbatches, the schedule and V chunks.
    mesh: the mesh; the stage axis is `pipeline.axis`.
    embed: `embed(others, one) -> carries`: the stack's input activations of one
      microbatch `one` (the batch pytree, leaves [B / M, ...]).
    chunk: `chunk(consts, layers, carries, c) -> carries`: global chunk c's layers
      (weights [L / (S V), ...]) on one microbatch's activations.
    head: `head(others, one, carries) -> loss []`: the head and loss on the stack's output.
    others: the parameters the stack does not stack (every stage gets them whole).
    weights: the stacked weights, each [L, ...].
    consts: the stack's constants (every stage gets them whole; no gradient).
    micro: the batch as microbatches, leaves [M, B / M, ...].

  Returns:
    (loss [], gradients of `others`, of `weights` [L, ...]), the means over the M
    microbatches.
  """
  s_count, v_count, axis = pipeline.stages, pipeline.chunks, pipeline.axis
  m_count = pipeline.microbatches
  layers = weights[0].shape[0]
  per = layers // (s_count * v_count)
  # [L, ...] -> [S, V, L / (S V), ...]: stage s's chunk v holds global chunk v S + s.
  staged = [jnp.swapaxes(w.reshape(v_count, s_count, per, *w.shape[1:]), 0, 1) for w in weights]
  staged = [
    jax.lax.with_sharding_constraint(
      w, NamedSharding(mesh, PartitionSpec(axis, *(PartitionSpec.UNCONSTRAINED,) * (w.ndim - 1)))
    )
    for w in staged
  ]
  ticks = tick_table(pipeline)
  loss, d_others, d_staged = jax.shard_map(
    lambda *a: _stage_loop(ticks, pipeline, embed, chunk, head, *a),
    mesh=mesh,
    in_specs=(PartitionSpec(), PartitionSpec(axis), PartitionSpec(), PartitionSpec()),
    out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axis)),
    axis_names={axis},
    check_vma=False,
  )(others, staged, consts, micro)
  d_weights = [jnp.swapaxes(g, 0, 1).reshape(layers, *g.shape[3:]) / m_count for g in d_staged]
  return loss / m_count, [g / m_count for g in d_others], d_weights


def _stage_loop(
  ticks: Ticks,
  pipeline: Pipeline,
  embed: Callable[..., Any],
  chunk: Callable[..., Any],
  head: Callable[..., Any],
  others: list[Any],
  staged: list[Any],
  consts: list[Any],
  micro: Any,
) -> tuple[Any, list[Any], list[Any]]:
  """One stage's loop over the ticks (`run_schedule`, under `shard_map`): per stage, its
  chunks' weights [1, V, L / (S V), ...]."""
  s_count, axis = pipeline.stages, pipeline.axis
  stage = jax.lax.axis_index(axis)
  local = [w[0] for w in staged]  # [V, L / (S V), ...]
  one = jax.tree.map(lambda x: x[0], micro)
  act_shape = jax.eval_shape(embed, others, one)
  layer_weights = [w[0] for w in local]
  pullback_tree = []

  def forward(w, x, index):
    y, pullback = jax.vjp(lambda w_, x_: chunk(consts, w_, x_, index), w, x)
    leaves, tree = jax.tree_util.tree_flatten(pullback)
    pullback_tree[:] = [tree]
    return y, leaves

  res_shape = jax.eval_shape(forward, layer_weights, act_shape, 0)[1]
  slots_act, slots_grad, slots_res = ticks.slots
  table = {
    name: jnp.asarray(getattr(ticks, name))
    for name in ticks.__dataclass_fields__
    if name != "slots"
  }
  zeros_like = lambda tree: jax.tree.map(jnp.zeros_like, tree)

  def tick(state, t):
    row = {name: value[t, stage] for name, value in table.items()}
    acts, grads, saved, d_w, d_o, total, sent_act, sent_grad = state
    acts = _put(acts, sent_act, row["store_act"])
    grads = _put(grads, sent_grad, row["store_grad"])
    w = [jax.lax.dynamic_index_in_dim(x, row["chunk"], keepdims=False) for x in local]
    one = jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, row["micro"], keepdims=False), micro
    )
    x_in = _at(acts, row["read_act"])
    dy = _at(grads, row["read_grad"])
    res = _at(saved, row["load"])
    index = row["chunk"] * s_count + stage  # The global chunk.
    nothing = (
      _zeros(act_shape),
      _zeros(res_shape),
      zeros_like(w),
      _zeros(act_shape),
      zeros_like(others),
      jnp.zeros((), jnp.float32),
    )

    def idle():
      return nothing

    def run_forward():
      x = jax.lax.cond(row["first"], lambda: embed(others, one), lambda: x_in)
      y, leaves = forward(w, x, index)
      return (y, leaves, *nothing[2:])

    def run_backward():
      pullback = jax.tree_util.tree_unflatten(pullback_tree[0], res)
      g_w, g_x = pullback(dy)
      g_o = jax.lax.cond(
        row["first"],
        lambda: jax.vjp(lambda o: embed(o, one), others)[1](g_x)[0],
        lambda: zeros_like(others),
      )
      return (nothing[0], nothing[1], g_w, g_x, g_o, nothing[5])

    def run_forward_backward():
      def loss_of(o, w_, x_):
        return head(o, one, chunk(consts, w_, x_, index)).astype(jnp.float32)

      x = jax.lax.cond(row["first"], lambda: embed(others, one), lambda: x_in)
      loss, (g_o, g_w, g_x) = jax.value_and_grad(loss_of, argnums=(0, 1, 2))(others, w, x)
      g_o = jax.tree.map(
        jnp.add,
        g_o,
        jax.lax.cond(
          row["first"],
          lambda: jax.vjp(lambda o: embed(o, one), others)[1](g_x)[0],
          lambda: zeros_like(others),
        ),
      )
      return (nothing[0], nothing[1], g_w, g_x, g_o, loss)

    y, leaves, g_w, g_x, g_o, loss = jax.lax.switch(
      row["kind"], [idle, run_forward, run_backward, run_forward_backward]
    )
    saved = _put(saved, leaves, row["save"])
    d_w = [
      jax.lax.dynamic_update_index_in_dim(
        s, jax.lax.dynamic_index_in_dim(s, row["chunk"], keepdims=False) + g, row["chunk"], 0
      )
      for s, g in zip(d_w, g_w)
    ]
    d_o = jax.tree.map(jnp.add, d_o, g_o)
    ring = lambda k: [(s, (s + k) % s_count) for s in range(s_count)]
    sent_act = [jax.lax.ppermute(v, axis, ring(1)) for v in y]
    sent_grad = [jax.lax.ppermute(v, axis, ring(-1)) for v in g_x]
    return (acts, grads, saved, d_w, d_o, total + loss, sent_act, sent_grad), None

  buffers = lambda shapes, n: [jnp.zeros((n, *s.shape), s.dtype) for s in shapes]
  start = (
    buffers(act_shape, slots_act),
    buffers(act_shape, slots_grad),
    buffers(res_shape, slots_res),
    zeros_like(local),
    zeros_like(others),
    jnp.zeros((), jnp.float32),
    _zeros(act_shape),
    _zeros(act_shape),
  )
  state, _ = jax.lax.scan(tick, start, jnp.arange(ticks.ticks))
  _, _, _, d_w, d_o, total = state[:6]
  d_o = jax.tree.map(lambda g: jax.lax.psum(g, axis), d_o)
  return jax.lax.psum(total, axis), d_o, [g[None] for g in d_w]
