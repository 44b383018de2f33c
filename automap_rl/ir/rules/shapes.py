"""Rules of ops that change shapes or move data: broadcasts, reshapes, transposes, slices,
pads, windows, concatenation, stacking, loop slices and stacks, and the ops that treat some
dims whole (sorts, scans along an axis, matrix decompositions)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from automap_rl.ir.program import FactorKind, Rule
from automap_rl.ir.rules.factors import (
  PASS,
  PERMUTE,
  REPLICATE,
  Factors,
  RuleBuilder,
  Shape,
  elementwise,
)


def broadcast_in_dim(operand_shapes, result_shapes, params) -> Rule:
  """Mapped dims of equal size pass through; new and size-1-expanded dims are result-only."""
  (operand,), (result,) = operand_shapes[:1], result_shapes
  f = Factors(operand_shapes, result_shapes)
  mapped = dict(zip(params["broadcast_dimensions"], range(len(operand))))
  for dim, size in enumerate(result):
    src = mapped.get(dim)
    if src is not None and operand[src] == size:
      f.add(size, PASS, [(0, src)], [(0, dim)])
    else:
      f.add(size, PASS, results=[(0, dim)])
  return f.build()


def reshape(operand_shapes, result_shapes, params) -> Rule:
  """Refines operand and result dims into common factors, major to minor.

  `[B, S, H*D] -> [B, S, H, D]` maps the merged dim to the factors (H, D). Where the two
  shapes stop having a common refinement (`[6, 4] -> [4, 6]` after the leading 2), the
  remaining parts of the dims need replication.
  """
  (operand,), (result,) = operand_shapes[:1], result_shapes
  f = Factors(operand_shapes, result_shapes)
  rest_a, rest_b = list(operand), list(result)
  i = j = 0
  while i < len(operand) and j < len(result):
    if rest_a[i] == 1:
      i += 1
    elif rest_b[j] == 1:
      j += 1
    else:
      g = math.gcd(rest_a[i], rest_b[j])
      if g == 1:
        break
      f.add(g, PASS, [(0, i)], [(0, j)])
      rest_a[i] //= g
      rest_b[j] //= g
  for dim in range(i, len(operand)):
    f.add(rest_a[dim], REPLICATE, operands=[(0, dim)])
  for dim in range(j, len(result)):
    f.add(rest_b[dim], REPLICATE, results=[(0, dim)])
  return f.build()


def transpose(operand_shapes, result_shapes, params) -> Rule:
  f = Factors(operand_shapes, result_shapes)
  for dim, src in enumerate(params["permutation"]):
    f.add(result_shapes[0][dim], PASS, [(0, src)], [(0, dim)])
  return f.build()


def squeeze(operand_shapes, result_shapes, params) -> Rule:
  f = Factors(operand_shapes, result_shapes)
  dropped = {d % len(operand_shapes[0]) for d in params["dimensions"]}
  kept = [d for d in range(len(operand_shapes[0])) if d not in dropped]
  for dim, src in enumerate(kept):
    f.add(result_shapes[0][dim], PASS, [(0, src)], [(0, dim)])
  return f.build()


def per_dim(
  special: Callable[
    [Sequence[Shape], Sequence[Shape], Mapping[str, Any]], Mapping[int, FactorKind]
  ],
) -> RuleBuilder:
  """Same-rank ops: dims listed by `special` get their own factors of the given kind; the
  rest pass through all operands and results of that rank."""

  def build(operand_shapes, result_shapes, params) -> Rule:
    rank = len(result_shapes[0])
    kinds = special(operand_shapes, result_shapes, params)
    f = Factors(operand_shapes, result_shapes)
    for dim in range(rank):
      operands = [(i, dim) for i, s in enumerate(operand_shapes) if len(s) == rank]
      results = [(i, dim) for i, s in enumerate(result_shapes) if len(s) == rank]
      kind = kinds.get(dim)
      if kind is None:
        f.add(result_shapes[0][dim], PASS, operands, results)
      elif kind == PERMUTE:
        f.add(result_shapes[0][dim], PERMUTE, operands, results)
      else:
        for index, dim_ in operands:
          f.add(operand_shapes[index][dim_], kind, operands=[(index, dim_)])
        for index, dim_ in results:
          f.add(result_shapes[index][dim_], kind, results=[(index, dim_)])
    return f.build()

  return build


def changed_dims(operand_shapes, result_shapes, params):
  """Dims whose size differs between the first operand and the result."""
  return {
    d: REPLICATE for d, (a, b) in enumerate(zip(operand_shapes[0], result_shapes[0])) if a != b
  }


def axis_dims(name: str):
  return lambda operand_shapes, result_shapes, params: {
    params[name] % len(result_shapes[0]): REPLICATE
  }


def last_dim(operand_shapes, result_shapes, params):
  return {len(result_shapes[0]) - 1: REPLICATE}


def padded_dims(operand_shapes, result_shapes, params):
  return {d: REPLICATE for d, cfg in enumerate(params["padding_config"]) if any(cfg)}


def windowed_dims(operand_shapes, result_shapes, params):
  """Window dims of `reduce_window*` and `select_and_*`: any window, stride or padding."""
  dims = params["window_dimensions"]
  strides = params.get("window_strides", (1,) * len(dims))
  padding = params.get("padding", ((0, 0),) * len(dims))
  dilations = [params.get(k) or (1,) * len(dims) for k in ("base_dilation", "window_dilation")]
  return {
    d: REPLICATE
    for d in range(len(dims))
    if dims[d] != 1
    or strides[d] != 1
    or any(padding[d])
    or dilations[0][d] != 1
    or dilations[1][d] != 1
  }


def dynamic_update_dims(operand_shapes, result_shapes, params):
  operand, update = operand_shapes[0], operand_shapes[1]
  return {d: REPLICATE for d in range(len(operand)) if operand[d] != update[d]}


def rev_dims(operand_shapes, result_shapes, params):
  return {d: PERMUTE for d in params["dimensions"]}


def scan_slice(operand_shapes, result_shapes, params=None) -> Rule:
  """One iteration's slice of a stacked scan input, `[L, ...] -> [...]`: the stacked dim
  needs replication, the others pass through."""
  f = Factors(operand_shapes, result_shapes)
  f.add(operand_shapes[0][0], REPLICATE, [(0, 0)])
  for dim, size in enumerate(result_shapes[0]):
    f.add(size, PASS, [(0, dim + 1)], [(0, dim)])
  return f.build()


def scan_stack(operand_shapes, result_shapes, params=None) -> Rule:
  """One iteration's output stacked into a scan result, `[...] -> [L, ...]`."""
  rank = len(operand_shapes[0])
  return broadcast_in_dim(
    operand_shapes, result_shapes, {"broadcast_dimensions": tuple(range(1, rank + 1))}
  )


def concatenate(operand_shapes, result_shapes, params) -> Rule:
  """The concatenated dim needs replication; the others pass through every operand."""
  return per_dim(lambda o, r, p: {p["dimension"]: REPLICATE})(operand_shapes, result_shapes, params)


def split(operand_shapes, result_shapes, params) -> Rule:
  return per_dim(lambda o, r, p: {p["axis"] % len(o[0]): REPLICATE})(
    operand_shapes, result_shapes, params
  )


def iota(operand_shapes, result_shapes, params) -> Rule:
  f = Factors(operand_shapes, result_shapes)
  f.own(PASS, (), result_shapes)
  return f.build()


def trailing_extra(operand_shapes, result_shapes, params) -> Rule:
  """Leading dims shared by the first operand and result pass through; extra trailing dims
  of either are their own (`random_bits`, `random_split`, `random_wrap/unwrap`,
  `bitcast_convert_type` across widths)."""
  operand, result = operand_shapes[0], result_shapes[0]
  f = Factors(operand_shapes, result_shapes)
  common = 0
  while common < min(len(operand), len(result)) and operand[common] == result[common]:
    f.add(operand[common], PASS, [(0, common)], [(0, common)])
    common += 1
  f.own(
    PASS,
    operand_shapes[:1],
    result_shapes,
    {0: range(common, len(operand))},
    {0: range(common, len(result))},
  )
  return f.build()


def bitcast_convert_type(operand_shapes, result_shapes, params) -> Rule:
  if len(operand_shapes[0]) == len(result_shapes[0]):
    return elementwise(operand_shapes, result_shapes, params)
  return trailing_extra(operand_shapes, result_shapes, params)


def stack(operand_shapes, result_shapes, params) -> Rule:
  """`stack[axis]`: every operand's dims pass through to the result's other dims; the new
  dim is the result's own (a shard of it is a local choice of whole operands, as a
  `broadcast_in_dim`'s new dim is)."""
  (out,) = result_shapes
  axis = params["axis"] % len(out)
  f = Factors(operand_shapes, result_shapes)
  for dim, size in enumerate(out):
    if dim == axis:
      f.add(size, PASS, results=[(0, dim)])
    else:
      src = dim - (dim > axis)
      f.add(size, PASS, [(i, src) for i in range(len(operand_shapes))], [(0, dim)])
  return f.build()


def unstack(operand_shapes, result_shapes, params) -> Rule:
  """`unstack[axis]`: the unstacked dim needs replication (every result is one slice of it),
  the others pass through the operand and every result."""
  (operand,) = operand_shapes
  axis = params["axis"] % len(operand)
  f = Factors(operand_shapes, result_shapes)
  f.add(operand[axis], REPLICATE, [(0, axis)])
  for dim, size in enumerate(operand):
    if dim != axis:
      out = dim - (dim > axis)
      f.add(size, PASS, [(0, dim)], [(i, out) for i in range(len(result_shapes))])
  return f.build()


def tile(operand_shapes, result_shapes, params) -> Rule:
  """`tile[reps]`: result dim d is `reps[d]` copies of operand dim d, factors `(reps, size)`
  major to minor, as `broadcast_in_dim` to `[reps, size]` and a merging `reshape` give it."""
  (operand,) = operand_shapes
  f = Factors(operand_shapes, result_shapes)
  for dim, (size, rep) in enumerate(zip(operand, params["reps"])):
    f.add(rep, PASS, results=[(0, dim)])
    f.add(size, PASS, [(0, dim)], [(0, dim)])
  return f.build()


def matrix_dims(operand_shapes, result_shapes, params):
  """Linear algebra on the trailing two dims (`cholesky`, `triangular_solve`, ...): they need
  replication, leading batch dims pass through."""
  rank = len(result_shapes[0])
  return {d: REPLICATE for d in range(max(rank - 2, 0), rank)}


def approx_top_k_dims(operand_shapes, result_shapes, params):
  return {params["reduction_dimension"] % len(operand_shapes[0]): REPLICATE}


def fft(operand_shapes, result_shapes, params) -> Rule:
  """`fft`: the transformed (trailing `len(fft_lengths)`) dims need replication, the
  leading batch dims pass through."""
  rank, transformed = len(result_shapes[0]), len(params["fft_lengths"])
  return per_dim(lambda o, r, p: {d: REPLICATE for d in range(rank - transformed, rank)})(
    operand_shapes, result_shapes, params
  )
