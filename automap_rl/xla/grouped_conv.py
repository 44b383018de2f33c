"""Grouped convolutions whose kernel gradient XLA's partitioner over-counts, run per
device under `shard_map` with an explicit `psum` (see `automap_rl.xla.lower`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from automap_rl.mesh import spec_axes
from automap_rl.xla.interpret import _bind

__all__ = ["grouped_conv_binder"]


def _grouped_conv_axes(
  eqn,
  pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  origin: tuple[int, ...],
  count_param: str,
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
  """The mesh axes of a pinned grouped convolution's lhs batch and feature dims, or None
  when `eqn` is not a convolution at `origin` in `pinned` with `count_param` above one."""
  if (
    eqn.primitive.name != "conv_general_dilated"
    or eqn.params.get(count_param, 1) <= 1
    or origin not in pinned
  ):
    return None
  lhs_dims = eqn.params["dimension_numbers"][0]
  lhs_axes = spec_axes(pinned[origin][0][0], len(lhs_dims))
  return lhs_axes[lhs_dims[0]], lhs_axes[lhs_dims[1]]


def _dims_spec(dims: Sequence[int], by_dim: Mapping[int, tuple[str, ...]]) -> PartitionSpec:
  """A spec over `len(dims)` dims with the axes `by_dim` gives (others replicated)."""
  return PartitionSpec(*(by_dim.get(d) or None for d in range(len(dims))))


def _conv_binder(
  pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  mesh: jax.sharding.Mesh,
) -> Callable[[tuple[int, ...], Any, list[Any]], list[Any]]:
  """`bind` for `interpret`: a batch-grouped convolution (`batch_group_count > 1`, the kernel
  gradient of a grouped one) whose reduction (its lhs feature dim) the plan shards runs
  per device under `shard_map` and sums its partial results with a `psum` over the
  reduction's axes, as the simulator prices it; every other equation is bound as is.

  XLA's SPMD partitioner all-reduces such a convolution's partial results over every
  device, replicas included: with the reduction on a strict subset of the mesh and the
  other axes idle, the kernel gradient comes out multiplied by their size (see
  tests/test_lower.py). Under `shard_map` each device holds the groups of its lhs batch
  dim's axes (the rhs output features are gathered to whole groups where the plan splits
  them within a group) and the reduction's share of the batch.
  """

  def bind(origin: tuple[int, ...], eqn, invals: list[Any]) -> list[Any]:
    axes = _grouped_conv_axes(eqn, pinned, origin, "batch_group_count")
    if axes is None or not axes[1]:
      return _bind(eqn, invals)
    groups, summed = axes
    groups_count = eqn.params["batch_group_count"]
    lhs_dims, rhs_dims, out_dims = eqn.params["dimension_numbers"]
    spec = _dims_spec
    shards = int(np.prod([mesh.shape[a] for a in groups]))
    local = lambda lhs, rhs: jax.lax.psum(
      _bind(eqn, [lhs, rhs], batch_group_count=groups_count // shards)[0], summed
    )
    in_specs = (
      spec(lhs_dims, {lhs_dims[0]: groups, lhs_dims[1]: summed}),
      spec(rhs_dims, {rhs_dims[0]: groups, rhs_dims[1]: summed}),
    )
    out_spec = spec(out_dims, {out_dims[1]: groups})
    return [jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(*invals)]

  return bind


def grouped_conv_binder(
  pinned: Mapping[tuple[int, ...], tuple[Sequence[PartitionSpec], Sequence[PartitionSpec]]],
  mesh: jax.sharding.Mesh | None,
) -> Callable[[tuple[int, ...], Any, list[Any]], list[Any]]:
  """`bind` for an `interpret` that will be differentiated (`_conv_binder`'s counterpart,
  for a kernel gradient that autodiff writes, not the program): a grouped convolution
  (`feature_group_count > 1`) whose lhs batch dim the plan shards (`pinned`: origin ->
  (operand specs, result specs)) gets a custom derivative whose kernel gradient runs per
  device under `shard_map`, its groups split as the lhs features are, and sums its
  partial results with a `psum` over the batch's axes; XLA's partitioner, given that
  batch-grouped convolution, over-counts it (twice the gradient on a 2 x 2 mesh, see
  tests/test_pipeline_lower.py). `mesh` None: the trace's mesh (inside `shard_map`).
  Every other equation is bound as is."""

  def bind(origin: tuple[int, ...], eqn, invals: list[Any]) -> list[Any]:
    axes = _grouped_conv_axes(eqn, pinned, origin, "feature_group_count")
    if axes is None or not axes[0]:
      return _bind(eqn, invals)
    batch, features = axes
    groups = eqn.params["feature_group_count"]
    lhs_dims, rhs_dims, out_dims = eqn.params["dimension_numbers"]
    on = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    shards = int(np.prod([on.shape[a] for a in features]))
    spec = _dims_spec
    specs = (
      spec(lhs_dims, {lhs_dims[0]: batch, lhs_dims[1]: features}),
      spec(rhs_dims, {rhs_dims[0]: features}),
      spec(out_dims, {out_dims[0]: batch, out_dims[1]: features}),
    )
    conv = lambda lhs, rhs: _bind(eqn, [lhs, rhs])[0]

    def kernel_gradient(lhs, rhs, cotangent):
      local = lambda w: _bind(eqn, [lhs, w], feature_group_count=groups // shards)[0]
      return jax.lax.psum(jax.vjp(local, rhs)[1](cotangent)[0], batch)

    @jax.custom_vjp
    def grouped(lhs, rhs):
      return conv(lhs, rhs)

    def backward(saved, cotangent):
      lhs, rhs = saved
      d_lhs = jax.vjp(lambda x: conv(x, rhs), lhs)[1](cotangent)[0]
      d_rhs = jax.shard_map(
        kernel_gradient,
        mesh=on,
        in_specs=specs,
        out_specs=specs[1],
        axis_names={*batch, *features},
        check_vma=False,
      )(lhs, rhs, cotangent)
      return d_lhs, d_rhs

    grouped.defvjp(lambda lhs, rhs: (conv(lhs, rhs), (lhs, rhs)), backward)
    return [grouped(*invals)]

  return bind
