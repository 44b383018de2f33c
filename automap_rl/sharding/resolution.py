"""Resolution: the one rule by which decisions shard slots (`takes_axis`), and its
bit-packed, batched form that turns decision arrays into per-signature axis masks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import batching, packing
from automap_rl.sharding.signatures import Signatures, divisibility_bits, pad_rows


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

    value_owner, value_slot = place(
      sigs.value_class, divisibility_bits(sigs.value_size, axis_sizes)
    )
    op_owner, op_slot = place(sigs.op_class, divisibility_bits(sigs.op_size, axis_sizes))
    width = max([len(key[0]) for key in rows] + [1])
    return cls(
      classes=pad_rows([key[0] for key in rows] or [[]], width, -1),
      divisible=pad_rows([key[1] for key in rows] or [[]], width, 1),
      value_owner=value_owner,
      value_slot=value_slot,
      op_owner=op_owner,
      op_slot=op_slot,
      num_axes=len(axis_sizes),
    )

  def padded(
    self, owners: int, slots: int, value_shape: tuple[int, int], op_shape: tuple[int, int]
  ) -> Owners:
    """These owners with `owners` rows of `slots` slots, for `value_shape` (signatures,
    dims) value signatures and `op_shape` (signatures, factors) op signatures (each at
    least its own): padded slots have no class, padded signatures and dims no owner, so
    every resolution is the same on the real slots and leaves the padded ones unsharded."""

    def pad(array: np.ndarray, shape: tuple[int, int], fill: int) -> np.ndarray:
      widths = [(0, n - m) for n, m in zip(shape, array.shape)]
      if any(w < 0 for _, w in widths):
        raise ValueError(f"Owners of shape {array.shape} do not fit {shape}.")
      return np.pad(array, widths, constant_values=fill)

    return Owners(
      classes=pad(self.classes, (owners, slots), -1),
      divisible=pad(self.divisible, (owners, slots), 1),
      value_owner=pad(self.value_owner, value_shape, -1),
      value_slot=pad(self.value_slot, value_shape, 0),
      op_owner=pad(self.op_owner, op_shape, -1),
      op_slot=pad(self.op_slot, op_shape, 0),
      num_axes=self.num_axes,
    )


# A pytree (`num_axes` static): jitted functions take owners as an argument, so owners of
# one shape share a compile.
jax.tree_util.register_dataclass(
  Owners,
  data_fields=["classes", "divisible", "value_owner", "value_slot", "op_owner", "op_slot"],
  meta_fields=["num_axes"],
)


NO_SLOT_RANK = np.iinfo(
  np.int16
).max  # `apply_decision`'s rank of a slot the decision does not cover.


def takes_axis(
  divisible: jax.Array, mask: jax.Array, used: jax.Array, axis_bit: jax.Array
) -> jax.Array:
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


def decision_slots(
  divisible: jax.Array, mask: jax.Array, rank: jax.Array, axis: jax.Array
) -> jax.Array:
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


def apply_decision(
  divisible: jax.Array, mask: jax.Array, rank: jax.Array, axis: jax.Array
) -> jax.Array:
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


def _first_decisions(
  dec_class: jax.Array, dec_axis: jax.Array, num_classes: int, num_axes: int
) -> jax.Array:
  """When each (class, axis) is first decided: the decision's index, K if never.

  Args:
    dec_class, dec_axis: the decisions, int32 [K, B].

  Returns:
    [C + 1, X, B], row C (the class of padded slots) all K; int8 when K < 128, else int16.
  """
  k = dec_class.shape[0]
  dtype = jnp.int8 if k < 128 else jnp.int16
  hit = (dec_class[None, None] == jnp.arange(num_classes)[:, None, None, None]) & (
    dec_axis[None, None] == jnp.arange(num_axes)[None, :, None, None]
  )  # [C, X, K, B]
  first = jnp.where(hit, jnp.arange(k, dtype=dtype)[:, None], jnp.asarray(k, dtype)).min(
    axis=2, initial=k
  )
  return jnp.concatenate([first, jnp.full((1, *first.shape[1:]), k, dtype)])


def _assign_packed(
  owners: Owners, num_classes: int, dec_class: jax.Array, dec_axis: jax.Array
) -> jax.Array:
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
  times = first[jnp.where(owners.classes >= 0, owners.classes, num_classes)]  # [U, S, X, B]
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
        open_ = (
          (time > last)
          & (time < never)
          & takes_axis(divisible[:, s, None], slot_mask, used, 1 << axis)
        )
        earliest = jnp.minimum(
          earliest, jnp.where(open_, (time << event_bits) | (s * x + axis), none)
        )
    found = earliest < none
    event = earliest & ((1 << event_bits) - 1)
    slot, axis = event // x, event % x
    bit = jnp.where(found, jnp.left_shift(1, axis + x * (slot % per_word)), 0)
    words = tuple(word | jnp.where(slot // per_word == w, bit, 0) for w, word in enumerate(words))
    return (words, jnp.where(found, earliest >> event_bits, last)), None

  batch = dec_class.shape[-1]
  num_words = -(-width // per_word)
  init = (
    tuple(jnp.zeros((num_owners, batch), jnp.int32) for _ in range(num_words)),
    jnp.full((num_owners, batch), -1, jnp.int32),
  )
  # A loop, not unrolled: XLA would fuse the rounds into one another and recompute them.
  (words, _), _ = jax.lax.scan(apply_earliest, init, None, length=x)
  return jnp.stack(words)


def _unpack(words: jax.Array, owner: jax.Array, slot: jax.Array, num_axes: int) -> jax.Array:
  """Axis bit masks of the signature slots at (`owner`, `slot`) [N, R] (owner -1: none),
  int8 [N, R, B]."""
  return packing.read(words, jnp.maximum(owner, 0), jnp.where(owner >= 0, slot, -1), num_axes)


@chex.dataclass(frozen=True)
class Resolution:
  """Axis bit masks per value-signature dim [Uv, Rv] and per op-signature factor [Uo, Rf]."""

  value_mask: jax.Array
  op_mask: jax.Array


def resolve_batch_last(
  owners: Owners, num_classes: int, decisions: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """`resolve` for a batch of plans laid out last (see `automap_rl.batching`): decisions
  `(dec_class, dec_axis)` int32 [K, B] each; returns the value and op masks, int8
  [Uv, Rv, B] and [Uo, Rf, B], in the layout the simulator's batch-last calls take."""
  words = _assign_packed(owners, num_classes, *decisions)
  return (
    _unpack(words, owners.value_owner, owners.value_slot, owners.num_axes),
    _unpack(words, owners.op_owner, owners.op_slot, owners.num_axes),
  )


def resolve_tile(owners: Owners) -> int:
  """Plans per batch-last call of resolution (`batching.tile_for` its owner slots)."""
  return batching.tile_for(owners.classes.size)


def _resolve_batch(
  owners: Owners, num_classes: int, decisions: tuple[jax.Array, jax.Array]
) -> Resolution:
  value_mask, op_mask = resolve_batch_last(owners, num_classes, decisions)
  return Resolution(
    value_mask=jnp.moveaxis(value_mask, -1, 0), op_mask=jnp.moveaxis(op_mask, -1, 0)
  )


def resolve(
  owners: Owners, num_classes: int, dec_class: jax.Array, dec_axis: jax.Array
) -> Resolution:
  """Resolves encoded decisions (see `encode`) on the compressed program with `num_classes`
  named dimensions. Pure; jittable; vmapped over decisions, the batch runs in calls laid
  out last (see `automap_rl.batching`), which is what XLA on CPU vectorises."""
  resolve_batch = batching.batch_last(
    lambda _, decisions: _resolve_batch(owners, num_classes, decisions),
    lambda _: resolve_tile(owners),
  )
  return resolve_batch((), (jnp.asarray(dec_class, jnp.int32), jnp.asarray(dec_axis, jnp.int32)))
