"""Collectives in the simulator's alpha-beta model: ring all-reduces, all-gathers,
reduce-scatters and all-to-alls over sets of mesh axes (bit masks), priced from the per-mask
tables of `CostTables` (the slowest link bounds the bandwidth), with XLA's combiners merging
independent reductions. Jittable functions of arrays, batch last (see `simulator.cost`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from automap_rl.simulator.tables import CostTables

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
# A plan's comm bytes and counts by kind (`Cost.comm_bytes`): `KINDS`, then collective-permutes
# (reshardings' and split dots' in an intra-op plan; a pipeline's stage transfers besides).
COMM_KINDS = (*KINDS, "collective-permute")


def axes_of(t: CostTables, masks: jax.Array) -> list[jax.Array]:
  """Whether each mesh axis is in bit masks [...], bool [...] per axis."""
  return [(masks & (1 << axis)) != 0 for axis in range(axis_count(t))]


def group_size(t: CostTables, on: list[jax.Array]) -> jax.Array:
  """Devices in a group spanning the axes `on` (from `axes_of`): a product over the (at
  most a few) axes, elementwise, so it vectorises where a look-up in a table would not.
  Selects rather than arithmetic on the bits: XLA folds a padded axis (size 1) away
  when the tables are constants."""
  n = jnp.float32(1.0)
  for axis, bit in enumerate(on):
    n = n * jnp.where(bit, t.mask_group[..., 1 << axis], 1.0)
  return n


def ring_collective(
  t: CostTables, rounds: float | jax.Array, axes: jax.Array, divisor: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Cost terms of ring collectives over the axes of bit masks `axes` [...] moving
  `nbytes / group(divisor)` bytes per device: each takes `nbytes * per_byte + fixed`
  seconds and moves `nbytes * fraction` bytes, in `rounds` passes (2 for an all-reduce,
  1 for an all-gather or a reduce-scatter) of `(n - 1)`
  hops of `1/n` of the buffer at the slowest link's rate plus its latency per hop.
  Three look-ups in per-mask tables [2**X]: the per-edge terms run inside the edge
  reduction, a loop XLA on CPU does not vectorise, where a look-up is one load and the
  same terms as products and maxima over the axes cost a dozen selects and two divisions
  (twice the time). Returns `(per_byte, fixed, fraction)`, each [...]."""
  n = jnp.asarray(t.mask_group)
  per_byte = rounds * (1.0 - 1.0 / n) * jnp.asarray(t.mask_seconds_per_byte)
  fixed = rounds * (n - 1.0) * jnp.asarray(t.mask_latency)
  axes, divisor = (
    axes.astype(jnp.uint8),
    divisor.astype(jnp.uint8),
  )  # Unsigned: no wrap of negative indices.
  fraction = (1.0 / n)[divisor]
  return per_byte[axes] * fraction, fixed[axes], fraction


def collective_seconds(
  t: CostTables, kind: str, buffer_bytes: float, axes: int, group: int | None = None
) -> float:
  """Seconds of one collective of `kind` (`KINDS` or `collective-permute`) over the mesh
  axes of bit mask `axes`, moving a group-level buffer of `buffer_bytes` per device (the
  `automap_rl.xla.hlo` convention), in the model `ring_collective` charges plans; a
  collective-permute is one hop of the whole buffer at the slowest link of its axes. A
  `group` of devices other than the axes' (XLA's groups that match no set of axes) sets
  the ring's length, at the slowest link of `axes`. For costing what XLA compiled with
  the simulator's own alpha-beta model, in Python floats (a buffer of 2 GiB or more
  would overflow a jax int32)."""
  if kind == "collective-permute":
    return (
      float(buffer_bytes) * float(t.mask_seconds_per_byte[axes]) + float(t.mask_latency[axes])
      if axes
      else 0.0
    )
  if kind not in KINDS:
    raise ValueError(
      f"Unknown collective kind {kind!r}; expected one of {KINDS} or 'collective-permute'."
    )
  rounds = 2.0 if kind == "all-reduce" else 1.0
  if group is not None:
    return (
      rounds
      * (group - 1.0)
      * (
        float(buffer_bytes) / group * float(t.mask_seconds_per_byte[axes])
        + float(t.mask_latency[axes])
      )
    )
  per_byte, fixed, _ = ring_collective(t, rounds, jnp.asarray(axes), jnp.asarray(0))
  return float(buffer_bytes) * float(per_byte) + float(fixed)


class EdgeTerms(NamedTuple):
  """One collective kind on a set of edges, each [N] (with a plan batch: [N, B] inside
  the simulator, [B, N] from `terms`): seconds, bytes per device, count (collectives per
  step: the runs of the edge's own collectives, or for a reduction that XLA combines,
  its share by bytes of the combined collectives), and the per-device buffer moved per
  byte of the value (0 where none runs)."""

  seconds: jax.Array
  bytes: jax.Array
  count: jax.Array
  buffer: jax.Array


# XLA's combiners merge at most this many collectives into one (`combine_threshold_count`
# of the all-reduce, all-gather and reduce-scatter combiners in xla/service/gpu/ and of
# `CpuAllReduceCombiner` in xla/service/cpu/cpu_compiler.cc).
COMBINE_COUNT = 256.0


def combined_count(
  t: CostTables,
  axes: jax.Array,
  moved: jax.Array,
  runs: jax.Array,
  combines: jax.Array,
  loop: jax.Array,
  threshold: jax.Array,
) -> jax.Array:
  """Collectives per step of edges whose collectives XLA's combiner merges.

  The combining edges (`combines` [N] > 0, see `CostTables.reduction_combines`, and
  `threshold` > 0: the backend combines this kind) with collectives over the same axes
  (`axes` [N, B]) in the same loop group (`loop` [N], `CostTables.reduction_loop`: one
  group outside loops and one per loop repeat count, `CostTables.loop_repeats`) form one group,
  counted per
  iteration (each edge's `moved` [N, B], bytes per device a step, and `runs` [N, B],
  collectives a step, divided by its loop's repeat count). A group of total bytes T and n
  collectives (per iteration) runs `max(ceil(T / threshold), ceil(n / COMBINE_COUNT))`
  combined collectives (per iteration), which its members share by bytes (a member's
  share times its repeat count: per step). Other edges keep their `runs`. Returns [N, B]."""
  member = (combines[:, None] > 0) & (axes != 0) & (threshold > 0)
  repeat = jnp.maximum(combines, 1.0)[:, None]
  # Sums per (group, plan, axes) as products of indicators: XLA vectorises a product where
  # it runs a reduction per group and axes as a scalar loop over the rows. One product of a
  # vector per group, whatever the count of groups: padded rows and groups add exact zeros.
  group = (loop[:, None] == jnp.arange(t.loop_repeats.shape[0])).astype(moved.dtype)  # [N, G]
  masks = jnp.arange(1, t.mask_group.shape[-1], dtype=axes.dtype)
  on = (axes[:, :, None] == masks).astype(moved.dtype)  # [N, B, M]
  per_step = jnp.stack([moved, runs], axis=-1)  # [N, B, 2]
  # Per iteration, members only (a non-member's share is its runs, below).
  once = jnp.where(member[..., None], per_step / repeat[..., None], 0.0)
  exact = jax.lax.Precision.HIGHEST
  summed = (on[..., None] * once[:, :, None, :]).reshape(on.shape[0], -1)  # [N, B * M * 2]
  sums = [jnp.dot(g, summed, precision=exact) for g in group.T]  # [B * M * 2] each.
  total, count = jnp.moveaxis(jnp.stack(sums).reshape(-1, *on.shape[1:], 2), -1, 0)  # [G, B, M]
  combined = jnp.where(
    total > 0, jnp.maximum(jnp.ceil(total / threshold), jnp.ceil(count / COMBINE_COUNT)), 0.0
  )
  per_byte = combined / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)  # [G, B, M]
  own = jnp.dot(group, per_byte.reshape(per_byte.shape[0], -1), precision=exact)  # [N, B * M]
  share = moved * jnp.sum(on * own.reshape(on.shape), axis=-1)
  return jnp.where(member, share, runs)


def edge_terms(
  t: CostTables,
  rounds: float | jax.Array,
  axes: jax.Array,
  divisor: jax.Array,
  weight: jax.Array,
  weighted_bytes: jax.Array,
  buffer_bytes: jax.Array,
  combine: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> EdgeTerms:
  """The terms of one collective kind over the axes `axes` [N, B] of edges run `weight`
  [N, 1] or [N, B] times a step, moving values of `weighted_bytes / weight` bytes
  (`weighted_bytes` of `weight`'s shape: weight times bytes; see `ring_collective`):
  bandwidth per byte moved, latency per collective. Linear in `weight` and
  `weighted_bytes`, so the terms of several edges with the same axes are those of one
  edge with their sums. `buffer` is `buffer_bytes` [N] over the group. With
  `combine = (combines [N], loop [N], threshold)`, the collectives of the combining edges
  are merged as XLA's combiner does (`combined_count`), so latency is charged per
  combined collective."""
  per_byte, fixed, fraction = ring_collective(t, rounds, axes, divisor)
  runs = jnp.where(axes != 0, weight, 0.0)
  runs_bytes = jnp.where(axes != 0, weighted_bytes, 0.0)
  moved = runs_bytes * fraction
  count = runs if combine is None else combined_count(t, axes, moved, runs, *combine)
  return EdgeTerms(
    seconds=runs_bytes * per_byte + count * fixed,
    bytes=moved,
    count=count,
    buffer=buffer_bytes[:, None] * fraction,
  )


def with_second_factor(
  t: CostTables, first: EdgeTerms, axes: jax.Array, divisor: jax.Array, weighted_bytes: jax.Array
) -> EdgeTerms:
  """`first`, the all-reduces of the reductions' first sharded factor [R, B], plus those
  of their other factors, over `axes` [R, B]: the same buffers (`weighted_bytes` [R, B]),
  combined as the first factor's are (their counts; uncombined, their runs, where the first
  factor is reduce-scattered), without a second pass of the combiner over the edges."""
  per_byte, fixed, fraction = ring_collective(t, 2.0, axes, divisor)
  runs_bytes = jnp.where(axes != 0, weighted_bytes, 0.0)
  count = jnp.where(
    axes != 0, jnp.where(first.count > 0, first.count, t.reduction_weight[:, None]), 0.0
  )
  return EdgeTerms(
    seconds=first.seconds + runs_bytes * per_byte + count * fixed,
    bytes=first.bytes + runs_bytes * fraction,
    count=first.count + count,
    buffer=first.buffer,
  )


# XLA:GPU tiles a column reduction in shared memory, one tile per operand (8,320 bytes
# for float32): 30 operands overrun an H100's 227 KiB and ptxas refuses the kernel.
GPU_VARIADIC_OPERANDS = 16


def sum_rows(*terms: jax.Array) -> list[jax.Array]:
  """Sums of each of `terms` [N, B] over N, [B] each.

  On a CPU, a product of a row of ones with each term: XLA:CPU runs a reduction as a
  scalar loop over the rows, its fused elementwise producers inside, where it runs the
  producers as vectorised loops and the product as a library kernel (the simulator's
  batched evaluations about twice as fast, `bench simulator`). Elsewhere one
  variadic reduction, into which XLA fuses the terms' producers (one pass over the rows),
  on a GPU in groups of at most `GPU_VARIADIC_OPERANDS` operands."""
  backend = jax.default_backend()
  if backend == "cpu":
    ones = jnp.ones(terms[0].shape[0], terms[0].dtype)
    return [jnp.dot(ones, x, precision=jax.lax.Precision.HIGHEST) for x in terms]
  group = GPU_VARIADIC_OPERANDS if backend == "gpu" else len(terms)
  sums = []
  for start in range(0, len(terms), group):
    chunk = terms[start : start + group]
    sums += jax.lax.reduce(
      chunk,
      tuple(jnp.zeros((), x.dtype) for x in chunk),
      lambda a, b: tuple(x + y for x, y in zip(a, b)),
      (0,),
    )
  return sums


def axis_count(t: CostTables) -> int:
  """The mesh's axes (the per-mask tables have 2**num_axes rows)."""
  return t.mask_group.shape[-1].bit_length() - 1
