"""Decisions and their resolution into per-value and per-op shardings.

A strategy is an ordered list of `Decision(target, axis)`; earlier decisions win. A target
is an argument dimension (`ArgDim`, Automap's action), a named dimension (its class id,
TOAST's) or a `Group` of classes. Every target expands to classes; every dimension of a
class then takes the axis in decision order, unless its value (op) already uses the axis on
another dimension (factor) or the size does not divide.

Resolution is a pure `jax.numpy` function of small arrays: the program is compressed to
its unique value and op *signatures* (the classes and sizes of their dims or factors),
since every value (op) of one signature resolves the same way. A 12-layer GPT training
step of ~7000 ops has a few hundred signatures.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from automap_rl import batching, packing
from automap_rl.ir import FactorKind, NamedDims, Op, Program
from automap_rl.mesh import Mesh


@dataclasses.dataclass(frozen=True)
class ArgDim:
  """Dimension `dim` of the argument at pytree path `path` (`params/block_0/mlp/fc1/kernel`)."""

  path: str
  dim: int


@dataclasses.dataclass(frozen=True)
class Group:
  """A structural group of named dimensions, by id."""

  id: int


@dataclasses.dataclass(frozen=True)
class Decision:
  """Shard `target` over mesh axis `axis`. An `int` target is a named-dimension id."""

  target: ArgDim | Group | int
  axis: str


def classes_of(target: ArgDim | Group | int, program: Program, named: NamedDims) -> tuple[int, ...]:
  """The named-dimension ids a target covers; ValueError names a bad path, dim or id."""
  if isinstance(target, ArgDim):
    paths = {program.values[v].path: v for v in program.inputs}
    if target.path not in paths:
      close = difflib.get_close_matches(target.path, list(paths), n=3)
      raise ValueError(f"No argument at path {target.path!r}; did you mean {close}?")
    value = program.values[paths[target.path]]
    if not 0 <= target.dim < len(value.shape):
      raise ValueError(f"Argument {target.path!r} of shape {value.shape} has no dimension {target.dim}.")
    cls = named.class_of(value.id, target.dim)
    return () if cls < 0 else (cls,)
  if isinstance(target, Group):
    if not 0 <= target.id < len(named.groups):
      raise ValueError(f"No group {target.id}; the program has {len(named.groups)} groups.")
    return named.groups[target.id]
  if not 0 <= int(target) < len(named.classes):
    raise ValueError(f"No named dimension {target}; the program has {len(named.classes)}.")
  return (int(target),)


def encode(decisions: Sequence[Decision], program: Program, named: NamedDims, mesh: Mesh,
           length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Expands decisions to parallel arrays `(classes, axes)` of shape [length], padded with -1."""
  classes, axes = [], []
  for decision in decisions:
    axis = mesh.axis_index(decision.axis)
    for cls in classes_of(decision.target, program, named):
      classes.append(cls)
      axes.append(axis)
  length = len(classes) if length is None else length
  if len(classes) > length:
    raise ValueError(f"{len(classes)} class decisions do not fit in length {length}.")
  pad = length - len(classes)
  return np.array(classes + [-1] * pad, np.int32), np.array(axes + [-1] * pad, np.int32)


def _pad_rows(rows: Sequence[Sequence[int]], width: int, fill: int) -> np.ndarray:
  out = np.full((len(rows), width), fill, np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


@dataclasses.dataclass(frozen=True)
class Signatures:
  """The program compressed to unique value and op signatures.

  Attributes:
    value_sig: signature of each value, shape [num_values].
    value_class: class of each dim of each value signature, -1 for none, [Uv, Rv].
    value_size: size of those dims, [Uv, Rv].
    value_keys: the signature keys, for building cost tables.
    op_sig: signature of each op, -1 for ops that resolve exactly like their values (see
      `_follows_its_values`; the simulator charges their compute to their first result),
      shape [num_ops].
    op_class: class of each factor of each op signature; factors that need replication
      or permutation have -1 and are never sharded, [Uo, Rf].
    op_size: factor sizes, [Uo, Rf].
    op_keys: the op signature keys.
  """

  value_sig: np.ndarray
  value_class: np.ndarray
  value_size: np.ndarray
  value_keys: tuple
  op_sig: np.ndarray
  op_class: np.ndarray
  op_size: np.ndarray
  op_keys: tuple


def _unique(keys: Sequence) -> tuple[np.ndarray, list]:
  index: dict = {}
  ids = np.array([index.setdefault(k, len(index)) for k in keys], np.int32)
  return ids, list(index)


LINEAR_COMBINES = frozenset({"add", "add_any", "sub"})


def pending_partial_sums(program: Program) -> tuple[set[int], dict[int, int], dict[int, int]]:
  """Partial sums that a linear combination of them reduces in one collective, as XLA does.

  `add_any(dot(a, b), dot(c, d))` with both contractions sharded: XLA all-reduces each
  product, and its all-reduce combiner merges the two into one collective over both
  buffers (the backward pass of separate query, key and value projections under Megatron:
  one all-reduce of three activations). A combination whose operands are all single-use
  partial sums of its own shape takes over their reduction: it is counted once, with the
  bytes of every buffer it carries; their producers then reduce nothing.

  Returns:
    The ops whose reduction a combination takes over; for each combination, the reduction
    op whose axes it reduces over (the first operand's); and how many partial sums (one
    buffer each) it reduces.
  """
  uses: dict[int, int] = {}
  for op in program.ops:
    for v in op.operands:
      uses[v] = uses.get(v, 0) + 1
  pending: dict[int, int] = {}  # Value -> the op that would reduce it.
  for op in program.ops:
    if len(op.results) == 1 and FactorKind.REDUCTION in op.rule.factor_kinds:
      pending[op.results[0]] = op.id
  deferred: set[int] = set()
  carried: dict[int, int] = {}
  buffers: dict[int, int] = {}
  for op in program.ops:
    if op.primitive not in LINEAR_COMBINES or len(op.operands) < 2:
      continue
    shape = program.values[op.results[0]].shape
    if all(v in pending and uses[v] == 1 and program.values[v].shape == shape for v in op.operands):
      producers = [pending[v] for v in op.operands]
      deferred.update(producers)
      carried[op.id] = carried.get(producers[0], producers[0])
      buffers[op.id] = sum(buffers.get(p, 1) for p in producers)
      pending[op.results[0]] = op.id
  return deferred, carried, buffers


def _follows_its_values(factors, edges, value_keys) -> bool:
  """Whether an op resolves exactly like each of its operands and results.

  True when every edge maps the value's shardable dims one to one onto the op's shardable
  factors, with the same classes and sizes, and no class repeats: then decisions shard
  the op as they shard its values, so it never communicates and its shard count is its
  values'. Elementwise ops and transposes are such ops; they make up most of a program.
  """
  shardable = {f for f, (cls, _, _) in enumerate(factors) if cls >= 0}
  if len({factors[f][0] for f in shardable}) != len(shardable):
    return False
  for value_sig, dims in edges:
    classes, shape, _ = value_keys[value_sig]
    mapped = set()
    for cls, size, dim_factors in zip(classes, shape, dims):
      live = [f for f in dim_factors if f in shardable]
      if cls < 0:
        if live:
          return False
        continue
      if len(live) != 1 or factors[live[0]][:2] != (cls, size):
        return False
      mapped.add(live[0])
    if mapped != shardable:
      return False
  return True


def signatures(program: Program, named: NamedDims) -> Signatures:
  """Compresses `program` to unique signatures (see the module docstring)."""
  value_keys = []
  for value in program.values:
    classes = tuple(int(c) for c in named.value_classes(value.id))
    value_keys.append((classes, value.shape, value.itemsize))
  value_sig, unique_values = _unique(value_keys)
  unique_values = list(unique_values)
  deferred, carried, buffers = pending_partial_sums(program)
  index: dict = {}
  op_sig = np.zeros(program.num_ops, np.int32)
  shardable = (FactorKind.PASS_THROUGH, FactorKind.REDUCTION)
  for op in program.ops:
    factor_classes = named.op_factor_classes(op.id)
    factors = tuple(
        (int(c) if kind in shardable else -1, size, int(kind))
        for c, size, kind in zip(factor_classes, op.rule.factor_sizes, op.rule.factor_kinds)
    )
    operands = tuple((int(value_sig[v]), dims) for v, dims in zip(op.operands, op.rule.operand_dims))
    results = tuple((int(value_sig[v]), dims) for v, dims in zip(op.results, op.rule.result_dims))
    partial = (op.id in deferred, int(op_sig[carried[op.id]]) if op.id in carried else -1, buffers.get(op.id, 1))
    if partial == (False, -1, 1) and _follows_its_values(factors, (*operands, *results), unique_values):
      op_sig[op.id] = -1
      continue
    key = (op.primitive in ("dot_general", "conv_general_dilated"), factors, operands, results, partial)
    op_sig[op.id] = index.setdefault(key, len(index))
  unique_ops = list(index)
  rv = max([len(k[1]) for k in unique_values] + [1])
  rf = max([len(k[1]) for k in unique_ops] + [1])
  return Signatures(
      value_sig=value_sig,
      value_class=_pad_rows([k[0] for k in unique_values], rv, -1),
      value_size=_pad_rows([k[1] for k in unique_values], rv, 1),
      value_keys=tuple(unique_values),
      op_sig=op_sig,
      op_class=_pad_rows([[f[0] for f in k[1]] for k in unique_ops], rf, -1),
      op_size=_pad_rows([[f[1] for f in k[1]] for k in unique_ops], rf, 1),
      op_keys=tuple(unique_ops),
  )


def divisibility_bits(sizes: np.ndarray, axis_sizes: Sequence[int]) -> np.ndarray:
  """Bit m of entry i is set when `sizes[i]` divides by the product of the axes in mask m.

  Precomputed so that resolution tests divisibility with a shift, not an integer division.
  """
  bits = np.zeros(sizes.shape, np.int32)
  for mask in range(1 << len(axis_sizes)):
    group = int(np.prod([n for a, n in enumerate(axis_sizes) if mask >> a & 1]))
    bits |= np.where(sizes % group == 0, 1 << mask, 0).astype(np.int32)
  return bits


@dataclasses.dataclass(frozen=True, eq=False)
class Owners:
  """The slots (value-signature dims and op-signature factors) that decisions can shard,
  grouped by owner (a value or op signature), deduplicated and laid out for `resolve`.

  Two signatures whose sharded slots have the same classes and divisibility resolve
  alike, so they share one owner row (a 12-layer GPT: 918 signatures, 399 owners). A
  row lists the slots with a class in their order, padded to S; during resolution each
  slot's axis bit mask is an X-bit field of a packed integer per owner (X mesh axes, the
  layout of `automap_rl.packing`), so a round of resolution (see `_assign_packed`) is
  elementwise over owners and plans, with the owner's slots unrolled in registers.

  Attributes:
    classes: class of each owner slot, -1 for padding, int32 [U, S].
    divisible: `divisibility_bits` of each owner slot, int32 [U, S].
    value_owner, value_slot: owner row and slot of each value-signature dim, owner -1 for
      a dim without a class (never sharded), int32 [Uv, Rv].
    op_owner, op_slot: the same for op-signature factors, int32 [Uo, Rf].
    num_axes: X.
  """

  classes: np.ndarray
  divisible: np.ndarray
  value_owner: np.ndarray
  value_slot: np.ndarray
  op_owner: np.ndarray
  op_slot: np.ndarray
  num_axes: int

  @classmethod
  def from_signatures(cls, sigs: Signatures, axis_sizes: Sequence[int]) -> Owners:
    rows: dict[tuple, int] = {}

    def place(classes: np.ndarray, divisible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
      owner = np.full(classes.shape, -1, np.int32)
      slot = np.zeros(classes.shape, np.int32)
      for row, (row_classes, row_divisible) in enumerate(zip(classes, divisible)):
        real = np.flatnonzero(row_classes >= 0)
        key = (tuple(row_classes[real].tolist()), tuple(row_divisible[real].tolist()))
        owner[row, real] = rows.setdefault(key, len(rows))
        slot[row, real] = np.arange(len(real))
      return owner, slot

    value_owner, value_slot = place(sigs.value_class, divisibility_bits(sigs.value_size, axis_sizes))
    op_owner, op_slot = place(sigs.op_class, divisibility_bits(sigs.op_size, axis_sizes))
    width = max([len(key[0]) for key in rows] + [1])
    return cls(
        classes=_pad_rows([key[0] for key in rows] or [[]], width, -1),
        divisible=_pad_rows([key[1] for key in rows] or [[]], width, 1),
        value_owner=value_owner, value_slot=value_slot, op_owner=op_owner, op_slot=op_slot,
        num_axes=len(axis_sizes))


NO_SLOT_RANK = np.iinfo(np.int16).max  # `apply_decision`'s rank of a slot the decision does not cover.


def takes_axis(divisible: jax.Array, mask: jax.Array, used: jax.Array, axis_bit: jax.Array) -> jax.Array:
  """THE rule of a decision: whether a slot (a value dim or an op factor) takes an axis.

  A slot takes the axis of bit `axis_bit` when its owner (the value or op) does not use
  that axis on any slot yet, and the slot's size divides by the product of its axes with
  the new one. Resolution (`resolve`), one decision's application (`apply_decision`) and
  the environment's legal-action mask all test this, and nothing else. Broadcasting.

  Args:
    divisible: the slot's `divisibility_bits` (bit m: its size divides by the axes of
      mask m), int32.
    mask: the slot's axis bit mask so far.
    used: the axes its owner uses, as a bit mask (the OR of its slots' masks).
    axis_bit: `1 << axis`.
  """
  want = (mask | axis_bit).astype(divisible.dtype)
  return ((used & axis_bit) == 0) & ((jnp.right_shift(divisible, want) & 1) == 1)


def decision_slots(divisible: jax.Array, mask: jax.Array, rank: jax.Array, axis: jax.Array) -> jax.Array:
  """The slot of each owner that one decision shards (see `apply_decision`), -1 for none,
  int8 [owners]; arguments as `apply_decision`'s."""
  slots = mask.shape[1]
  bit = jnp.left_shift(1, axis).astype(mask.dtype)
  used = mask.sum(axis=1, dtype=mask.dtype)
  # Slot by slot (a strict `<` keeps the first of equal ranks): vmapped, elementwise over
  # [B, owners], where a minimum over the minor axis of 4-5 slots ran as scalar code.
  best = jnp.full(mask.shape[:1], NO_SLOT_RANK, rank.dtype)
  chosen = jnp.full(mask.shape[:1], -1, jnp.int8)
  for s in range(slots):
    better = (rank[:, s] < best) & takes_axis(divisible[:, s], mask[:, s], used, bit)
    chosen = jnp.where(better, jnp.int8(s), chosen)
    best = jnp.where(better, rank[:, s], best)
  # The chain is elementwise, and XLA repeats elementwise producers in each reader (the
  # new masks, the legal mask, every read of the simulator's): 2.5x a single shaped
  # step. It does not repeat an integer remainder, so this one (the identity: -1 <=
  # chosen < slots <= 127) makes the chosen slots computed once.
  return jax.lax.rem(chosen, jnp.int8(127))


def with_slots(mask: jax.Array, slot: jax.Array, chosen: jax.Array, axis: jax.Array) -> jax.Array:
  """Axis bit masks `mask` with bit `axis` set where the slot index `slot` is its owner's
  `chosen` one (`decision_slots`); broadcasting, so that the environment can apply a
  decision to the few slots it reads without materialising every new mask."""
  return mask | jnp.where(slot == chosen, jnp.left_shift(1, axis), 0).astype(mask.dtype)


def apply_decision(divisible: jax.Array, mask: jax.Array, rank: jax.Array, axis: jax.Array) -> jax.Array:
  """Applies one decision, `axis` for the classes of a target in rank order, to resolved
  masks: in each owner the first slot that `takes_axis`, of the lowest-ranked class, takes
  it. Appending the decision's classes to an encoded list and re-resolving (`resolve`)
  gives the same masks; the environment steps with this (`decision_slots`, then
  `with_slots`).

  Args:
    divisible: divisibility bits of each slot, int32 [owners, slots].
    mask: axis bit masks so far, int8 [owners, slots].
    rank: the target's rank of each slot's class, `NO_SLOT_RANK` if not covered, int16
      [owners, slots].
    axis: int32 [].

  Returns:
    The new masks, [owners, slots].
  """
  chosen = decision_slots(divisible, mask, rank, axis)
  return with_slots(mask, jnp.arange(mask.shape[1], dtype=jnp.int8), chosen[:, None], axis)


def _first_decisions(dec_class: jax.Array, dec_axis: jax.Array, num_classes: int, num_axes: int) -> jax.Array:
  """When each (class, axis) is first decided: the decision's index, K if never.

  Args:
    dec_class, dec_axis: the decisions, int32 [K, B].

  Returns:
    [C + 1, X, B], row C (the class of padded slots) all K; int8 when K < 128, else int16.
  """
  k = dec_class.shape[0]
  dtype = jnp.int8 if k < 128 else jnp.int16
  hit = ((dec_class[None, None] == jnp.arange(num_classes)[:, None, None, None])
         & (dec_axis[None, None] == jnp.arange(num_axes)[None, :, None, None]))  # [C, X, K, B]
  first = jnp.where(hit, jnp.arange(k, dtype=dtype)[:, None], jnp.asarray(k, dtype)).min(axis=2, initial=k)
  return jnp.concatenate([first, jnp.full((1, *first.shape[1:]), k, dtype)])


def _assign_packed(owners: Owners, num_classes: int, dec_class: jax.Array, dec_axis: jax.Array) -> jax.Array:
  """Applies decisions in order to every owner slot, for a batch of plans laid out last.

  Only the first decision of each (class, axis) can shard anything: a later one finds the
  axis used, or the slot's product of axes grown (divisibility only gets harder). So each
  owner slot has one event per axis, at the time of that first decision, and the decisions
  that take effect in an owner are at most X (one per axis). Resolution runs X rounds; each
  applies, in every owner, the earliest event after the last one applied whose axis is
  free in the owner and whose slot's size divides by its axes with the new one (ties: the
  first slot, as the sequential rule has it). Events it passes over can never apply
  later. A round is one elementwise pass over [owners, plans] with the S * X events
  unrolled: the cost does not grow with the number of decisions.

  Args:
    owners: the static slot layout.
    num_classes: C, the number of named dimensions.
    dec_class, dec_axis: class (-1 for padding) and mesh axis of each decision, int32 [K, B].

  Returns:
    The packed axis bit masks, int32 [W, U, B], in `automap_rl.packing`'s layout.
  """
  chex.assert_rank([dec_class, dec_axis], 2)
  x, per_word = owners.num_axes, packing.slots_per_word(owners.num_axes)
  field = (1 << x) - 1
  num_owners, width = owners.classes.shape
  num_events, never = width * x, dec_class.shape[0]
  event_bits = max(num_events, 1).bit_length()
  first = _first_decisions(dec_class, dec_axis, num_classes, x)
  times = first[np.where(owners.classes >= 0, owners.classes, num_classes)]  # [U, S, X, B]
  divisible = jnp.asarray(owners.divisible)
  none = (never << event_bits) | num_events  # Sorts after every event.

  def apply_earliest(carry, _):
    words, last = carry
    used = jnp.zeros_like(last)
    for s in range(width):
      used = used | (words[s // per_word] >> (x * (s % per_word)))
    earliest = jnp.full_like(last, none)  # (time << event_bits) | event.
    for s in range(width):
      w, shift = divmod(s, per_word)
      for axis in range(x):
        time = times[:, s, axis].astype(jnp.int32)
        slot_mask = (words[w] >> (x * shift)) & field
        open_ = (time > last) & (time < never) & takes_axis(divisible[:, s, None], slot_mask, used, 1 << axis)
        earliest = jnp.minimum(earliest, jnp.where(open_, (time << event_bits) | (s * x + axis), none))
    found = earliest < none
    event = earliest & ((1 << event_bits) - 1)
    slot, axis = event // x, event % x
    bit = jnp.where(found, jnp.left_shift(1, axis + x * (slot % per_word)), 0)
    words = tuple(word | jnp.where(slot // per_word == w, bit, 0) for w, word in enumerate(words))
    return (words, jnp.where(found, earliest >> event_bits, last)), None

  batch = dec_class.shape[-1]
  num_words = -(-width // per_word)
  init = (tuple(jnp.zeros((num_owners, batch), jnp.int32) for _ in range(num_words)),
          jnp.full((num_owners, batch), -1, jnp.int32))
  # A loop, not unrolled: XLA would fuse the rounds into one another and recompute them.
  (words, _), _ = jax.lax.scan(apply_earliest, init, None, length=x)
  return jnp.stack(words)


def _unpack(words: jax.Array, owner: np.ndarray, slot: np.ndarray, num_axes: int) -> jax.Array:
  """Axis bit masks of the signature slots at (`owner`, `slot`) [N, R] (owner -1: none),
  int8 [N, R, B]."""
  return packing.read(words, np.maximum(owner, 0), np.where(owner >= 0, slot, -1), num_axes)


@chex.dataclass(frozen=True)
class Resolution:
  """Axis bit masks per value-signature dim [Uv, Rv] and per op-signature factor [Uo, Rf]."""

  value_mask: jax.Array
  op_mask: jax.Array


def resolve_batch_last(owners: Owners, num_classes: int,
                       decisions: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """`resolve` for a batch of plans laid out last (see `automap_rl.batching`): decisions
  `(dec_class, dec_axis)` int32 [K, B] each; returns the value and op masks, int8
  [Uv, Rv, B] and [Uo, Rf, B], in the layout the simulator's batch-last calls take."""
  words = _assign_packed(owners, num_classes, *decisions)
  return (_unpack(words, owners.value_owner, owners.value_slot, owners.num_axes),
          _unpack(words, owners.op_owner, owners.op_slot, owners.num_axes))


def resolve_tile(owners: Owners) -> int:
  """Plans per batch-last call of resolution (`batching.tile_for` its owner slots)."""
  return batching.tile_for(owners.classes.size)


def _resolve_batch(owners: Owners, num_classes: int, decisions: tuple[jax.Array, jax.Array]) -> Resolution:
  value_mask, op_mask = resolve_batch_last(owners, num_classes, decisions)
  return Resolution(value_mask=jnp.moveaxis(value_mask, -1, 0), op_mask=jnp.moveaxis(op_mask, -1, 0))


def resolve(owners: Owners, num_classes: int, dec_class: jax.Array, dec_axis: jax.Array) -> Resolution:
  """Resolves encoded decisions (see `encode`) on the compressed program with `num_classes`
  named dimensions. Pure; jittable; vmapped over decisions, the batch runs in calls laid
  out last (see `automap_rl.batching`), which is what XLA on CPU vectorises."""
  resolve_batch = batching.batch_last(lambda _, decisions: _resolve_batch(owners, num_classes, decisions),
                                      lambda _: resolve_tile(owners))
  return resolve_batch((), (jnp.asarray(dec_class, jnp.int32), jnp.asarray(dec_axis, jnp.int32)))


def dim_axes(mask: int, cls: int, dec_class: np.ndarray, dec_axis: np.ndarray, axis_names: Sequence[str]):
  """The axes of a dim with bit mask `mask` and class `cls`, in decision order."""
  order = [int(a) for c, a in zip(dec_class, dec_axis) if c == cls and c >= 0 and mask >> int(a) & 1]
  names = tuple(axis_names[a] for a in dict.fromkeys(order))
  return None if not names else names[0] if len(names) == 1 else names


def partition_spec(value_id: int, sigs: Signatures, resolution: Resolution, dec_class: np.ndarray,
                   dec_axis: np.ndarray, mesh: Mesh) -> jax.sharding.PartitionSpec:
  """The `PartitionSpec` of one value under a resolved plan."""
  sig = int(sigs.value_sig[value_id])
  masks = np.asarray(resolution.value_mask)[sig]
  classes = sigs.value_class[sig]
  rank = len(sigs.value_keys[sig][1])
  return jax.sharding.PartitionSpec(
      *(dim_axes(int(masks[d]), int(classes[d]), dec_class, dec_axis, mesh.axis_names) for d in range(rank)))


def op_partition_specs(op: Op, sigs: Signatures, resolution: Resolution, dec_class: np.ndarray, dec_axis: np.ndarray,
                       mesh: Mesh) -> tuple[tuple[PartitionSpec, ...], tuple[PartitionSpec, ...]]:
  """The `PartitionSpec`s the op computes on: `(operands, results)` as its factors are sharded.

  A dim takes the axes of its factors, major to minor; that is its sharding when at most
  its major factor is sharded, as in the convolution and window rules `lower` pins by this.
  An op without a signature of its own follows its values (see `_follows_its_values`).
  """
  sig = int(sigs.op_sig[op.id])
  if sig < 0:
    spec = lambda v: partition_spec(v, sigs, resolution, dec_class, dec_axis, mesh)
    return tuple(map(spec, op.operands)), tuple(map(spec, op.results))
  masks, classes = np.asarray(resolution.op_mask)[sig], sigs.op_class[sig]

  def spec_of(dims) -> PartitionSpec:
    entries = []
    for factors in dims:
      axes = []
      for f in factors:
        found = dim_axes(int(masks[f]), int(classes[f]), dec_class, dec_axis, mesh.axis_names)
        axes.extend(() if found is None else (found,) if isinstance(found, str) else found)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)

  return tuple(map(spec_of, op.rule.operand_dims)), tuple(map(spec_of, op.rule.result_dims))
