"""The program compressed to its unique value and op signatures (the classes and sizes of
their dims or factors), which resolve alike; where partial sums wait for their reduction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from automap_rl.ir import FactorKind, NamedDims, Program


def pad_rows(rows: Sequence[Sequence[int]], width: int, fill: int) -> np.ndarray:
  """Rows of ints as one int32 array [len(rows), width], each padded with `fill`."""
  out = np.full((len(rows), width), fill, np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
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


def pending_partial_sums(program: Program) -> tuple[set[int], dict[int, int], dict[int, int]]:
  """Partial sums that a linear combination of them reduces in one collective, as XLA does.

  `add_any(dot(a, b), dot(c, d))` with both contractions sharded: XLA all-reduces each
  product, and its all-reduce combiner merges the two into one collective over both
  buffers (the backward pass of separate query, key and value projections under Megatron:
  one all-reduce of three activations). A combination whose operands are all single-use
  partial sums of its own shape takes over their reduction: it is counted once, with the
  bytes of every buffer it carries; their producers then reduce nothing.

  Returns:
    The ops whose reduction a combination takes over; for each combination, the reduction
    op whose axes it reduces over (the first operand's); and how many partial sums (one
    buffer each) it reduces.
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
  buffers: dict[int, int] = {}
  for op in program.ops:
    if op.primitive not in LINEAR_COMBINES or len(op.operands) < 2:
      continue
    shape = program.values[op.results[0]].shape
    if all(v in pending and uses[v] == 1 and program.values[v].shape == shape for v in op.operands):
      producers = [pending[v] for v in op.operands]
      deferred.update(producers)
      carried[op.id] = carried.get(producers[0], producers[0])
      buffers[op.id] = sum(buffers.get(p, 1) for p in producers)
      pending[op.results[0]] = op.id
  return deferred, carried, buffers


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
  deferred, carried, buffers = pending_partial_sums(program)
  index: dict = {}
  op_sig = np.zeros(program.num_ops, np.int32)
  shardable = (FactorKind.PASS_THROUGH, FactorKind.REDUCTION)
  for op in program.ops:
    factor_classes = named.op_factor_classes(op.id)
    factors = tuple(
      (int(c) if kind in shardable else -1, size, int(kind))
      for c, size, kind in zip(factor_classes, op.rule.factor_sizes, op.rule.factor_kinds)
    )
    operands = tuple(
      (int(value_sig[v]), dims) for v, dims in zip(op.operands, op.rule.operand_dims)
    )
    results = tuple((int(value_sig[v]), dims) for v, dims in zip(op.results, op.rule.result_dims))
    partial = (
      op.id in deferred,
      int(op_sig[carried[op.id]]) if op.id in carried else -1,
      buffers.get(op.id, 1),
    )
    if partial == (False, -1, 1) and _follows_its_values(
      factors, (*operands, *results), unique_values
    ):
      op_sig[op.id] = -1
      continue
    key = (
      op.primitive in ("dot_general", "conv_general_dilated"),
      factors,
      operands,
      results,
      partial,
    )
    op_sig[op.id] = index.setdefault(key, len(index))
  unique_ops = list(index)
  rv = max([len(k[1]) for k in unique_values] + [1])
  rf = max([len(k[1]) for k in unique_ops] + [1])
  return Signatures(
    value_sig=value_sig,
    value_class=pad_rows([k[0] for k in unique_values], rv, -1),
    value_size=pad_rows([k[1] for k in unique_values], rv, 1),
    value_keys=tuple(unique_values),
    op_sig=op_sig,
    op_class=pad_rows([[f[0] for f in k[1]] for k in unique_ops], rf, -1),
    op_size=pad_rows([[f[1] for f in k[1]] for k in unique_ops], rf, 1),
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
