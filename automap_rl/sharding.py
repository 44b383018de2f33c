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

from automap_rl.ir import FactorKind, NamedDims, Program
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


def pending_partial_sums(program: Program) -> tuple[set[int], dict[int, int]]:
  """Partial sums that stay pending through linear combinations, as XLA keeps them.

  `add_any(dot(a, b), dot(c, d))` with both contractions sharded all-reduces once, after
  the add. A combination whose operands are all single-use pending partial sums of its
  own shape takes over their reduction; their producers then reduce nothing.

  Returns:
    The ops whose reduction is deferred, and for each combination the reduction op whose
    axes it reduces over (the first operand's).
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
  for op in program.ops:
    if op.primitive not in LINEAR_COMBINES or len(op.operands) < 2:
      continue
    shape = program.values[op.results[0]].shape
    if all(v in pending and uses[v] == 1 and program.values[v].shape == shape for v in op.operands):
      producers = [pending[v] for v in op.operands]
      deferred.update(producers)
      carried[op.id] = carried.get(producers[0], producers[0])
      pending[op.results[0]] = op.id
  return deferred, carried


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
  deferred, carried = pending_partial_sums(program)
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
    partial = (op.id in deferred, int(op_sig[carried[op.id]]) if op.id in carried else -1)
    if partial == (False, -1) and _follows_its_values(factors, (*operands, *results), unique_values):
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


def assign_axes(classes: jax.Array, divisible: jax.Array, dec_class: jax.Array,
                dec_axis: jax.Array) -> jax.Array:
  """Applies decisions in order to the dims (factors) of many owners.

  Args:
    classes: class of each slot, -1 for none, int32 [owners, slots].
    divisible: `divisibility_bits` of each slot's size, int32 [owners, slots].
    dec_class: class of each decision, -1 for padding, int32 [K].
    dec_axis: mesh axis of each decision, int32 [K].

  Returns:
    Bit masks of the axes each slot is sharded on, int8 [owners, slots]. Within an owner an
    axis is used at most once (the first matching slot wins) and a slot takes an axis only
    if its size divides by the product of its axes.
  """
  chex.assert_rank([classes, divisible], 2)
  chex.assert_equal_shape([dec_class, dec_axis])
  slot_index = jnp.arange(classes.shape[1])[None, :]

  def step(carry, decision):
    mask, used = carry
    cls, axis = decision
    bit = jnp.left_shift(1, jnp.maximum(axis, 0)).astype(jnp.int8)
    fits = jnp.right_shift(divisible, (mask | bit).astype(divisible.dtype)) & 1
    cand = (classes == cls) & (cls >= 0) & ((used & bit) == 0)[:, None] & (fits == 1)
    first = cand & (slot_index == jnp.argmax(cand, axis=1)[:, None])
    mask = mask | jnp.where(first, bit, 0)
    used = used | jnp.where(first.any(axis=1), bit, 0)
    return (mask, used), None

  init = (jnp.zeros(classes.shape, jnp.int8), jnp.zeros(classes.shape[0], jnp.int8))
  (mask, _), _ = jax.lax.scan(step, init, (dec_class, dec_axis))
  return mask


@chex.dataclass(frozen=True)
class Resolution:
  """Axis bit masks per value-signature dim [Uv, Rv] and per op-signature factor [Uo, Rf]."""

  value_mask: jax.Array
  op_mask: jax.Array


def resolve(sigs: Signatures, mesh: Mesh, dec_class: jax.Array, dec_axis: jax.Array) -> Resolution:
  """Resolves encoded decisions (see `encode`) on the compressed program. Pure; jittable."""
  value_mask = assign_axes(sigs.value_class, divisibility_bits(sigs.value_size, mesh.axis_sizes), dec_class, dec_axis)
  op_mask = assign_axes(sigs.op_class, divisibility_bits(sigs.op_size, mesh.axis_sizes), dec_class, dec_axis)
  return Resolution(value_mask=value_mask, op_mask=op_mask)


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
