"""Flops of one primitive application, in the convention of XLA's `HloCostAnalysis`.

The simulator's compute model and the validation against `compiled.cost_analysis()`
both use these counts, so they follow what XLA reports for the same computation:

* contractions: 2 per multiply-add. `dot_general` is `2 * out.size * contracted size`;
  `conv_general_dilated` counts only the kernel taps that land on a real input element
  (not on padding nor on the holes of an lhs dilation), per output position, exactly as
  `HloCostAnalysis::HandleConvolution` does:
  `2 * batch / batch_groups * in_features / feature_groups * out_features * prod_d(valid
  (output, tap) pairs of spatial dim d)`.
* elementwise arithmetic, comparisons, selects and converts: one per result element.
* transcendentals (`exp`, `log`, `tanh`, `rsqrt`, `sqrt`, `pow`, `erf`, ...): no flops
  (XLA counts them apart, as `transcendentals`); `logistic` expands to 3 flops, and so
  does `one_minus_square(x) = 1 - x**2` (jax 0.11's tanh derivative), lowered as
  `(1 + x) * (1 - x)`.
* `integer_pow(x, n)`: the multiplies of square-and-multiply, plus a divide when n < 0.
* reductions: `in.size - out.size` applications of the reducer (9 for arg-reductions,
  whose variadic reducer compares and selects); windowed reductions `window - 1` per
  result element.
* data movement (broadcast, reshape, transpose, slices, gathers, concatenate, pad, copy,
  iota) and the IR's own ops: none.

How often XLA's compiled module computes each op once it has fused them is
`automap_rl.simulator.fusion.fusion_copies`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

Shape = Sequence[int]

ZERO_FLOP = frozenset(
  {
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "concatenate",
    "pad",
    "copy",
    "copy_p",
    "iota",
    "rev",
    "select_and_gather_add",
    "stop_gradient",
    "name",
    "device_put",
    "sharding_constraint",
    "optimization_barrier",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "random_key_data",
    "bitcast_convert_type",
    "scan_slice",
    "scan_stack",
    "scan_carry",
    "cond_merge",
    "split",
    "squeeze_p",
    "real",
    "imag",
    "empty",
    "zeros_like",
    "broadcast",
    "stack",
    "unstack",
    "tile",
  }
)
TRANSCENDENTAL = frozenset(
  {
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "atan2",
    "sqrt",
    "rsqrt",
    "cbrt",
    "pow",
    "erf",
    "erfc",
    "erf_inv",
    "lgamma",
    "digamma",
    "igamma",
    "igammac",
    "bessel_i0e",
    "bessel_i1e",
  }
)
# Flops per result element: threefry2x32's 20 rounds (add, rotate, xor on each pair of
# words), key injections and counters, as XLA's cost analysis counts JAX's lowering of
# `random_bits` (45 a 32-bit word).
ELEMENTWISE_FLOPS = {"logistic": 3.0, "one_minus_square": 3.0, "random_bits": 45.0}
REDUCTIONS = {
  "reduce_sum": 1.0,
  "reduce_max": 1.0,
  "reduce_min": 1.0,
  "reduce_prod": 1.0,
  "reduce_and": 1.0,
  "reduce_or": 1.0,
  "reduce_xor": 1.0,
  "argmax": 9.0,
  "argmin": 9.0,
}


def _size(shape: Shape) -> int:
  return math.prod(shape)


def _integer_pow_flops(y: int) -> int:
  n = abs(int(y))
  mults = max(n.bit_length() - 1 + bin(n).count("1") - 1, 0) if n else 0
  return mults + (1 if y < 0 else 0)


def _valid_pairs(
  in_size: int, kernel: int, out_size: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int
) -> int:
  """(output position, kernel tap) pairs of one spatial dim whose tap reads a real input
  element of the lhs-dilated, padded input."""
  dilated = (in_size - 1) * lhs_dil + 1 if in_size else 0
  count = 0
  for k in range(kernel):
    # Output o reads dilated input position o * stride + k * rhs_dil - pad_lo.
    offset = k * rhs_dil - pad_lo
    for o in range(out_size):
      pos = o * stride + offset
      if 0 <= pos < dilated and pos % lhs_dil == 0:
        count += 1
  return count


def conv_flops(lhs: Shape, rhs: Shape, params: Mapping[str, Any]) -> float:
  """Flops of `conv_general_dilated` as XLA counts them (see the module docstring)."""
  dn = params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  spatial = len(lhs_spec) - 2
  strides = params.get("window_strides") or (1,) * spatial
  padding = params.get("padding") or ((0, 0),) * spatial
  lhs_dil = params.get("lhs_dilation") or (1,) * spatial
  rhs_dil = params.get("rhs_dilation") or (1,) * spatial
  feature_groups = int(params.get("feature_group_count", 1) or 1)
  batch_groups = int(params.get("batch_group_count", 1) or 1)
  batch, in_features, out_features = lhs[lhs_spec[0]], lhs[lhs_spec[1]], rhs[rhs_spec[0]]
  pairs = 1
  for d in range(spatial):
    in_size, kernel = lhs[lhs_spec[2 + d]], rhs[rhs_spec[2 + d]]
    dilated = (in_size - 1) * lhs_dil[d] + 1 if in_size else 0
    kernel_span = (kernel - 1) * rhs_dil[d] + 1 if kernel else 0
    padded = dilated + padding[d][0] + padding[d][1]
    out_size = max((padded - kernel_span) // strides[d] + 1, 0)
    pairs *= _valid_pairs(
      in_size, kernel, out_size, strides[d], padding[d][0], lhs_dil[d], rhs_dil[d]
    )
  del out_spec
  return 2.0 * (batch // batch_groups) * (in_features // feature_groups) * out_features * pairs


def primitive_flops(
  primitive: str,
  operand_shapes: Sequence[Shape],
  result_shapes: Sequence[Shape],
  params: Mapping[str, Any],
) -> float:
  """Flops of one call of `primitive` on operands and results of these shapes."""
  out = max((_size(s) for s in result_shapes), default=0)
  if primitive == "dot_general":
    (lhs_contract, _), _ = params["dimension_numbers"]
    contracted = math.prod(operand_shapes[0][d] for d in lhs_contract)
    return 2.0 * _size(result_shapes[0]) * contracted
  if primitive == "conv_general_dilated":
    return conv_flops(operand_shapes[0], operand_shapes[1], params)
  if primitive in ZERO_FLOP or primitive in TRANSCENDENTAL:
    return 0.0
  if primitive in REDUCTIONS:
    return REDUCTIONS[primitive] * max(_size(operand_shapes[0]) - _size(result_shapes[0]), 0)
  if primitive in ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window"):
    window = params.get("window_dimensions") or ()
    return float(out * max(math.prod(window) - 1, 0))
  if primitive == "integer_pow":
    return float(_integer_pow_flops(params.get("y", 2)) * out)
  if primitive in ("scatter_add", "scatter-add", "scatter_sub", "scatter_mul"):
    return float(_size(operand_shapes[-1]))  # One per update element.
  if primitive in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    return float(out)
  return ELEMENTWISE_FLOPS.get(primitive, 1.0) * out
