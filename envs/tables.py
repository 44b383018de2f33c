"""Static tables of one environment: a `Problem` and an `EnvConfig` laid out as arrays.

`EnvTables` is a pytree of arrays that lives outside the state. Every array's axes are
named in `DIMS`, so tables of different programs and meshes can be padded to common
sizes (`pad`, `bucket_sizes`) and stacked (`stack`) for a vmapped batch that mixes
models. Padding is inert: padded dims have no class (never sharded), padded ops and
values cost nothing, padded edges and reduction edges have weight 0, padded targets are
never legal.

Size names: Uv value signatures with Rv dims, Uo op signatures with Rf factors, E edges
(Eu classes of edges that resolve alike) of which R reduce, Ss reads priced as sharing a
resharding (Sp pairs of them), L memory probe rows, D factors per dim, Q chunks of W slots
(value dims and op factors) of one class, C classes, T targets covering at most M classes
each, G coverage edges (target to signature), X mesh axes (`EnvConfig.max_axes`), B axis
masks of the simulator's tables (2 ** the mesh's own axes, which are all a plan uses; a
stack for meshes of more axes tiles them, `cost_padding.tiled_masks`), P pipeline options
(`envs.pipelines`; bucket padding keeps their pricing tables, which index the signatures,
as they are).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import buckets, sharding, simulator
from automap_rl.ir import FactorKind, Role
from automap_rl.problem import Problem
from automap_rl.simulator.tables import padding as cost_padding
from envs.actions import Target
from envs.config import EnvConfig
from envs.pipelines import PipelineOptions, alike, build_options, menu

NO_RANK = 1 << 20  # Rank of a class a target does not cover.

_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
_LAYOUT = frozenset(
  {
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "concatenate",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "scatter",
    "scatter-add",
    "scatter_add",
    "pad",
    "rev",
    "copy",
    "copy_p",
    "convert_element_type",
    "select_n",
    "iota",
  }
)
# Non-trainable state is observed as optimizer state (what the zoo called it before it had a
# role of its own): the observation, and the networks trained on it, keep their width.
_OBSERVED_ROLE = {Role.STATE: Role.OPTIMIZER_STATE}
NUM_OBSERVED_ROLES = len(Role) - len(_OBSERVED_ROLE)
NUM_VALUE_FEATURES = 3 + NUM_OBSERVED_ROLES
NUM_OP_FEATURES = 8
NUM_TARGET_FEATURES = 3

# Dims of every array, by table name; cost tables by `simulator.CostTables` field.
DIMS: Mapping[str, tuple[str, ...]] = {
  "value_class": ("Uv", "Rv"),
  "value_divisible": ("Uv", "Rv"),
  "op_class": ("Uo", "Rf"),
  "op_divisible": ("Uo", "Rf"),
  "axis_sizes": ("X",),
  "axis_valid": ("X",),
  "slot_order": ("Q", "W"),
  "slot_divisible": ("Q", "W"),
  "chunk_class": ("Q",),
  "target_classes": ("T", "M"),
  "target_rank": ("T", "C"),
  "value_rank": ("T", "Uv", "Rv"),
  "op_rank": ("T", "Uo", "Rf"),
  "base": ("3",),
  "mesh_features": ("F",),
  "value_features": ("Uv", "Fv"),
  "op_features": ("Uo", "Fo"),
  "target_features": ("T", "Ft"),
  "edge_real": ("E",),
  "cover_target": ("G",),
  "cover_index": ("G",),
  "cover_is_op": ("G",),
  "cover_real": ("G",),
}
_FILL = {
  "value_class": -1,
  "value_divisible": 1,
  "op_class": -1,
  "op_divisible": 1,
  "target_classes": -1,
  "target_rank": NO_RANK,
  "axis_sizes": 1,
  "chunk_class": NO_RANK,
  "slot_divisible": 1,
  "value_rank": sharding.NO_SLOT_RANK,
  "op_rank": sharding.NO_SLOT_RANK,
}
# Dims padded to buckets (`automap_rl.buckets`); the others are fixed by the configuration
# (X, B, P, W, features) or by the simulator (its pair and column counts).
BUCKETED = cost_padding.VARYING | {"Q", "C", "T", "M", "G"}
CHUNK = 8  # W: slots per chunk.


@chex.dataclass(frozen=True)
class EnvTables:
  """The static arrays of one environment (see the module docstring for size names).

  Attributes:
    value_class, value_divisible: class (-1: none) and `sharding.divisibility_bits` of the
      size of each value-signature dim, over the X (padded) axes, [Uv, Rv].
    op_class, op_divisible: the same for op-signature factors, [Uo, Rf].
    slot_order: one slot with a class per owner slot (`sharding.Owners`: signatures that
      share an owner resolve alike) in chunks of one class each, sorted by class, as
      indices into the value dims then op factors flattened (`value_class.ravel()` then
      `op_class.ravel()`), [Q, W]; padding slots have size 1 (never open on an axis).
    slot_divisible: their divisibility bits, [Q, W]; chunk_class: the class of each chunk
      (`NO_RANK` pads), [Q]. Padding slots and dims have bits 1 (size 1: never open on an axis).
    axis_sizes: mesh axis sizes, padded with 1, [X]; axis_valid: real axes, bool [X].
    target_classes: classes of each target in decision order, -1 padded, [T, M].
    target_rank: position of each class in each target, `NO_RANK` if absent, [T, C].
    value_rank, op_rank: the same per slot, `sharding.NO_SLOT_RANK` if absent, int16 [T, Uv, Rv] and
      [T, Uo, Rf]: a step gathers its target's row instead of a rank per slot.
    base: the replicated plan's step time, peak memory and raw objective, [3]
      (columns `BASE_STEP_TIME`, `BASE_PEAK_MEMORY`, `BASE_OBJECTIVE`).
    mesh_features: static global features of the observation, [F].
    value_features, op_features, target_features: static node features, [U*, F*].
    edge_real: which cost edges are real, bool [E].
    cover_target, cover_index, cover_is_op, cover_real: coverage edges from a target to a
      value (op) signature holding one of its classes, [G].
    cost: the simulator's tables (per-mask tables tiled to B = 2**X entries).
    pipeline: the pipeline options (`EnvConfig.pipelines` > 0), else None.
  """

  value_class: jax.Array
  value_divisible: jax.Array
  slot_order: jax.Array
  slot_divisible: jax.Array
  chunk_class: jax.Array
  op_class: jax.Array
  op_divisible: jax.Array
  axis_sizes: jax.Array
  axis_valid: jax.Array
  target_classes: jax.Array
  target_rank: jax.Array
  value_rank: jax.Array
  op_rank: jax.Array
  base: jax.Array
  mesh_features: jax.Array
  value_features: jax.Array
  op_features: jax.Array
  target_features: jax.Array
  edge_real: jax.Array
  cover_target: jax.Array
  cover_index: jax.Array
  cover_is_op: jax.Array
  cover_real: jax.Array
  cost: simulator.CostTables
  pipeline: PipelineOptions | None = None

  @property
  def num_axes(self) -> int:
    return self.axis_sizes.shape[-1]

  @property
  def num_moves(self) -> int:
    """Intra-op actions: targets x mesh axes (the first actions)."""
    return self.target_classes.shape[-2] * self.num_axes

  @property
  def num_pipelines(self) -> int:
    """Pipeline options: the actions after the intra-op ones, before stop."""
    return 0 if self.pipeline is None else self.pipeline.valid.shape[-1]

  @property
  def num_actions(self) -> int:
    return self.num_moves + self.num_pipelines + 1


BASE_STEP_TIME, BASE_PEAK_MEMORY, BASE_OBJECTIVE = 0, 1, 2  # The columns of `EnvTables.base`.


def raw_objective(config: EnvConfig, cost: simulator.Cost, base: jax.Array, hbm_bytes) -> jax.Array:
  """The objective before normalisation: weighted step time (with the memory penalty) and
  peak memory, each relative to the replicated plan's (`base[BASE_STEP_TIME]`,
  `base[BASE_PEAK_MEMORY]`)."""
  w_time, w_memory = config.weights
  overflow = jnp.maximum(cost.peak_memory / hbm_bytes - 1.0, 0.0)
  time = cost.step_time * (1.0 + config.memory_penalty * overflow)
  return w_time * time / base[BASE_STEP_TIME] + w_memory * cost.peak_memory / base[BASE_PEAK_MEMORY]


def replicated_base(config: EnvConfig, problem: Problem) -> np.ndarray:
  """`EnvTables.base`: the replicated plan's step time, peak memory and raw objective, f32 [3]."""
  cost = problem.cost([])
  base = np.zeros(3, np.float32)
  base[BASE_STEP_TIME], base[BASE_PEAK_MEMORY] = float(cost.step_time), float(cost.peak_memory)
  base[BASE_OBJECTIVE] = raw_objective(config, cost, base, problem.tables.hbm_bytes)
  return base


def objective(config: EnvConfig, cost: simulator.Cost, base: jax.Array, hbm_bytes) -> jax.Array:
  """The environment's objective of a cost: its raw objective over the replicated plan's
  (1 is the replicated plan, below 1 better)."""
  return raw_objective(config, cost, base, hbm_bytes) / base[BASE_OBJECTIVE]


def _slot_rank(target_rank: np.ndarray, classes: np.ndarray) -> np.ndarray:
  """Each target's rank of each slot's class, int16 [T, owners, slots]."""
  if (target_rank[target_rank < NO_RANK] >= sharding.NO_SLOT_RANK).any():
    raise ValueError(f"A target covers more than {sharding.NO_SLOT_RANK} classes.")
  ranks = np.minimum(target_rank[:, np.maximum(classes, 0)], sharding.NO_SLOT_RANK)
  return np.where(classes >= 0, ranks, sharding.NO_SLOT_RANK).astype(np.int16)


def _representative_slots(owners: sharding.Owners) -> np.ndarray:
  """One slot (value dim or op factor, flattened as `value_class.ravel()` then
  `op_class.ravel()`) for each owner slot: signatures that share an owner resolve alike,
  so the legal mask tests one of them for all (half the slots of a 12-layer GPT). Bool
  [Uv * Rv + Uo * Rf]."""
  flat = [
    (owner.ravel(), slot.ravel())
    for owner, slot in ((owners.value_owner, owners.value_slot), (owners.op_owner, owners.op_slot))
  ]
  owner, slot = (np.concatenate(parts) for parts in zip(*flat))
  key = np.where(owner >= 0, owner * owners.classes.shape[1] + slot, -1)
  first = np.zeros(len(key), bool)
  _, index = np.unique(key, return_index=True)
  first[index] = True
  return first & (key >= 0)


def _value_features(problem: Problem) -> np.ndarray:
  """[log2 bytes / 40, share of all bytes, rank / 8, role fractions (6)] per value signature."""
  sigs, program = problem.sigs, problem.program
  nbytes = np.array([math.prod(k[1]) * k[2] for k in sigs.value_keys], np.float64)
  rank = np.array([len(k[1]) for k in sigs.value_keys], np.float64)
  roles = np.zeros((len(nbytes), NUM_OBSERVED_ROLES))
  np.add.at(
    roles, (sigs.value_sig, [_OBSERVED_ROLE.get(v.role, v.role) for v in program.values]), 1.0
  )
  roles /= np.maximum(roles.sum(1, keepdims=True), 1.0)
  head = np.stack([np.log2(1.0 + nbytes) / 40.0, nbytes / max(nbytes.sum(), 1.0), rank / 8.0], 1)
  return np.concatenate([head, roles], 1).astype(np.float32)


def _op_features(problem: Problem, tables: simulator.CostTables) -> np.ndarray:
  """[log10 time (s) / 12 + 1, share of time, kind fractions (contraction, reduction,
  layout, elementwise), has a reduction factor, factors / 8] per op signature."""
  sigs, program = problem.sigs, problem.program
  kinds = np.zeros((len(sigs.op_class), 4))
  for op in program.ops:
    if sigs.op_sig[op.id] < 0:  # Resolves like its values; no op signature.
      continue
    if op.primitive in _CONTRACTIONS:
      kind = 0
    elif FactorKind.REDUCTION in op.rule.factor_kinds:
      kind = 1
    else:
      kind = 2 if op.primitive in _LAYOUT else 3
    kinds[sigs.op_sig[op.id], kind] += 1.0
  kinds /= np.maximum(kinds.sum(1, keepdims=True), 1.0)
  memory = np.bincount(
    tables.edge_op, tables.edge_memory_s.astype(np.float64), len(tables.op_compute_s)
  )
  seconds = np.maximum(tables.op_compute_s, memory)
  head = np.stack(
    [np.log10(np.maximum(seconds, 1e-12)) / 12.0 + 1.0, seconds / max(seconds.sum(), 1e-30)], 1
  )
  tail = np.stack([tables.op_reduction.any(1), (sigs.op_size > 1).sum(1) / 8.0], 1)
  return np.concatenate([head, kinds, tail], 1).astype(np.float32)


def _coverage(problem: Problem, targets: Sequence[Target]):
  """Coverage edges (target, signature index, is op) and per-target features."""
  sigs = problem.sigs
  rows, slots = [], 0
  for is_op, classes in ((False, sigs.value_class), (True, sigs.op_class)):
    slots += int((classes >= 0).sum())
    for t, target in enumerate(targets):
      for index in np.flatnonzero(np.isin(classes, target.classes).any(1)):
        rows.append((t, int(index), is_op))
  rows = np.array(rows, np.int64).reshape(-1, 3)
  covered = np.array(
    [
      sum(int(np.isin(c, t.classes).sum()) for c in (sigs.value_class, sigs.op_class))
      for t in targets
    ],
    np.float64,
  )
  sizes = np.array(
    [max(problem.named.classes[c].size for c in t.classes) for t in targets], np.float64
  )
  counts = np.array([len(t.classes) for t in targets], np.float64)
  features = np.stack(
    [np.log2(1.0 + counts) / 4.0, np.log2(sizes) / 16.0, covered / max(slots, 1)], 1
  )
  return rows, features.astype(np.float32)


def build_env_tables(problem: Problem, config: EnvConfig, targets: Sequence[Target]) -> EnvTables:
  """The exact-size tables of `problem` under `config` (numpy arrays)."""
  mesh, sigs, tables = problem.mesh, problem.sigs, problem.tables
  num_axes, x = len(mesh.axis_sizes), config.max_axes
  if num_axes > x:
    raise ValueError(f"The mesh has {num_axes} axes; EnvConfig.max_axes is {x}.")
  num_classes = len(problem.named.classes)
  width = max(len(t.classes) for t in targets)
  target_classes = np.full((len(targets), width), -1, np.int32)
  target_rank = np.full((len(targets), num_classes), NO_RANK, np.int32)
  for i, t in enumerate(targets):
    target_classes[i, : len(t.classes)] = t.classes
    target_rank[i, list(t.classes)] = np.arange(len(t.classes))
  cost = jax.tree.map(np.asarray, tables)  # On the host; the mesh's own axis masks.
  base = replicated_base(config, problem)
  cover, target_features = _coverage(problem, targets)
  flat_class = np.concatenate([sigs.value_class.ravel(), sigs.op_class.ravel()])
  sizes = np.ones(x, np.int32)
  sizes[:num_axes] = mesh.axis_sizes
  value_divisible = sharding.divisibility_bits(sigs.value_size, sizes)
  op_divisible = sharding.divisibility_bits(sigs.op_size, sizes)
  flat_divisible = np.concatenate([value_divisible.ravel(), op_divisible.ravel()])
  representative = _representative_slots(problem.owners)
  chunks = [
    (c, members[i : i + CHUNK])
    for c in range(num_classes)
    for members in [np.flatnonzero((flat_class == c) & representative)]
    for i in range(0, len(members), CHUNK)
  ]
  slot_order = np.zeros((len(chunks), CHUNK), np.int64)
  slot_divisible = np.ones((len(chunks), CHUNK), np.int64)
  for q, (_, members) in enumerate(chunks):
    slot_order[q, : len(members)] = members
    slot_divisible[q, : len(members)] = flat_divisible[members]
  bandwidth = np.zeros(x, np.float32)
  bandwidth[:num_axes] = [np.log10(link.bandwidth) / 12.0 for link in mesh.links]
  mesh_features = np.concatenate(
    [
      np.log2(sizes) / 4.0,
      bandwidth,
      [np.log2(mesh.num_devices) / 8.0, np.log10(tables.hbm_bytes) / 12.0],
    ]
  )
  pipeline = None
  if config.pipelines:
    pipeline = build_options(
      problem, menu(problem, config.pipelines), config.pipelines, sizes, slot_order, slot_divisible
    )
  return _device(
    EnvTables(
      value_class=sigs.value_class.astype(np.int32),
      value_divisible=value_divisible,
      op_class=sigs.op_class.astype(np.int32),
      op_divisible=op_divisible,
      slot_order=slot_order.astype(np.int32),
      slot_divisible=slot_divisible.astype(np.int32),
      chunk_class=np.array([c for c, _ in chunks], np.int32),
      axis_sizes=sizes,
      axis_valid=np.arange(x) < num_axes,
      target_classes=target_classes,
      target_rank=target_rank,
      base=base,
      value_rank=_slot_rank(target_rank, sigs.value_class),
      op_rank=_slot_rank(target_rank, sigs.op_class),
      mesh_features=mesh_features.astype(np.float32),
      value_features=_value_features(problem),
      op_features=_op_features(problem, tables),
      target_features=target_features,
      edge_real=np.ones(len(tables.edge_op), bool),
      cover_target=cover[:, 0].astype(np.int32),
      cover_index=cover[:, 1].astype(np.int32),
      cover_is_op=cover[:, 2].astype(bool),
      cover_real=np.ones(len(cover), bool),
      cost=cost,
      pipeline=pipeline,
    )
  )


def _device(tables: EnvTables) -> EnvTables:
  """The tables on the default device, each array in jax's dtype for it (int64 as int32
  without x64). Converted on the host: `jnp.asarray` would compile a conversion for each
  array's shape, a second on an environment's build."""

  def put(array) -> jax.Array:
    host = np.asarray(array)
    return jax.device_put(host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False))

  return jax.tree.map(put, tables)


def _dims(tables: EnvTables):
  for name in DIMS:
    yield name, DIMS[name], getattr(tables, name)
  for field in dataclasses.fields(simulator.CostTables):
    array = getattr(tables.cost, field.name)
    yield f"cost.{field.name}", cost_padding.dims(field.name, np.ndim(array)), array


def sizes(tables: EnvTables) -> dict[str, int]:
  """The size of every named dim of unbatched tables."""
  out: dict[str, int] = {}
  for name, dims, array in _dims(tables):
    chex.assert_rank(array, len(dims))
    for dim, n in zip(dims, np.shape(array)):
      if out.setdefault(dim, n) != n:
        raise ValueError(f"{name}: dim {dim} is {n}, elsewhere {out[dim]}.")
  return out


def bucket_sizes(size: Mapping[str, int]) -> dict[str, int]:
  """`size` with the dims that vary between problems (`BUCKETED`) padded to their buckets."""
  return buckets.bucket_sizes(size, BUCKETED)


def _remap_slots(tables: EnvTables, size: Mapping[str, int]) -> np.ndarray:
  """`slot_order`'s flat indices into `[value dims | op factors]` for the padded layout
  (the value block grows to Uv * Rv and every row to Rv or Rf entries), [Q, W]."""
  (uv, rv), rf = np.shape(tables.value_class), np.shape(tables.op_class)[1]
  order = np.asarray(tables.slot_order)
  op = order - uv * rv
  return np.where(
    op >= 0,
    size["Uv"] * size["Rv"] + op // rf * size["Rf"] + op % rf,
    order // rv * size["Rv"] + order % rv,
  ).astype(order.dtype)


def pad(tables: EnvTables, size: Mapping[str, int]) -> EnvTables:
  """Pads every array to `size` (at least its own) with inert values."""
  return _device(_pad_on_host(tables, size))


def _pad_on_host(tables: EnvTables, size: Mapping[str, int]) -> EnvTables:
  """`pad`, as numpy arrays."""

  def padded(name: str, dims: tuple[str, ...], array) -> np.ndarray:
    return cost_padding.padded_array(name, dims, array, size, _FILL.get(name, 0))

  fields = {name: padded(name, dims, getattr(tables, name)) for name, dims in DIMS.items()}
  fields["slot_order"] = padded("slot_order", DIMS["slot_order"], _remap_slots(tables, size))
  fields["cost"] = cost_padding.pad_tables(tables.cost, size)
  options = tables.pipeline
  if options is not None:
    size = {**size, "P": options.valid.shape[0]}
    fields["pipeline"] = options.replace(
      slot_divisible=padded("slot_divisible", ("P", "Q", "W"), options.slot_divisible),
      value_stage=padded("value_stage", ("P", "Uv"), options.value_stage),
      op_stage=padded("op_stage", ("P", "Uo"), options.op_stage),
    )
  return EnvTables(**fields)


def stack(tables: Sequence[EnvTables]) -> EnvTables:
  """Pads tables to common bucketed sizes and stacks them on a new leading axis."""
  common: dict[str, int] = {}
  for t in tables:
    for dim, n in bucket_sizes(sizes(t)).items():
      common[dim] = max(common.get(dim, 0), n)
  padded = [_pad_on_host(t, common) for t in tables]
  if padded[0].pipeline is not None:
    padded = [t.replace(pipeline=o) for t, o in zip(padded, alike([t.pipeline for t in padded]))]
  return _device(
    jax.tree.map(lambda *xs: np.stack(xs), *padded)
  )  # Stacked on the host: no compile per array.
