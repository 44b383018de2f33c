"""The sharding-rule registry: one rule builder per jaxpr primitive.

A builder takes the operand shapes, result shapes and the equation's params and returns a
`Rule` in factor form. `rule_for` looks a primitive up; an unknown primitive gets the
conservative rule (every dimension needs replication) and is reported to the caller, who
warns once per name.

Call-like and control-flow primitives (`jit`, `closed_call`, `checkpoint`,
`custom_jvp_call`, `custom_vjp_call`, `scan`, `while`, `cond`) never reach this registry:
`automap_rl.ir.trace` inlines their bodies.

The builders live by family: `rules.factors` (the factor form, elementwise and the
conservative rule), `rules.contractions` (dots, reductions, convolutions, gathers and
scatters) and `rules.shapes` (shape changes, data movement, per-dim rules); the registry
that names them is here.
"""

from __future__ import annotations

from automap_rl.ir.program import Rule
from automap_rl.ir.rules.contractions import (
  conv_batch_group_factor,
  conv_general_dilated,
  dot_general,
  gather,
  reduce,
  reduction,
  scatter,
)
from automap_rl.ir.rules.factors import (
  PASS,
  PERMUTE,
  REDUCTION,
  REPLICATE,
  RuleBuilder,
  Shape,
  conservative,
  elementwise,
  pairwise,
)
from automap_rl.ir.rules.shapes import (
  approx_top_k_dims,
  axis_dims,
  bitcast_convert_type,
  broadcast_in_dim,
  changed_dims,
  concatenate,
  dynamic_update_dims,
  fft,
  iota,
  last_dim,
  matrix_dims,
  padded_dims,
  per_dim,
  reshape,
  rev_dims,
  scan_slice,
  scan_stack,
  split,
  squeeze,
  stack,
  tile,
  trailing_extra,
  transpose,
  unstack,
  windowed_dims,
)

__all__ = [
  "ELEMENTWISE",
  "PASS",
  "PERMUTE",
  "REDUCTION",
  "REGISTRY",
  "REPLICATE",
  "RuleBuilder",
  "Shape",
  "approx_top_k_dims",
  "axis_dims",
  "bitcast_convert_type",
  "broadcast_in_dim",
  "changed_dims",
  "concatenate",
  "conservative",
  "conv_batch_group_factor",
  "conv_general_dilated",
  "dot_general",
  "dynamic_update_dims",
  "elementwise",
  "fft",
  "gather",
  "iota",
  "last_dim",
  "matrix_dims",
  "padded_dims",
  "pairwise",
  "per_dim",
  "reduce",
  "reduction",
  "reshape",
  "rev_dims",
  "rule_for",
  "scan_slice",
  "scan_stack",
  "scatter",
  "split",
  "squeeze",
  "stack",
  "tile",
  "trailing_extra",
  "transpose",
  "unstack",
  "windowed_dims",
]

ELEMENTWISE = (
  # Unary.
  "neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan "
  "asin acos atan sinh cosh asinh acosh atanh lgamma digamma erf erfc erf_inv abs sqrt rsqrt "
  "cbrt not integer_pow square one_minus_square population_count clz real imag conj "
  "reduce_precision "
  "convert_element_type copy copy_p stop_gradient name sharding_constraint "
  # Binary, compare, select.
  "add sub mul div rem pow max min atan2 nextafter and or xor add_any shift_left "
  "shift_right_logical shift_right_arithmetic complex igamma igammac polygamma "
  "random_gamma_grad eq ne lt le gt ge eq_to lt_to le_to select_n clamp mulhi zeta igamma_grad_a "
  "regularized_incomplete_beta bessel_i0e bessel_i1e "
  # PRNG.
  "random_fold_in random_seed threefry2x32 random_clone"
).split()

# `scan_carry` and `cond_merge` are the IR's own ops for loop carries and branch results.
REGISTRY: dict[str, RuleBuilder] = {
  name: elementwise for name in (*ELEMENTWISE, "scan_carry", "cond_merge")
}
REGISTRY.update(
  {
    "scan_slice": scan_slice,
    "scan_stack": scan_stack,
    "device_put": pairwise,
    "optimization_barrier": pairwise,
    "dot_general": dot_general,
    "reduce_sum": reduction(REDUCTION),
    "reduce_max": reduction(REDUCTION),
    "reduce_min": reduction(REDUCTION),
    "reduce_prod": reduction(REDUCTION),
    "reduce_and": reduction(REDUCTION),
    "reduce_or": reduction(REDUCTION),
    "reduce_xor": reduction(REDUCTION),
    "reduce": reduce,
    "argmax": reduction(REPLICATE),
    "argmin": reduction(REPLICATE),
    "broadcast_in_dim": broadcast_in_dim,
    "reshape": reshape,
    "squeeze": squeeze,
    "transpose": transpose,
    "rev": per_dim(rev_dims),
    "concatenate": concatenate,
    "stack": stack,
    "unstack": unstack,
    "tile": tile,
    "split": split,
    "pad": per_dim(padded_dims),
    "slice": per_dim(changed_dims),
    "dynamic_slice": per_dim(changed_dims),
    "dynamic_update_slice": per_dim(dynamic_update_dims),
    "gather": gather,
    "scatter": scatter(REPLICATE),
    "scatter-add": scatter(REDUCTION),
    "scatter_add": scatter(REDUCTION),
    "scatter-mul": scatter(REPLICATE),
    "scatter_mul": scatter(REPLICATE),
    "scatter-sub": scatter(REDUCTION),
    "scatter_sub": scatter(REDUCTION),
    "scatter-min": scatter(REPLICATE),
    "scatter_min": scatter(REPLICATE),
    "scatter-max": scatter(REPLICATE),
    "scatter_max": scatter(REPLICATE),
    "iota": iota,
    "conv_general_dilated": conv_general_dilated,
    "reduce_window_sum": per_dim(windowed_dims),
    "reduce_window_max": per_dim(windowed_dims),
    "reduce_window_min": per_dim(windowed_dims),
    "reduce_window": per_dim(windowed_dims),
    "select_and_scatter_add": per_dim(windowed_dims),
    "select_and_gather_add": per_dim(windowed_dims),
    "cumsum": per_dim(axis_dims("axis")),
    "cumprod": per_dim(axis_dims("axis")),
    "cummax": per_dim(axis_dims("axis")),
    "cummin": per_dim(axis_dims("axis")),
    "cumlogsumexp": per_dim(axis_dims("axis")),
    "sort": per_dim(axis_dims("dimension")),
    "top_k": per_dim(last_dim),
    "approx_top_k": per_dim(approx_top_k_dims),
    "fft": fft,
    "cholesky": per_dim(matrix_dims),
    "triangular_solve": per_dim(matrix_dims),
    "random_bits": trailing_extra,
    "random_split": trailing_extra,
    "random_wrap": trailing_extra,
    "random_unwrap": trailing_extra,
    "bitcast_convert_type": bitcast_convert_type,
  }
)


def rule_for(primitive: str, operand_shapes, result_shapes, params) -> tuple[Rule, bool]:
  """Returns the op's rule and whether the primitive is known to the registry."""
  builder = REGISTRY.get(primitive)
  if builder is None:
    return conservative(operand_shapes, result_shapes), False
  return builder(operand_shapes, result_shapes, params), True
