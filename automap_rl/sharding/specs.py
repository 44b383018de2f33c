"""`PartitionSpec`s of values and ops under a resolved plan."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec

from automap_rl.ir import Op
from automap_rl.mesh import Mesh
from automap_rl.sharding.resolution import Resolution
from automap_rl.sharding.signatures import Signatures


def dim_axes(mask: int, cls: int, dec_class: np.ndarray, dec_axis: np.ndarray, axis_names: Sequence[str]):
  """The axes of a dim with bit mask `mask` and class `cls` (those of its class's
  decisions), in mesh order, major to minor, whatever the decisions' order: the simulator
  prices a dim's axes as a set, and a partial sum reduce-scattered over a later axis of the
  mesh comes out split in mesh order (the other order would make XLA gather the operands
  whole and recompute)."""
  order = [int(a) for c, a in zip(dec_class, dec_axis) if c == cls and c >= 0 and mask >> int(a) & 1]
  names = tuple(axis_names[a] for a in sorted(set(order)))
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
