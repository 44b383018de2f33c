"""A pipeline run as its schedule's tick table (`schedules.tick_table`), per microbatch.

Under `jax.shard_map`, manual over the stage axis, one `jax.lax.scan` runs the table's
ticks. In each tick a stage runs one of: a forward of one of its chunks on one
microbatch (`jax.vjp` of the chunk's layers, its residuals kept in a buffer slot; on
global chunk 0 its input is the embedding of the microbatch, which runs there only), a
backward (the residuals' pullback: the chunk's weight gradients added into their sums,
the input's gradient sent back; on chunk 0 the embedding's parameter gradients), on the
last chunk the forward, the head, the loss and the backward at once (the chunk's
pullback and the loss's parameter gradients), or nothing. Two `jax.lax.switch`es over
the operation run it: the first the forward (its outputs and residuals; the other
operations' what their slot holds), whose result the tick writes into its slot, the
second the rest, reading the buffer so written (one switch returning both would hold a
second copy of a microbatch's residuals, its result, beside the buffer). Activations go
to the next stage and gradients to the one before with one `jax.lax.ppermute` each per
tick (a ring: interleaved chunks wrap from the last stage to the first); they wait in
buffer slots until read. Nothing runs at the whole batch: the first stage embeds and the
last computes the head and the loss, per microbatch. The stacked weights' gradients
leave the loop split over the stages, the other parameters' are summed over the stage
axis once; one optimizer update follows.

Where the plan's batch axes allow (`rows`: no stacked weight split over them but on its
layer dim, every microbatch's rows dividing over them), the loop is manual over them too:
each device runs its rows of every microbatch (the loss traced at that size), and the
loss and gradients are averaged over those axes once, after the loop, instead of XLA
reducing the gradients over them in every tick.

Stages run different operations in one tick. Where XLA puts a collective-permute inside
an operation (a reshard it chose), XLA's CPU runtime waits at it for every device, and
the devices of the stages running another operation never come: `uniform` runs every
operation on every stage and selects the one the table names (the same numbers, each
tick's compute of all of them), which `pipeline_lower` compiles instead where it finds
such a permute on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.pipeline import Pipeline
from automap_rl.xla.schedules import Ticks, tick_table

__all__ = ["branches_taken", "depends", "run_schedule"]


def depends(closed: jax_core.ClosedJaxpr, inputs: set[int]) -> list[bool]:
  """Whether each output of `closed` depends on its inputs at positions `inputs`."""
  tainted = {v for i, v in enumerate(closed.jaxpr.invars) if i in inputs}
  for eqn in closed.jaxpr.eqns:
    if any(not isinstance(v, jax_core.Literal) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return [not isinstance(v, jax_core.Literal) and v in tainted for v in closed.jaxpr.outvars]


def branches_taken(ticks: Ticks) -> list[list[dict[tuple[int, ...], int]]]:
  """Per stage, per tick, the branch each conditional of the tick takes where the
  operations run as branches (not `uniform`), as `hlo.Taken`: the tick's two switches the
  operation's kind (IDLE, FORWARD, BACKWARD, FORWARD_BACKWARD, the order of
  `_StageLoop.saves` and `_StageLoop.runs`), and the conds inside the operation
  (`embedded`, `embedded_grads`) whether its chunk is global chunk 0. For the compiled
  module's figures of what a stage runs (`hlo.inspect_compiled`), [S][T]."""
  kind, first = ticks.kind, ticks.first
  return [
    [{(): int(kind[t, s]), (int(kind[t, s]),): int(first[t, s])} for t in range(ticks.ticks)]
    for s in range(kind.shape[1])
  ]


def _stacked_weights(jaxpr: jax_core.Jaxpr, count: int) -> list[int | None]:
  """For each output of `jaxpr`, the input among its first `count` that it equals, where
  it is a `scan`'s stacked slices of that input, each only pinned (`sharding_constraint`,
  which changes no value), else None."""
  pinned = lambda eqn: eqn.primitive.name == "sharding_constraint"

  def unpinned(v: Any, made: dict[Any, Any]) -> Any:
    while not isinstance(v, jax_core.Literal) and v in made and pinned(made[v][0]):
      v = made[v][0].invars[0]
    return v

  made = {v: (eqn, j) for eqn in jaxpr.eqns for j, v in enumerate(eqn.outvars)}
  inputs = {v: i for i, v in enumerate(jaxpr.invars[:count])}
  out: list[int | None] = []
  for v in jaxpr.outvars:
    eqn, j = made.get(unpinned(v, made), (None, 0))
    found = None
    if eqn is not None and eqn.primitive.name == "scan" and j >= eqn.params["num_carry"]:
      body = eqn.params["jaxpr"].jaxpr
      inner = {u: (e, i) for e in body.eqns for i, u in enumerate(e.outvars)}
      source = unpinned(body.outvars[j], inner)
      xs = eqn.params["num_consts"] + eqn.params["num_carry"]
      at = [i for i, u in enumerate(body.invars) if u is source and i >= xs]
      if at:
        found = inputs.get(unpinned(eqn.invars[at[0]], made))
    if found is not None and jaxpr.invars[found].aval.strip_weak_type() != v.aval.strip_weak_type():
      found = None
    out.append(found)
  return out


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
  rows: tuple[str, ...] = (),
  uniform: bool = False,
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
    rows: the batch axes the loop is manual over besides the stage axis (module
      docstring): `embed`, `chunk` and `head` then run on a device's rows
      [B / (M R), ...] (R devices over `rows`), the loss a mean over them.
    uniform: every stage runs every operation of the tick (and the embedding), the one
      the table names selected: the same collectives on every device (module docstring).

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
  by_rows = PartitionSpec(None, rows) if rows else PartitionSpec()
  loss, d_others, d_staged = jax.shard_map(
    lambda *a: _stage_loop(ticks, pipeline, embed, chunk, head, rows, uniform, *a),
    mesh=mesh,
    in_specs=(PartitionSpec(), PartitionSpec(axis), PartitionSpec(), by_rows),
    out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axis)),
    axis_names={axis, *rows},
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
  rows: tuple[str, ...],
  uniform: bool,
  others: list[Any],
  staged: list[Any],
  consts: list[Any],
  micro: Any,
) -> tuple[Any, list[Any], list[Any]]:
  """One stage's loop over the ticks (`run_schedule`, under `shard_map`): per stage, its
  chunks' weights [1, V, L / (S V), ...]; the sums averaged over the `rows` axes."""
  local = [w[0] for w in staged]
  loop = _StageLoop(ticks, pipeline, embed, chunk, head, others, local, consts, uniform)
  loop.shapes(jax.tree.map(lambda x: x[0], micro))
  buffers = lambda shapes, n: [jnp.zeros((n, *s.shape), s.dtype) for s in shapes]
  slots_act, slots_grad, slots_res = ticks.slots
  start = (
    buffers(loop.act_shape, slots_act),
    buffers(loop.act_shape, slots_grad),
    buffers(loop.res_shape, slots_res),
    _zeros_like(loop.local),
    _zeros_like(others),
    jnp.zeros((), jnp.float32),
    _zeros(loop.act_shape),
    _zeros(loop.act_shape),
  )
  state, _ = jax.lax.scan(
    lambda st, t: (loop.tick(st, t, micro), None), start, jnp.arange(ticks.ticks)
  )
  _, _, _, d_w, d_o, total = state[:6]
  # One collective per step over each axis, the second reading the first's results: one
  # order on every device.
  total, d_o = jax.lax.psum((total, d_o), pipeline.axis)
  if rows:
    total, d_o, d_w = jax.lax.pmean((total, d_o, d_w), rows)
  return total, d_o, [g[None] for g in d_w]


def _in_order(values: Sequence[Any], perms: Sequence[Any], axis: str) -> list[Any]:
  """`jax.lax.ppermute` of each of `values` by its permutation of `perms` over `axis`, each
  after the one before has arrived (`jax.lax.optimization_barrier` ties its input to the
  result before): every device runs them in one order, as XLA's CPU runtime, which waits
  at each collective-permute for every device, needs."""
  out: list[Any] = []
  for value, perm in zip(values, perms):
    if out:
      value, _ = jax.lax.optimization_barrier((value, out[-1]))
    out.append(jax.lax.ppermute(value, axis, perm))
  return out


def _zeros_like(tree: Any) -> Any:
  return jax.tree.map(jnp.zeros_like, tree)


class _StageLoop:
  """What one stage runs in a tick (`_stage_loop`): its chunks' weights `local`
  [V, L / (S V), ...], the shapes of the activations and of a chunk's residuals."""

  def __init__(self, ticks, pipeline, embed, chunk, head, others, local, consts, uniform):
    self.pipeline, self.embed, self.chunk, self.head = pipeline, embed, chunk, head
    self.uniform = uniform
    self.others, self.local, self.consts = others, local, consts
    self.stage = jax.lax.axis_index(pipeline.axis)
    self.table = {
      name: jnp.asarray(getattr(ticks, name))
      for name in ticks.__dataclass_fields__
      if name != "slots"
    }
    self.pullback_tree: Any = None
    self.act_shape: list[Any] = []
    self.res_shape: list[Any] = []
    self.keep: list[bool] = []
    self.traced: Callable[[list[Any]], list[Any]] = lambda args: []
    self.weight_residuals: Callable[[list[Any]], list[Any]] = lambda args: []
    self.weight_of: list[int | None] = []

  def shapes(self, one: Any) -> None:
    """The activations' and residuals' shapes, for a microbatch like `one`."""
    self.act_shape = jax.eval_shape(self.embed, self.others, one)
    weights = [w[0] for w in self.local]
    self.kept(weights, self.act_shape)
    self.res_shape = jax.eval_shape(self.forward, weights, self.act_shape, 0)[1]

  def leaves(self, w: list[Any], x: list[Any], index: Any) -> tuple[list[Any], list[Any], Any]:
    """Global chunk `index` forward: its outputs, its pullback's leaves (residuals) and
    the pullback's structure."""
    y, pullback = jax.vjp(lambda w_, x_: self.chunk(self.consts, w_, x_, index), w, x)
    leaves, tree = jax.tree_util.tree_flatten(pullback)
    return y, leaves, tree

  def kept(self, w: list[Any], x: list[Any]) -> None:
    """The chunk's forward and its pullback's structure, traced once: `traced` (args the
    leaves of (w, x, index)), `pullback_tree`. JAX's residuals of one function differ by
    where it is traced (a constant start index of a `dynamic_update_slice` a residual leaf
    in a trace of its own, a literal in the stage loop's), so every tick evaluates this
    one trace. Which residuals
    the forward saves (`keep`): those that depend on the activations (or the chunk
    index). The others are functions of the weights alone (the weights as the layers read
    them), which the backward recomputes (`weight_residuals`) instead of keeping a copy
    per microbatch in flight, or, where one is a weight itself (a scan's slices of a
    stacked weight, pinned: `_stacked_weights`), reads from the weight (`weight_of`): a
    recomputed copy of the stage's weights would be held beside them in every backward."""
    trees: list[Any] = []

    def forward_leaves(w_, x_, i):
      y, leaves, tree = self.leaves(w_, x_, i)
      trees.append(tree)
      return y, leaves

    closed, (y_shape, _) = jax.make_jaxpr(forward_leaves, return_shape=True)(w, x, 0)
    self.pullback_tree = trees[0]
    n_w, n_y = len(jax.tree_util.tree_leaves(w)), len(jax.tree_util.tree_leaves(y_shape))
    n_out = len(closed.jaxpr.outvars)
    self.traced = lambda args: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    self.keep = [
      any(pe.dce_jaxpr(closed.jaxpr, [j == k for j in range(n_out)])[1][n_w:])
      for k in range(n_y, n_out)
    ]
    residuals = jax_core.Jaxpr(
      closed.jaxpr.constvars, closed.jaxpr.invars, closed.jaxpr.outvars[n_y:], closed.jaxpr.eqns
    )
    self.weight_of = _stacked_weights(residuals, n_w)
    recomputed = [not k and f is None for k, f in zip(self.keep, self.weight_of)]
    pruned, used = pe.dce_jaxpr(closed.jaxpr, [False] * n_y + recomputed)
    self.weight_residuals = lambda args: jax.core.eval_jaxpr(
      pruned, closed.consts, *(a for a, u in zip(args, used) if u)
    )

  def forward(self, w: list[Any], x: list[Any], index: Any) -> tuple[list[Any], list[Any]]:
    """The forward's outputs and the residuals it saves (`kept`)."""
    outs = self.traced([*jax.tree_util.tree_leaves(w), *jax.tree_util.tree_leaves(x), index])
    y, leaves = outs[: len(outs) - len(self.keep)], outs[len(outs) - len(self.keep) :]
    return y, [leaf for leaf, k in zip(leaves, self.keep) if k]

  def pullback(self, w: list[Any], saved: list[Any], index: Any) -> Callable[..., Any]:
    """The forward's pullback from its saved residuals, the others recomputed from `w`."""
    w_leaves = jax.tree_util.tree_leaves(w)
    args = [*w_leaves, *_zeros(self.act_shape), index]
    again, kept = iter(self.weight_residuals(args)), iter(saved)
    leaves = [
      next(kept) if k else next(again) if f is None else w_leaves[f]
      for k, f in zip(self.keep, self.weight_of)
    ]
    return jax.tree_util.tree_unflatten(self.pullback_tree, leaves)

  def switch(self, index: Any, branches: Sequence[Callable[[], Any]]) -> Any:
    """`jax.lax.switch(index, branches)`; `uniform`: every branch run, the result selected."""
    if not self.uniform:
      return jax.lax.switch(index, branches)
    outs = [branch() for branch in branches]
    return jax.tree.map(lambda *cases: jax.lax.select_n(index, *cases), *outs)

  def cond(self, pred: Any, true: Callable[[], Any], false: Callable[[], Any]) -> Any:
    """`jax.lax.cond(pred, true, false)`, or (`uniform`) both run and one selected."""
    return self.switch(pred.astype(jnp.int32), [false, true])

  def embedded_grads(self, first: Any, one: Any, g_x: list[Any]) -> list[Any]:
    """On global chunk 0 (`first`), the embedding's parameter gradients for `g_x`."""
    return self.cond(
      first,
      lambda: jax.vjp(lambda o: self.embed(o, one), self.others)[1](g_x)[0],
      lambda: _zeros_like(self.others),
    )

  def saves(self, row, one, w, x_in, saved, index) -> list[Callable[[], tuple]]:
    """The tick's first switch, over the operations (idle, forward, backward,
    forward-backward), each `() -> (y, residuals)`: a forward's outputs and the residuals
    it saves, the others' zero outputs and what the `save` slot of the residual buffers
    `saved` holds. The tick writes them into that slot. The switch's result is a forward's
    own residuals, or a copy of a slot in a branch that runs nothing else (in a
    backward's, that copy would be held beside its pullback's residuals)."""
    zero_act = _zeros(self.act_shape)
    kept = lambda: (zero_act, _at(saved, row["save"]))
    embedded = lambda: self.cond(row["first"], lambda: self.embed(self.others, one), lambda: x_in)
    run_forward = lambda: self.forward(w, embedded(), index)
    return [kept, run_forward, kept, kept]

  def runs(self, row, one, w, operands, sums, index) -> list[Callable[[], tuple]]:
    """The tick's second switch, over the same operations, each `() -> (weight gradient
    sums, input grads, other gradient sums, loss)`: the sums (`sums`: the stage's chunks'
    weights', the other parameters') are added into where the operation has gradients,
    and passed through where it has none. A backward reads its residuals from the `load`
    slot of the residual buffers."""
    others, (x_in, dy, saved), (d_w, d_o) = self.others, operands, sums
    zero_act = _zeros(self.act_shape)
    none = jnp.zeros((), jnp.float32)
    embedded = lambda: self.cond(row["first"], lambda: self.embed(others, one), lambda: x_in)
    add = lambda total, g: jax.tree.map(jnp.add, total, g)

    def add_w(g_w):
      if self.pipeline.chunks == 1:
        return [s + g[None] for s, g in zip(d_w, g_w)]
      pick = lambda x: jax.lax.dynamic_index_in_dim(x, row["chunk"], keepdims=False)
      return [
        jax.lax.dynamic_update_index_in_dim(s, pick(s) + g, row["chunk"], 0)
        for s, g in zip(d_w, g_w)
      ]

    def run_backward():
      g_w, g_x = self.pullback(w, _at(saved, row["load"]), index)(dy)
      d_o_ = add(d_o, self.embedded_grads(row["first"], one, g_x))
      return (add_w(g_w), g_x, d_o_, none)

    def run_forward_backward():
      y, res = self.forward(w, embedded(), index)
      loss_of = lambda o, y_: self.head(o, one, y_).astype(jnp.float32)
      loss, head_pullback = jax.vjp(loss_of, others, y)
      g_o, g_y = head_pullback(jnp.ones((), jnp.float32))
      g_w, g_x = self.pullback(w, res, index)(g_y)
      d_o_ = add(add(d_o, g_o), self.embedded_grads(row["first"], one, g_x))
      return (add_w(g_w), g_x, d_o_, loss)

    passed = lambda: (d_w, zero_act, d_o, none)
    return [passed, passed, run_backward, run_forward_backward]

  def tick(self, state: tuple, t: Any, micro: Any) -> tuple:
    """The loop's state after tick `t`."""
    s_count, axis = self.pipeline.stages, self.pipeline.axis
    row = {name: value[t, self.stage] for name, value in self.table.items()}
    acts, grads, saved, d_w, d_o, total, sent_act, sent_grad = state
    acts = _put(acts, sent_act, row["store_act"])
    grads = _put(grads, sent_grad, row["store_grad"])
    pick = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
    w = [x[0] if self.pipeline.chunks == 1 else pick(x, row["chunk"]) for x in self.local]
    one = jax.tree.map(lambda x: pick(x, row["micro"]), micro)
    index = row["chunk"] * s_count + self.stage  # The global chunk.
    x_in = _at(acts, row["read_act"])
    y, leaves = self.switch(row["kind"], self.saves(row, one, w, x_in, saved, index))
    saved = _put(saved, leaves, row["save"])
    operands = (x_in, _at(grads, row["read_grad"]), saved)
    d_w, g_x, d_o, loss = self.switch(
      row["kind"], self.runs(row, one, w, operands, (d_w, d_o), index)
    )
    ring = lambda k: [(s, (s + k) % s_count) for s in range(s_count)]
    sent = _in_order([*y, *g_x], [ring(1)] * len(y) + [ring(-1)] * len(g_x), axis)
    sent_act, sent_grad = sent[: len(y)], sent[len(y) :]
    return (acts, grads, saved, d_w, d_o, total + loss, sent_act, sent_grad)
