"""Gradient accumulation lowered: one stage, M microbatches (a `Pipeline` with S = 1).

The step's forward and backward run once per microbatch in a `jax.lax.scan`: microbatch m
holds rows m, m + M, m + 2M, ... of every batch leaf (so that a batch dim sharded over the
data axes stays on its devices), its loss and gradients are computed by
`jax.value_and_grad` of the loss on that microbatch (each equation pinned as `lower` pins
its counterpart in the planned step, `pipeline_lower._StepPins`), and the gradients are
added into sums stored in the parameters' planned shardings. The loss and gradients are
the sums over M (the microbatch losses are batch means of equal microbatches, so their
mean is the batch's). One optimizer update follows (`train_step`). Peak memory: one
microbatch's activations plus the gradient sums.

Where the loop is manual over the batch axes (`pipeline_lower.manual_rows`, as
`simulator.pipeline.manual_axes` prices it), it runs under `jax.shard_map` over them:
each device sums the gradients of its rows of every microbatch, and the sums are reduced
over those axes once after the loop (reduce-scattered onto the dims the parameters are
stored split on over them, all-reduced over the rest), as Megatron-LM and PyTorch DDP
accumulate without synchronizing. The parameters enter the loop whole over those axes:
those stored split over them (ZeRO, FSDP with `Pipeline.gather_weights_once`) are
gathered once a step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from automap_rl.mesh import spec_axes

__all__ = ["accumulated", "microbatched", "train_step"]

ValueAndGrad = Callable[[Any, Any], tuple[Any, Any]]


def microbatched(batch: Any, microbatches: int, rows: Callable[[Any], Any]) -> Any:
  """Every leaf [B, ...] of `batch` as [M, B / M, ...], microbatch m holding rows m, m + M,
  ...; `rows(x)` constrains the result's sharding (its dim 1, the rows, over the batch
  axes)."""
  m = microbatches
  split = lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
  return jax.tree.map(lambda x: rows(split(x)), batch)


def accumulated(
  loss_fn: Callable[[Any, Any], Any],
  microbatches: int,
  param_shardings: Any,
  rows: Callable[[Any], Any],
  manual: tuple[str, ...] = (),
) -> ValueAndGrad:
  """`value_and_grad(params, batch) -> (loss [], grads)` of `loss_fn(params, batch)` run
  per microbatch in a scan (module docstring).

  Args:
    loss_fn: the (pinned) loss on one microbatch, `loss_fn(params, micro) -> loss []`: on a
      device's rows of it [B / (M R), ...] where the loop is `manual` over R devices.
    microbatches: M, dividing the batch.
    param_shardings: a `NamedSharding` per parameter leaf, a pytree like `params`: the
      gradient sums are kept in them.
    rows: constrains a microbatched leaf [M, B / M, ...] (see `microbatched`).
    manual: the batch axes the loop runs manual over (module docstring); none: XLA's
      partitioner places the whole loop.
  """
  pin = lambda tree: jax.tree.map(jax.lax.with_sharding_constraint, tree, param_shardings)

  def summed(params: Any, micro: Any) -> tuple[Any, Any]:
    def add(carry, one):
      total, sums = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, one)
      sums = jax.tree.map(jnp.add, sums, grads)
      return (total + loss, sums if manual else pin(sums)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    start = (jnp.zeros((), jnp.float32), zeros if manual else pin(zeros))
    return jax.lax.scan(add, start, micro)[0]

  def value_and_grad(params: Any, batch: Any) -> tuple[Any, Any]:
    micro = microbatched(batch, microbatches, rows)
    if manual:
      total, sums = _manual_sums(summed, param_shardings, manual)(params, micro)
      sums = pin(sums)
    else:
      total, sums = summed(params, micro)
    scale = 1.0 / microbatches
    return total * scale, jax.tree.map(lambda g: (g * scale).astype(g.dtype), sums)

  return value_and_grad


def _manual_sums(
  summed: Callable[[Any, Any], tuple[Any, Any]], param_shardings: Any, manual: tuple[str, ...]
) -> Callable[[Any, Any], tuple[Any, Any]]:
  """`summed` (the loss and gradient sums of a device's rows of every microbatch) under
  `jax.shard_map` manual over the axes `manual`, its sums averaged over them once:
  reduce-scattered onto the dims each parameter's sharding splits over them, all-reduced
  over the others."""
  mesh = jax.tree_util.tree_leaves(param_shardings)[0].mesh
  devices = 1
  for a in manual:
    devices *= mesh.shape[a]

  def on_manual(sharding: NamedSharding, ndim: int) -> list[tuple[str, ...]]:
    return [tuple(a for a in axes if a in manual) for axes in spec_axes(sharding.spec, ndim)]

  def reduced(g: jax.Array, sharding: NamedSharding) -> jax.Array:
    dims = on_manual(sharding, g.ndim)
    for d, axes in enumerate(dims):
      if axes:
        g = jax.lax.psum_scatter(g, axes, scatter_dimension=d, tiled=True)
    rest = tuple(a for a in manual if all(a not in axes for axes in dims))
    return (jax.lax.psum(g, rest) if rest else g) / devices

  def local(params: Any, micro: Any) -> tuple[Any, Any]:
    total, sums = summed(params, micro)
    return jax.lax.psum(total, manual) / devices, jax.tree.map(reduced, sums, param_shardings)

  def shard_mapped(params: Any, micro: Any) -> tuple[Any, Any]:
    sums_specs = jax.tree.map(
      lambda p, sh: PartitionSpec(*(axes or None for axes in on_manual(sh, p.ndim))),
      params,
      param_shardings,
    )
    return jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(PartitionSpec(), PartitionSpec(None, manual)),
      out_specs=(PartitionSpec(), sums_specs),
      axis_names=set(manual),
      check_vma=False,
    )(params, micro)

  return shard_mapped


def train_step(value_and_grad: ValueAndGrad, optimizer: optax.GradientTransformation):
  """`step(params, opt_state, batch) -> (params, opt_state, loss)`: the loss and gradients
  of `value_and_grad`, one update of `optimizer` (as `workloads.training.make_train_step`
  applies it)."""

  def step(params, opt_state, batch):
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def row_constrainer(
  mesh: jax.sharding.Mesh, batch_axes: Sequence[str], microbatches: int
) -> Callable[[Any], Any]:
  """`rows` for `microbatched`: a leaf [M, B / M, ...] constrained with its rows over
  `batch_axes` where they divide them (other dims left to XLA)."""
  splits = 1
  for a in batch_axes:
    splits *= mesh.shape[a]
  free = PartitionSpec.UNCONSTRAINED

  def rows(x: Any) -> Any:
    on = tuple(batch_axes) if batch_axes and x.shape[1] % splits == 0 else None
    spec = PartitionSpec(None, on, *(free,) * (x.ndim - 2))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  return rows
