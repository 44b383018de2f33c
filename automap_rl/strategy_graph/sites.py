"""The site nodes of a strategy graph: every distinct row (a value signature's dims or an op
signature's factors) resolved under each joint assignment of its class nodes, by the one
rule, and each site's assignments grouped into strategies."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import sharding
from automap_rl.problem import Problem
from automap_rl.solver import Limits
from automap_rl.strategy_graph.domains import MAX_SITE_ASSIGNMENTS, SiteSpec
from automap_rl.strategy_graph.graph import Axes, Site

_ROW_CHUNK = 1 << 14  # Row assignments per jitted call of the decision-by-decision rule.


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return (
    np.concatenate([x, np.full((rows - len(x), *x.shape[1:]), -1, x.dtype)]) if len(x) < rows else x
  )


@jax.jit
@jax.vmap
def _apply_in_order(
  divisible: jax.Array, classes: jax.Array, dec_class: jax.Array, dec_axis: jax.Array
) -> jax.Array:
  """Resolves rows decision by decision (`sharding.apply_decision`, the one rule), vmapped
  over a batch: `(divisible int32 [B, S], classes int32 [B, S], dec_class int32 [B, K],
  dec_axis int32 [B, K]) -> masks int8 [B, S]`; a decision with axis -1 is none."""

  def step(mask, decision):
    cls, axis = decision
    rank = jnp.where((classes == cls) & (cls >= 0) & (axis >= 0), 0, sharding.NO_SLOT_RANK).astype(
      jnp.int16
    )
    return sharding.apply_decision(divisible[None], mask[None], rank[None], jnp.maximum(axis, 0))[
      0
    ], None

  mask, _ = jax.lax.scan(step, jnp.zeros(classes.shape, jnp.int8), (dec_class, dec_axis))
  return mask


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
  """Every resolution of one row (a value signature's dims or an op signature's factors)
  under the joint assignments of its class nodes.

  Attributes:
    variables: its class nodes, in the order of their first class in the graph's order, [m].
    radix: their domain sizes, [m]; assignment indices as `Site.lookup`'s.
    masks: the row's axis bit masks under each assignment, int8 [prod(radix), W].
    ids: each assignment's resolution, numbered by first appearance, int64 [prod(radix)].
  """

  variables: tuple[int, ...]
  radix: np.ndarray
  masks: np.ndarray
  ids: np.ndarray


def row_key(problem: Problem, row: tuple[str, int]) -> tuple:
  kind, i = row
  classes, sizes = (
    (problem.sigs.op_class[i], problem.sigs.op_size[i])
    if kind == "op"
    else (problem.sigs.value_class[i], problem.sigs.value_size[i])
  )
  return kind, tuple(classes.tolist()), tuple(sizes.tolist())


def resolve_rows(
  problem: Problem,
  specs: Sequence[SiteSpec],
  domains: Mapping[int, tuple[Axes, ...]],
  rank: Mapping[int, int],
  node_of: np.ndarray,
  position: Mapping[tuple[int, int], int],
  limits: Limits,
) -> dict[tuple, Row]:
  """Each distinct row of the sites (by `row_key`: rows alike resolve alike) resolved
  under every joint assignment of its class nodes: its classes' decisions at their
  decision slots (`position`), in order."""
  keys = list(dict.fromkeys(row_key(problem, row) for spec in specs for row in spec.rows))
  width = max(problem.sigs.op_class.shape[1], problem.sigs.value_class.shape[1])
  max_axes = max(k for _, k in position) + 1
  steps = width * max_axes
  layout = []  # (key, variables, radix) per row.
  bits = np.ones((len(keys), width), np.int32)
  slot_class = np.full((len(keys), width), -1, np.int32)
  dec_class = np.full((len(keys), steps), -1, np.int32)
  owner, dec_axis = (
    [],
    [],
  )  # Per row assignment: its row, int32 [N]; its decisions' axes, int8 [N, K].
  for r, (kind, classes, sizes) in enumerate(keys):
    limits.check("listing the strategy graph's row assignments")
    ordered = sorted({c for c in classes if c >= 0}, key=rank.__getitem__)
    variables = tuple(dict.fromkeys(int(node_of[c]) for c in ordered))
    radix = np.array([len(domains[n]) for n in variables], np.int64)
    total = int(np.prod(radix))
    if total > MAX_SITE_ASSIGNMENTS:
      raise ValueError(f"an {kind} signature has {total} assignments of its classes: too many")
    digits = (
      np.stack(np.unravel_index(np.arange(total), tuple(radix.tolist())), axis=1)
      if len(radix)
      else np.zeros((1, 0), np.int64)
    )  # [A, m]
    axes = np.full((total, steps), -1, np.int8)
    slots = sorted(((c, k) for c in ordered for k in range(max_axes)), key=position.__getitem__)
    for j, (cls, k) in enumerate(slots):
      node = variables.index(int(node_of[cls]))
      table = np.array([a[k] if k < len(a) else -1 for a in domains[variables[node]]], np.int8)
      axes[:, j] = table[digits[:, node]]
      dec_class[r, j] = cls
    slot_class[r, : len(classes)] = classes
    bits[r, : len(sizes)] = sharding.divisibility_bits(
      np.array(sizes, np.int64), problem.mesh.axis_sizes
    )
    layout.append(((kind, classes, sizes), variables, radix))
    owner.append(np.full(total, r, np.int32))
    dec_axis.append(axes)
  owner = np.concatenate(owner) if owner else np.zeros(0, np.int32)
  dec_axis = np.concatenate(dec_axis) if dec_axis else np.zeros((0, steps), np.int8)
  masks = np.zeros((len(owner), width), np.int8)
  for start in range(0, len(owner), _ROW_CHUNK):
    limits.check("resolving the strategy graph's rows")
    end = min(start + _ROW_CHUNK, len(owner))
    mine = _pad_rows(owner[start:end], _ROW_CHUNK).clip(0)
    batch = _apply_in_order(
      bits[mine],
      slot_class[mine],
      dec_class[mine],
      _pad_rows(dec_axis[start:end].astype(np.int32), _ROW_CHUNK),
    )
    masks[start:end] = np.asarray(jax.device_get(batch))[: end - start]
  del owner, dec_axis
  rows, first = {}, 0
  for key, variables, radix in layout:
    total = int(np.prod(radix))
    own = masks[first : first + total, : len(key[1])]
    first += total
    _, index, ids = np.unique(own, axis=0, return_index=True, return_inverse=True)
    order = np.empty(len(index), np.int64)
    order[np.argsort(index, kind="stable")] = np.arange(len(index))
    rows[key] = Row(variables=variables, radix=radix, masks=own, ids=order[ids.reshape(-1)])
  return rows


def build_site(
  problem: Problem,
  spec: SiteSpec,
  indices: Sequence[int],
  domains: Mapping[int, tuple[Axes, ...]],
  rows: Mapping[tuple, Row],
) -> Site:
  """Enumerates a site's assignments, groups those that resolve alike (every row alike)
  into strategies (product sets only, see the module docstring)."""
  variables = spec.variables
  radix = np.array([len(domains[n]) for n in variables], np.int64)
  total = int(np.prod(radix))
  if total > MAX_SITE_ASSIGNMENTS:
    raise ValueError(
      f"{spec.kind} signature {spec.index} has {total} assignments of its classes: too many"
    )
  digits = (
    np.stack(np.unravel_index(np.arange(total), tuple(radix.tolist())), axis=1)
    if len(radix)
    else np.zeros((1, 0), np.int64)
  )  # [A, k]: each class node's domain index.
  row_index, inverse = [], np.zeros(total, np.int64)
  for row in spec.rows:
    table = rows[row_key(problem, row)]
    places = [variables.index(n) for n in table.variables]
    index = (
      np.ravel_multi_index(tuple(digits[:, places].T), tuple(table.radix.tolist()))
      if places
      else np.zeros(total, np.int64)
    )
    row_index.append((table, index))
    # Mixed radix over the rows' resolutions, renumbered after each row to stay small.
    _, inverse = np.unique(
      inverse * (int(table.ids.max()) + 1) + table.ids[index], return_inverse=True
    )
    inverse = inverse.reshape(-1)
  groups = int(inverse.max()) + 1
  product = np.ones(groups, np.int64)
  for i, size in enumerate(radix.tolist()):
    present = np.zeros((groups, size), bool)
    present[inverse, digits[:, i]] = True
    product *= present.sum(axis=1)
  whole = product == np.bincount(inverse, minlength=groups)
  # A product set is one strategy; any other group splits into single assignments.
  key = np.where(whole[inverse], inverse, groups + np.arange(total))
  _, first, lookup = np.unique(key, return_index=True, return_inverse=True)
  rank = np.empty(len(first), np.int64)
  rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # Strategies by first assignment.
  lookup = rank[lookup.reshape(-1)]
  allowed = []
  for i, size in enumerate(radix.tolist()):
    table = np.zeros((len(first), size), bool)
    table[lookup, digits[:, i]] = True
    allowed.append(table)
  chosen = np.sort(first)
  masks = np.concatenate([table.masks[index[chosen]] for table, index in row_index], axis=1)
  return Site(
    kind=spec.kind,
    indices=tuple(indices),
    classes=np.array(variables, np.int64),
    radix=radix,
    lookup=lookup,
    allowed=tuple(allowed),
    masks=masks,
  )
