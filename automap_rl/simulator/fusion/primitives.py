"""Which primitives XLA's CPU compiler fuses, clones and keeps inside fusions: the sets the
fusion model (`simulator.fusion`) reads."""

from __future__ import annotations

from automap_rl.ir.flops import REDUCTIONS, TRANSCENDENTAL

CHEAP_ELEMENTWISE = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "mul",
    "neg",
    "max",
    "min",
    "select_n",
    "clamp",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "convert_element_type",
    "integer_pow",
    "square",
    "copy",
    "copy_p",
    "real",
    "imag",
    "nextafter",
    "sin",
    "cos",
    "tan",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "population_count",
    "clz",
    "bitcast_convert_type",  # Elementwise between types of one bit width, as JAX emits it.
    "reduce_precision",
    "one_minus_square",  # jax 0.11's `1 - x**2`, lowered as `(1 + x) * (1 - x)`.
  }
)
DIVISIONS = frozenset(
  {"div", "rem"}
)  # Cheap by a literal (a multiply by its inverse), else expensive.
EXPENSIVE_ELEMENTWISE = TRANSCENDENTAL | {"logistic"}
NO_OPS = frozenset(
  {"device_put", "sharding_constraint", "stop_gradient", "name"}
)  # Gone by fusion time.
MOVEMENT = (
  frozenset(
    {
      "broadcast_in_dim",
      "reshape",
      "squeeze",
      "expand_dims",
      "transpose",
      "slice",
      "dynamic_slice",
      "dynamic_update_slice",
      "concatenate",
      "pad",
      "iota",
      "rev",
      "split",
      "gather",
    }
  )
  | NO_OPS
)
PERMUTING = (
  frozenset(
    {
      "reshape",
      "squeeze",
      "expand_dims",
      "transpose",
      "slice",
      "concatenate",
      "rev",
      "split",
      "gather",
    }
  )
  | NO_OPS
)  # Movement that reads each operand element once.
SLICES = frozenset({"slice", "dynamic_slice"})  # Movement that reads only the elements it keeps.
FUSED_REDUCTIONS = frozenset(REDUCTIONS)
LIBRARY_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
LIBRARY_PRODUCERS = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "pow",
    "integer_pow",
    "square",
    "abs",
    "ceil",
    "floor",
    "round",
    "sign",
    "neg",
    "convert_element_type",
    "erf",
    "exp",
    "expm1",
    "log",
    "log1p",
    "logistic",
    "rsqrt",
    "sqrt",
    "tanh",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "one_minus_square",
  }
)
LIBRARY_MIN_ELEMENTS = 4096
MAX_FUSED_REDUCTIONS = 5
# Random bits: counter-based threefry, elementwise integer ops on an iota of counters that
# a consumer's fusion computes in place (never worth duplicating into several).
GENERATORS = frozenset({"random_bits"})
ELEMENTWISE = CHEAP_ELEMENTWISE | DIVISIONS | EXPENSIVE_ELEMENTWISE | GENERATORS
LOOP_FUSIBLE = ELEMENTWISE | MOVEMENT | FUSED_REDUCTIONS  # XLA's `CanBeLoopFused`.
# XLA:CPU's bounds on a fused concatenate (cpu_instruction_fusion.cc): at most this many
# operands, and along the minor dim, rows under 64 bytes or under 2 KiB in all.
MAX_FUSED_CONCATENATE_OPERANDS = 8
MIN_KERNEL_CONCATENATE_ROW_BYTES = 64
MIN_KERNEL_CONCATENATE_BYTES = 2048

# Producers whose results the peak-memory model keeps inside their readers' fusions (never
# materialised): the common elementwise ops and the movement that reads one operand at
# static offsets; a subset of `LOOP_FUSIBLE` without the rarer transcendentals, the bit
# operations, the no-ops but `stop_gradient`, and concatenate, pad, rev, split, gathers
# and dynamic slices.
KEPT_IN_FUSION = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "rem",
    "max",
    "min",
    "neg",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "sqrt",
    "rsqrt",
    "cbrt",
    "pow",
    "integer_pow",
    "square",
    "erf",
    "erfc",
    "erf_inv",
    "select_n",
    "clamp",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "is_finite",
    "convert_element_type",
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "iota",
    "slice",
    "stop_gradient",
    "name",
    "copy",
    "copy_p",
    "nextafter",
    "atan2",
    "one_minus_square",
  }
)
# Readers that fuse a `KEPT_IN_FUSION` producer: those ops and the reductions but `reduce_xor`.
READS_INSIDE_FUSION = KEPT_IN_FUSION | (FUSED_REDUCTIONS - {"reduce_xor"})
# Producers cheap enough that the peak-memory model has each reader recompute them.
RECOMPUTED_PER_READER = frozenset(
  {"broadcast_in_dim", "iota", "reshape", "convert_element_type", "squeeze", "expand_dims"}
)
