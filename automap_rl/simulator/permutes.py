"""The collective-permutes XLA's SPMD partitioner adds to a resharding, in the simulator's
alpha-beta model: one hop of a device's shard to the device that needs it, at the slowest
link of the mesh axes its pairs cross. Jittable functions of arrays, batch last (see
`simulator.cost`).

A dim split over several mesh axes lays its shards out major to minor in an order
(`sharding.specs.dim_axes`: the axis more values of the dim's named dimension are split
over first, ties in mesh order); a device's shard is the one its position along those axes
names in that order. The partitioner reshards a dim in steps that fix the order of what
they make: the axes the dim keeps stay major, axes the source leaves replicated are sliced
in next, axes an all-to-all moves in from other dims come last (minor), and an all-to-all
or all-gather takes an axis out of a dim only from its minor end, all-to-alls before
all-gathers. Where the target's order differs from the order those steps make, or an axis
would leave from above one the dim keeps (or, for another dim, above one it gathers), the
shards sit on the wrong devices, and a collective-permute of the whole shard puts them
right; so does one where two dims trade axes (an all-to-all over both axes at once), and
one where two axes that one all-to-all moves from a dim to another land in the order they
had, which is not the target's. XLA:CPU compiles each of these cases so (checked in
`tests/test_permutes.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from automap_rl.simulator.collectives import EdgeTerms, axis_count, sum_rows
from automap_rl.simulator.tables import CostTables


def axis_pairs(num_axes: int) -> list[tuple[int, int]]:
  """The pairs of mesh axes `(x, y)`, `x < y`, in a fixed order."""
  return [(x, y) for x in range(num_axes) for y in range(x + 1, num_axes)]


def axis_precedence(t: CostTables, value_mask: jax.Array) -> jax.Array:
  """Whether a dim of each value signature that holds both axes of a pair `(x, y)`
  (`axis_pairs`) lays `y` out major to `x`: more values of its named dimension are split
  over `y` than over `x` (`sharding.specs.dim_axes`), bool [Uv, Rv, P, B] from the value
  masks [Uv, Rv, B]."""
  num_axes = axis_count(t)
  classes = jnp.asarray(t.value_dim_class).reshape(-1)  # [Uv * Rv]
  count = jnp.broadcast_to(jnp.asarray(t.value_count)[:, None], t.value_dim_class.shape)
  flat = value_mask.reshape(classes.shape[0], -1)  # [Uv * Rv, B]
  use = [
    jax.ops.segment_sum(
      jnp.where((flat >> x) & 1 != 0, count.reshape(-1, 1), 0.0), classes, classes.shape[0]
    )  # [C, B]; drops dims of no class (-1).
    for x in range(num_axes)
  ]
  pairs = axis_pairs(num_axes)
  if not pairs:
    return jnp.zeros((*value_mask.shape[:2], 0, value_mask.shape[-1]), bool)
  major = jnp.stack([use[y] > use[x] for x, y in pairs], axis=1)  # [C, P, B]
  return major[jnp.maximum(classes, 0)].reshape(*value_mask.shape[:2], len(pairs), -1)


def _misordered(
  source: jax.Array, target: jax.Array, precedence: jax.Array, num_axes: int
) -> tuple[jax.Array, jax.Array]:
  """Per dim, whether the partitioner's steps from `source` to `target` (dim masks
  [N, Rv, B]) leave its shards on the wrong devices: the axes of target dims whose order
  differs from the one the steps make (two axes moved in together keep their source
  order), and of source dims an axis leaves from above one
  the dim keeps (or moves to another dim from above one it gathers), each int8 [N, Rv, B]
  (0 where none)."""
  source_all = source.sum(axis=1, dtype=jnp.int8)[:, None]  # [N, 1, B]
  target_all = target.sum(axis=1, dtype=jnp.int8)[:, None]
  kept = source & target
  # The order the steps make: kept 0, sliced in 1, moved in by an all-to-all 2.
  step = lambda bit: jnp.where((kept & bit) != 0, 0, jnp.where((source_all & bit) != 0, 2, 1))
  wrong_target = wrong_source = jnp.zeros(source.shape, bool)
  for k, (x, y) in enumerate(axis_pairs(num_axes)):
    bx, by = 1 << x, 1 << y
    y_major = precedence[:, :, k]
    both = (target & bx != 0) & (target & by != 0)
    sx, sy = step(bx), step(by)
    wrong_target |= both & jnp.where(y_major, sx < sy, sy < sx)
    # Two axes one all-to-all moves from one dim to another land in the order they had.
    together = (source & bx != 0) & (source & by != 0)  # [N, Rv, B]
    moved_together = jnp.any(together, axis=1)[:, None] & ~together & both
    y_was_major = jnp.any(together & precedence[:, :, k], axis=1)[:, None]
    wrong_target |= moved_together & (y_major != y_was_major)
    in_source = (source & bx != 0) & (source & by != 0)
    x_leaves, y_leaves = (target & bx) == 0, (target & by) == 0
    x_gathered, y_gathered = (target_all & bx) == 0, (target_all & by) == 0
    # An all-to-all runs before an all-gather: a major axis moved to another dim leaves
    # from above a minor one the dim gathers.
    wrong_source |= in_source & jnp.where(
      y_major,
      y_leaves & (~x_leaves | (x_gathered & ~y_gathered)),
      x_leaves & (~y_leaves | (y_gathered & ~x_gathered)),
    )
  return jnp.where(wrong_target, target, 0), jnp.where(wrong_source, source, 0)


def _traded(source: jax.Array, target: jax.Array, num_axes: int) -> jax.Array:
  """The axes two dims trade (one moves from dim i to dim j, another from j to i), int8
  [N, B], from dim masks [N, Rv, B]: a pair of axes trades where each moves to the dim the
  other leaves. Per pair of mesh axes, not of dims: a mesh has fewer axes than a value
  has dims."""
  position = jnp.arange(1, source.shape[1] + 1, dtype=jnp.int8)[None, :, None]

  def dim_of(masks: jax.Array, axis: int) -> jax.Array:
    """The dim (from 1; 0: none) each mask puts `axis` on, int8 [N, B]."""
    return jnp.sum(jnp.where(masks & (1 << axis) != 0, position, 0), axis=1, dtype=jnp.int8)

  source_dim = [dim_of(source, axis) for axis in range(num_axes)]
  target_dim = [dim_of(target, axis) for axis in range(num_axes)]
  traded = jnp.zeros((source.shape[0], source.shape[2]), source.dtype)
  for x, y in axis_pairs(num_axes):
    moves = (source_dim[x] != 0) & (target_dim[x] != 0) & (source_dim[x] != target_dim[x])
    swap = (source_dim[x] == target_dim[y]) & (target_dim[x] == source_dim[y])
    traded |= jnp.where(moves & swap, (1 << x) | (1 << y), 0).astype(source.dtype)
  return traded


def swapped_axes(t: CostTables, source: jax.Array, target: jax.Array) -> jax.Array:
  """The axes of dims that trade axes they gather for as many devices' worth of axes they
  slice in (rows over `model` read as rows over `data`, both of 4), int8 [N, B], from dim
  masks [N, Rv, B]. XLA's partitioner sends each device's shard to the device that needs
  it (a collective-permute) rather than gathering the value and slicing it."""
  group = jnp.asarray(t.mask_group)
  as_index = lambda masks: masks.astype(jnp.uint8)  # Unsigned: no wrap of negative indices.
  gathered = source & ~target.sum(axis=1, dtype=jnp.int8)[:, None]  # [N, Rv, B]
  sliced = target & ~source.sum(axis=1, dtype=jnp.int8)[:, None]
  swap = (gathered != 0) & (group[as_index(gathered)] == group[as_index(sliced)])
  return jnp.where(swap, gathered | sliced, 0).sum(axis=1, dtype=jnp.int8)


def permute_terms(
  t: CostTables,
  axes: jax.Array,
  fraction: jax.Array,
  weight: jax.Array,
  weighted_bytes: jax.Array,
  buffer_bytes: jax.Array,
) -> EdgeTerms:
  """Collective-permutes over the axes `axes` [N, B] (0: none) of `fraction` [N, B] of
  values run `weight` [N, B] times a step (`weighted_bytes` [N, B]: weight times bytes;
  `buffer_bytes` [N], the value's bytes): one hop of the buffer each."""
  on = axes != 0
  sent = axes.astype(jnp.uint8)  # Unsigned: no wrap of negative indices.
  moved = jnp.where(on, weighted_bytes * fraction, 0.0)
  runs = jnp.where(on, weight, 0.0)
  return EdgeTerms(
    seconds=moved * jnp.asarray(t.mask_seconds_per_byte)[sent]
    + runs * jnp.asarray(t.mask_latency)[sent],
    bytes=moved,
    count=runs,
    buffer=jnp.where(on, buffer_bytes[:, None] * fraction, 0.0),
  )


def reshard_permutes(
  t: CostTables,
  precedence: jax.Array,
  source: jax.Array,
  target: jax.Array,
  swapped: jax.Array,
  weight: jax.Array,
  weighted_bytes: jax.Array,
  buffer_bytes: jax.Array,
) -> EdgeTerms:
  """The collective-permutes of the reshardings of edges from `source` to `target` dim
  masks [N, Rv, B] (an operand: as stored to as its op computes; a result: as computed
  to as stored), with the axis order of each dim, `precedence` [N, Rv, P, B]
  (`axis_precedence` of the edge's value), run `weight` [N, B] times a step
  (`weighted_bytes`: weight times the value's bytes; `buffer_bytes` [N]): one permute of
  the target's shard where a target dim is misordered or two dims trade axes, else of the
  source's shard where a source dim is misordered or a dim swaps axes (`swapped` [N, B]:
  `swapped_axes`)."""
  group = jnp.asarray(t.mask_group)
  wrong_target, wrong_source = _misordered(source, target, precedence, axis_count(t))
  to_target = wrong_target.sum(axis=1, dtype=jnp.int8) | _traded(source, target, axis_count(t))
  from_source = wrong_source.sum(axis=1, dtype=jnp.int8) | swapped
  shards = lambda masks: group[masks.sum(axis=1, dtype=jnp.int8).astype(jnp.uint8)]
  fraction = jnp.where(to_target != 0, 1.0 / shards(target), 1.0 / shards(source))
  return permute_terms(t, to_target | from_source, fraction, weight, weighted_bytes, buffer_bytes)


def permute_sums(reshards: EdgeTerms, dots: EdgeTerms) -> list[jax.Array]:
  """Seconds, bytes and count of a batch of plans' collective-permutes, those of reshardings
  [E', B] and of split dots [R, B] (`CostTerms.permute`, `dot_permute`), [B] each."""
  return [
    a + b
    for a, b in zip(
      sum_rows(reshards.seconds, reshards.bytes, reshards.count),
      sum_rows(dots.seconds, dots.bytes, dots.count),
    )
  ]
