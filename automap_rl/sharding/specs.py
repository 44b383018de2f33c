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


def class_axis_use(
  sigs: Signatures, resolution: Resolution, num_classes: int, num_axes: int
) -> np.ndarray:
  """How many values split a dim of each class over each mesh axis under a resolved plan,
  int64 [num_classes, num_axes] (`dim_axes` lays a dim's axes out by it)."""
  masks = np.asarray(resolution.value_mask)[: len(sigs.value_keys)].astype(np.int64)  # [Uv, Rv]
  values = np.bincount(sigs.value_sig, minlength=len(sigs.value_keys))  # Values per signature.
  use = np.zeros((num_classes, num_axes), np.int64)
  for axis in range(num_axes):
    split = (sigs.value_class >= 0) & (masks >> axis & 1).astype(bool)
    np.add.at(
      use[:, axis], sigs.value_class[split], np.broadcast_to(values[:, None], split.shape)[split]
    )
  return use


def dim_axes(
  mask: int,
  cls: int,
  dec_class: np.ndarray,
  dec_axis: np.ndarray,
  axis_names: Sequence[str],
  axis_use: np.ndarray,
):
  """The axes of a dim with bit mask `mask` and class `cls` (those of its class's
  decisions), major to minor, whatever the decisions' order: the axis more values of the
  class are split over first (`class_axis_use`), ties in mesh order. Gathering the minor
  axis leaves a device the shard the major one gives it alone, so a value split over
  both, such as an FSDP-stored bias or batch, gathers into the sharding its readers
  compute on (laid out otherwise, XLA moves whole operands and recomputes); the
  simulator prices a dim's axes as a set."""
  order = {
    int(a) for c, a in zip(dec_class, dec_axis) if c == cls and c >= 0 and mask >> int(a) & 1
  }
  names = tuple(axis_names[a] for a in sorted(order, key=lambda a: (-int(axis_use[cls, a]), a)))
  return None if not names else names[0] if len(names) == 1 else names


def partition_spec(
  value_id: int,
  sigs: Signatures,
  resolution: Resolution,
  dec_class: np.ndarray,
  dec_axis: np.ndarray,
  mesh: Mesh,
  axis_use: np.ndarray,
) -> jax.sharding.PartitionSpec:
  """The `PartitionSpec` of one value under a resolved plan (`axis_use`: its
  `class_axis_use`)."""
  sig = int(sigs.value_sig[value_id])
  masks = np.asarray(resolution.value_mask)[sig]
  classes = sigs.value_class[sig]
  rank = len(sigs.value_keys[sig][1])
  return jax.sharding.PartitionSpec(
    *(
      dim_axes(int(masks[d]), int(classes[d]), dec_class, dec_axis, mesh.axis_names, axis_use)
      for d in range(rank)
    )
  )


def op_partition_specs(
  op: Op,
  sigs: Signatures,
  resolution: Resolution,
  dec_class: np.ndarray,
  dec_axis: np.ndarray,
  mesh: Mesh,
  axis_use: np.ndarray,
) -> tuple[tuple[PartitionSpec, ...], tuple[PartitionSpec, ...]]:
  """The `PartitionSpec`s the op computes on: `(operands, results)` as its factors are sharded.

  A dim takes the axes of its factors, major to minor; that is its sharding when at most
  its major factor is sharded, as in the convolution and window rules `lower` pins by this.
  An op without a signature of its own follows its values (see `_follows_its_values`).
  """
  sig = int(sigs.op_sig[op.id])
  if sig < 0:
    spec = lambda v: partition_spec(v, sigs, resolution, dec_class, dec_axis, mesh, axis_use)
    return tuple(map(spec, op.operands)), tuple(map(spec, op.results))
  masks, classes = np.asarray(resolution.op_mask)[sig], sigs.op_class[sig]

  def spec_of(dims) -> PartitionSpec:
    entries = []
    for factors in dims:
      axes = []
      for f in factors:
        found = dim_axes(
          int(masks[f]), int(classes[f]), dec_class, dec_axis, mesh.axis_names, axis_use
        )
        axes.extend(() if found is None else (found,) if isinstance(found, str) else found)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)

  return tuple(map(spec_of, op.rule.operand_dims)), tuple(map(spec_of, op.rule.result_dims))
