"""The pure functional core: `init(config, tables, key)` and `step(config, tables, state, action)`.

In the PGX style: the state carries the legal action mask, the reward of the last step and
the termination flags; a terminal state stays put (reward 0) whatever the action. The
static tables (`EnvTables`) stay outside the state, so a search tree stores only states.

The state keeps the resolution itself (axis bit masks per signature dim, int8) next to
the encoded decisions: a step then applies one target's classes to it in one vectorised
pass instead of re-resolving every decision (`sharding.resolve` scans all K of them),
and the legal mask and the observation read it directly. It is `Uv*Rv + Uo*Rf` bytes (7 KB
for a 12-layer GPT); everything else is O(K + actions).

Masked actions are exactly those that cannot change the resolution or do not fit:
appending `(c, a)` for the classes `c` of a target changes the resolution iff some slot
(a value dim or op factor) of one of those classes could take axis `a` now: its owner
does not use `a` yet and its size divides by its current shard count times `|a|`
(within one target a slot taken for an earlier class only blocks later classes in the
same owner, which then have changed it already). So the mask is an any-reduction of
that per-slot test over classes, not a re-resolution per action. A target is also
illegal if its classes do not fit in the remaining capacity; padded targets and padded
mesh axes never are. The stop action (the last) is always legal, and in a terminal state
the only legal one. Taking an illegal action acts as stop.

Pipeline options (`EnvConfig.pipelines` = P > 0, `envs.pipelines`): actions
`T * X .. T * X + P - 1` choose option 0 (no pipeline) to P - 1. They are the only legal
actions (with stop) at the start, and never after; once one is chosen, the intra-op
actions are legal as above, less those on its stage axis and those that would shard a
slot that does not divide at its microbatch and stage size (a class is closed if any of
its slots that could take the axis would not divide). The chosen pipeline prices every
plan after it (`simulator.pipeline_cost`); without one the simulator does, as with P = 0.

Rewards (`EnvConfig.reward`): shaped (the default) simulates every move's plan, and the
reward is the objective's decrease; terminal simulates only on the step that ends the
episode, whose reward is the whole decrease, and under `vmap` only the rows whose episode
ends run the simulator (`batching.only_where`). Either way the return is
`1 - final objective`.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

from automap_rl import batching, sharding, simulator
from envs.config import EnvConfig
from envs.pipelines import pipelined_cost
from envs.tables import BASE_PEAK_MEMORY, BASE_STEP_TIME, EnvTables
from envs.tables import objective as env_objective


@chex.dataclass(frozen=True)
class State:
  """One environment state (K = `max_decisions`, A actions).

  Attributes:
    dec_class, dec_axis: the class decisions so far, -1 padded, int32 [K] (see
      `sharding.encode`).
    num_decisions: how many entries of `dec_class` are used, int32 [].
    value_mask, op_mask: the resolution: axis bit masks, int8 [Uv, Rv] and [Uo, Rf].
    objective: the objective relative to the replicated plan's (1 at the start), f32 [].
    step_time, peak_memory: the simulator's figures for the current plan, f32 [].
    reward: the objective's decrease on the last step, f32 [].
    terminated, truncated: bool [].
    legal_action_mask: bool [A].
    step_count: int32 [].
    pipeline: the chosen pipeline option (`EnvConfig.pipelines`), -1 before the pipeline
      action, 0 for none (always 0 without pipeline options), int32 [].
  """

  dec_class: jax.Array
  dec_axis: jax.Array
  num_decisions: jax.Array
  value_mask: jax.Array
  op_mask: jax.Array
  objective: jax.Array
  step_time: jax.Array
  peak_memory: jax.Array
  reward: jax.Array
  terminated: jax.Array
  truncated: jax.Array
  legal_action_mask: jax.Array
  step_count: jax.Array
  pipeline: jax.Array


def _legal(tables: EnvTables, arrays: tuple[jax.Array, ...], max_decisions: int) -> jax.Array:
  """`legal_actions` from `arrays`: the masks of the slots of `tables.slot_order` and the
  axes their owners use, [Q, W, ...] each, the decision counts [...] and, with a pipeline,
  the slots' divisibility at its microbatch and stage size [Q, W, ...], for one state
  ([...] empty) or a batch laid out last ([...] = [B], see `automap_rl.batching`: the slot
  tests then run along the batch and the class reduction's scatter moves whole rows);
  bool [..., T * X + 1]."""
  mask, used, num_decisions, *micro = arrays
  batch = num_decisions.shape
  num_classes = tables.target_rank.shape[1]
  extra = (1,) * len(batch)
  bits = (
    jnp.left_shift(1, jnp.arange(tables.axis_sizes.shape[0])).astype(mask.dtype).reshape(-1, *extra)
  )  # [X, ...]
  takes = sharding.takes_axis(
    tables.slot_divisible.reshape(*mask.shape[:2], 1, *extra),
    mask[:, :, None],
    used[:, :, None],
    bits,
  )  # [Q, W, X, ...]
  chunk_open = takes.any(axis=1).astype(jnp.int32)  # [Q, X, ...]
  class_open = (
    jax.ops.segment_max(
      chunk_open, tables.chunk_class, num_segments=num_classes + 1, indices_are_sorted=True
    )
    > 0
  )
  target = tables.target_classes  # Row C of class_open is no class's: never open.
  covered = jnp.where(target >= 0, target, num_classes)
  target_open = class_open[covered].any(axis=1)  # [T, X, ...]
  if micro:  # Closed: a class with a slot that could take the axis and would then not divide.
    divides = jnp.right_shift(micro[0][:, :, None], (mask[:, :, None] | bits).astype(jnp.int32)) & 1
    chunk_bad = (takes & (divides == 0)).any(axis=1).astype(jnp.int32)
    class_bad = (
      jax.ops.segment_max(
        chunk_bad, tables.chunk_class, num_segments=num_classes + 1, indices_are_sorted=True
      )
      > 0
    )
    target_open = target_open & ~class_bad[covered].any(axis=1)
  length = (target >= 0).sum(axis=1).reshape(-1, *extra)
  fits = (length > 0) & (num_decisions + length <= max_decisions)  # [T, ...]
  legal = target_open & fits[:, None] & tables.axis_valid.reshape(-1, *extra)
  legal = jnp.moveaxis(legal.reshape(-1, *batch), 0, -1)
  return jnp.concatenate([legal, jnp.ones((*batch, 1), bool)], axis=-1)


def legal_actions(
  tables: EnvTables,
  value_mask: jax.Array,
  op_mask: jax.Array,
  num_decisions: jax.Array,
  max_decisions: int,
  micro: jax.Array | None = None,
) -> jax.Array:
  """The legal action mask (see the module docstring), bool [T * X + 1]; `micro`: the
  slots' divisibility under a chosen pipeline option (`_legal_after`; None: none).

  A slot is open on an axis if it `sharding.takes_axis`; a class is open if one of its slots is (an
  any
  over chunks of `tables.slot_order`, then a sorted segment max); a target if one of its
  classes is. Vmapped over states, the slots' masks are gathered per state and the rest
  (`_legal`) runs in one batch-last call.
  """
  none = (jnp.full(value_mask.shape[:1], -1, jnp.int8), jnp.full(op_mask.shape[:1], -1, jnp.int8))
  return _legal_after(
    tables, (value_mask, op_mask), none, jnp.int32(0), num_decisions, max_decisions, micro
  )


def _legal_after(
  tables: EnvTables,
  masks: tuple[jax.Array, jax.Array],
  chosen: tuple[jax.Array, jax.Array],
  axis: jax.Array,
  num_decisions: jax.Array,
  max_decisions: int,
  micro: jax.Array | None = None,
) -> jax.Array:
  """`legal_actions` of the value and op `masks` [Uv, Rv] and [Uo, Rf] after a decision
  that shards, on `axis`, the slot `chosen` of each signature (`sharding.decision_slots`,
  int8 [Uv] and [Uo], -1: none). A step reads the few slots the mask tests from the masks
  it started from and applies the decision to those alone: reading the new masks, XLA
  computed them a second time, in the flattened layout, at two integer divisions a slot.
  `micro`: the slots' divisibility under the chosen pipeline, int32 [Q, W] (None: none)."""
  (uv, rv), (uo, rf) = (m.shape for m in masks)
  order = tables.slot_order  # [Q, W], into the value dims then op factors flattened.
  value = order < uv * rv
  owner = jnp.where(value, order // rv, uv + (order - uv * rv) // rf)
  slot = jnp.where(value, order % rv, (order - uv * rv) % rf)
  bit = jnp.left_shift(1, axis).astype(jnp.int8)
  chosen = jnp.concatenate(chosen)
  # The new masks' axes per signature: the old ones, and the decision's where it shards a slot.
  used = jnp.concatenate([m.sum(axis=1, dtype=m.dtype) for m in masks]) | jnp.where(
    chosen >= 0, bit, 0
  )
  mask = sharding.with_slots(
    jnp.concatenate([m.reshape(-1) for m in masks])[order], slot, chosen[owner], axis
  )
  legal = batching.batch_last(lambda t, arrays: _legal(t, arrays, max_decisions), any_rank=True)
  arrays = (mask, used[owner], num_decisions) + (() if micro is None else (micro,))
  return legal(tables, arrays)


def _with_options(tables: EnvTables, legal: jax.Array, option: jax.Array) -> jax.Array:
  """The legal mask [T * X + P + 1] from the intra-op one `legal` [T * X + 1] under the
  pipeline `option` (int32 []; -1, none chosen yet: only the options and stop)."""
  options = tables.pipeline
  x = tables.num_axes
  moves = legal[:-1].reshape(-1, x) & (jnp.arange(x) != options.axis[jnp.maximum(option, 0)])
  chosen = option >= 0
  return jnp.concatenate([moves.reshape(-1) & chosen, options.valid & ~chosen, legal[-1:]])


def _evaluate(
  config: EnvConfig, tables: EnvTables, arrays: tuple[jax.Array, ...]
) -> tuple[jax.Array, ...]:
  """The objective, step time and peak memory, f32 [] each, of the plan of `arrays`: the
  resolved value and op masks and the pipeline option (`State.pipeline`)."""
  value_mask, op_mask, option = arrays
  resolution = sharding.Resolution(
    value_mask=value_mask.astype(jnp.int32), op_mask=op_mask.astype(jnp.int32)
  )
  cost = simulator.simulate(tables.cost, resolution)
  if tables.pipeline is not None and tables.pipeline.tables is not None:
    piped = pipelined_cost(tables.pipeline, option, resolution.value_mask, resolution.op_mask)
    use = tables.pipeline.axis[jnp.maximum(option, 0)] >= 0
    cost = dataclasses.replace(
      cost,
      step_time=jnp.where(use, piped.step_time, cost.step_time),
      peak_memory=jnp.where(use, piped.peak_memory, cost.peak_memory),
    )
  objective = env_objective(config, cost, tables.base, tables.cost.hbm_bytes)
  return objective, cost.step_time, cost.peak_memory


def _replicated(tables: EnvTables) -> tuple[jax.Array, ...]:
  """`_evaluate`'s figures of the replicated plan (objective 1)."""
  return (
    jnp.float32(1.0),
    jnp.asarray(tables.base[BASE_STEP_TIME], jnp.float32),
    jnp.asarray(tables.base[BASE_PEAK_MEMORY], jnp.float32),
  )


def _figures(
  config: EnvConfig, tables: EnvTables, masks: tuple[jax.Array, ...], needed: jax.Array
) -> tuple[jax.Array, ...]:
  """`_evaluate` where `needed`, else the replicated plan's figures.

  Terminal rewards: under `vmap` only the rows that need it are simulated (see
  `batching.only_where`). Shaped rewards: every row but a stop needs it, so every row is
  simulated and the figures selected; the compiled step then holds one copy of the
  simulator, where `only_where`'s branches (one per capacity) hold five."""
  if config.reward == "shaped":
    return tuple(
      jnp.where(needed, new, old)
      for new, old in zip(_evaluate(config, tables, masks), _replicated(tables))
    )
  return batching.only_where(functools.partial(_evaluate, config), _replicated)(
    tables, masks, needed
  )


def init(config: EnvConfig, tables: EnvTables, key: chex.PRNGKey) -> State:
  """The replicated plan. The key is unused (the environment is deterministic); it keeps
  the PGX signature so that agents can split keys uniformly."""
  del key
  k = config.max_decisions
  value_mask = jnp.zeros(tables.value_class.shape, jnp.int8)
  op_mask = jnp.zeros(tables.op_class.shape, jnp.int8)
  zero = jnp.int32(0)
  legal = legal_actions(tables, value_mask, op_mask, zero, k)
  option = zero
  if config.pipelines:
    option = jnp.int32(-1)
    legal = _with_options(tables, legal, option)
  return State(
    dec_class=jnp.full(k, -1, jnp.int32),
    dec_axis=jnp.full(k, -1, jnp.int32),
    num_decisions=zero,
    value_mask=value_mask,
    op_mask=op_mask,
    objective=jnp.float32(1.0),
    step_time=jnp.asarray(tables.base[BASE_STEP_TIME], jnp.float32),
    peak_memory=jnp.asarray(tables.base[BASE_PEAK_MEMORY], jnp.float32),
    reward=jnp.float32(0.0),
    terminated=~legal[:-1].any(),
    truncated=jnp.bool_(False),
    legal_action_mask=legal,
    step_count=zero,
    pipeline=option,
  )


def from_plan(
  config: EnvConfig,
  tables: EnvTables,
  dec_class: jax.Array,
  dec_axis: jax.Array,
  value_mask: jax.Array,
  op_mask: jax.Array,
  cost: simulator.Cost,
) -> State:
  """The state of a plan made outside the environment (an expert tactic's), to search on
  from: its class decisions `dec_class`, `dec_axis` (`sharding.encode`, -1 padded, int32
  [K]), their resolution (`sharding.resolve`: masks [Uv, Rv] and [Uo, Rf]) and the cost the
  simulator gives them (`Problem.cost`; the plan has been priced where it was made, so
  this does not compile the simulator again). Without a pipeline: with pipeline options,
  option 0 (none) is chosen. Its masks, figures and legal actions are those of the state
  that the same class decisions, taken one at a time, would reach; its step count is 0."""
  k = config.max_decisions
  chex.assert_shape((dec_class, dec_axis), (k,))
  value_mask, op_mask = value_mask.astype(jnp.int8), op_mask.astype(jnp.int8)
  num_decisions = (dec_class >= 0).sum().astype(jnp.int32)
  option = jnp.int32(0)
  if config.pipelines:
    legal = legal_actions(
      tables, value_mask, op_mask, num_decisions, k, tables.pipeline.slot_divisible[option]
    )
    legal = _with_options(tables, legal, option)
  else:
    legal = legal_actions(tables, value_mask, op_mask, num_decisions, k)
  objective = env_objective(config, cost, tables.base, tables.cost.hbm_bytes)
  step_time, peak_memory = (
    jnp.asarray(cost.step_time, jnp.float32),
    jnp.asarray(cost.peak_memory, jnp.float32),
  )
  return State(
    dec_class=dec_class,
    dec_axis=dec_axis,
    num_decisions=num_decisions,
    value_mask=value_mask,
    op_mask=op_mask,
    objective=objective,
    step_time=step_time,
    peak_memory=peak_memory,
    reward=jnp.float32(0.0),
    terminated=~legal[:-1].any(),
    truncated=jnp.bool_(False),
    legal_action_mask=legal,
    step_count=jnp.int32(0),
    pipeline=option,
  )


def _advance(config: EnvConfig, tables: EnvTables, state: State, action: jax.Array) -> State:
  num_axes = tables.axis_sizes.shape[0]
  stop = (action == state.legal_action_mask.shape[0] - 1) | ~state.legal_action_mask[action]
  pick = (action >= tables.num_moves) & ~stop if config.pipelines else None  # A pipeline option.
  target = jnp.minimum(action // num_axes, tables.target_classes.shape[0] - 1)
  axis = action % num_axes
  chosen = (
    sharding.decision_slots(
      tables.value_divisible, state.value_mask, tables.value_rank[target], axis
    ),
    sharding.decision_slots(tables.op_divisible, state.op_mask, tables.op_rank[target], axis),
  )
  if pick is not None:
    chosen = tuple(jnp.where(pick, jnp.int8(-1), c) for c in chosen)
  value_mask, op_mask = (
    sharding.with_slots(m, jnp.arange(m.shape[1], dtype=jnp.int8), c[:, None], axis)
    for m, c in zip((state.value_mask, state.op_mask), chosen)
  )

  classes = tables.target_classes[target]
  offset = jnp.arange(config.max_decisions) - state.num_decisions
  new = (offset >= 0) & (offset < classes.shape[0])
  new = new & (classes[jnp.clip(offset, 0, classes.shape[0] - 1)] >= 0)
  option, micro, count = state.pipeline, None, (classes >= 0).sum()
  if pick is not None:
    new = new & ~pick
    option = jnp.where(pick, action - tables.num_moves, option)
    micro = tables.pipeline.slot_divisible[jnp.maximum(option, 0)]
    count = jnp.where(pick, 0, count)
  dec_class = jnp.where(new, classes[jnp.clip(offset, 0, classes.shape[0] - 1)], state.dec_class)
  dec_axis = jnp.where(new, axis, state.dec_axis)
  num_decisions = state.num_decisions + count
  legal = _legal_after(
    tables,
    (state.value_mask, state.op_mask),
    chosen,
    axis,
    num_decisions,
    config.max_decisions,
    micro,
  )
  if pick is not None:
    legal = _with_options(tables, legal, option)
  moved = state.replace(
    dec_class=dec_class,
    dec_axis=dec_axis,
    num_decisions=num_decisions,
    value_mask=value_mask,
    op_mask=op_mask,
    terminated=~legal[:-1].any(),
    legal_action_mask=legal,
    pipeline=option,
  )
  stopped = state.replace(terminated=jnp.bool_(True))
  out = jax.tree.map(lambda a, b: jnp.where(stop, a, b), stopped, moved)
  step_count = state.step_count + 1
  truncated = ~out.terminated & (step_count >= (config.max_steps or jnp.iinfo(jnp.int32).max))
  ends = out.terminated | truncated
  # Shaped: every move simulates its plan (a stop keeps the figures). Terminal: only the
  # step that ends the episode does.
  changed = ~stop if config.reward == "shaped" else ends
  live = ~(
    state.terminated | state.truncated
  )  # `step` keeps a terminal state whatever this returns.
  figures = _figures(config, tables, (out.value_mask, out.op_mask, out.pipeline), changed & live)
  objective, step_time, peak_memory = (
    jnp.where(changed, new, old)
    for new, old in zip(figures, (state.objective, state.step_time, state.peak_memory))
  )
  only_stop = jnp.zeros_like(legal).at[-1].set(True)
  return out.replace(
    objective=objective,
    step_time=step_time,
    peak_memory=peak_memory,
    reward=state.objective - objective,
    step_count=step_count,
    truncated=truncated,
    legal_action_mask=jnp.where(ends, only_stop, out.legal_action_mask),
  )


def step(config: EnvConfig, tables: EnvTables, state: State, action: jax.Array) -> State:
  """Takes `action` (int32 []); a terminal state is returned unchanged with reward 0."""
  chex.assert_shape(action, ())
  action = jnp.asarray(action, jnp.int32)
  done = state.terminated | state.truncated
  # A select, not `lax.cond`: under `vmap` a cond with a batched predicate becomes a select
  # anyway, but first broadcasts every operand, the static tables included, to the batch.
  stay = state.replace(reward=jnp.zeros_like(state.reward))
  return jax.tree.map(
    lambda a, b: jnp.where(done, a, b), stay, _advance(config, tables, state, action)
  )
