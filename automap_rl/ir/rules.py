"""The sharding-rule registry: one rule builder per jaxpr primitive.

A builder takes the operand shapes, result shapes and the equation's params and returns a
`Rule` in factor form. `rule_for` looks a primitive up; an unknown primitive gets the
conservative rule (every dimension needs replication) and is reported to the caller, who
warns once per name.

Call-like and control-flow primitives (`jit`, `closed_call`, `checkpoint`,
`custom_jvp_call`, `custom_vjp_call`, `scan`, `while`, `cond`) never reach this registry:
`automap_rl.ir.trace` inlines their bodies.

One file because it is one table: a builder per primitive family (elementwise, reductions,
dots, convolutions, windows, gathers and scatters, shape changes), short functions that
read best side by side with the registry that names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from automap_rl.ir.program import FactorKind, Rule

Shape = tuple[int, ...]
RuleBuilder = Callable[[Sequence[Shape], Sequence[Shape], Mapping[str, Any]], Rule]

PASS = FactorKind.PASS_THROUGH
REDUCTION = FactorKind.REDUCTION
REPLICATE = FactorKind.NEED_REPLICATION
PERMUTE = FactorKind.PERMUTATION


class _Factors:
  """Accumulates factors and the dimension-to-factor maps of one rule."""

  def __init__(self, operand_shapes: Sequence[Shape], result_shapes: Sequence[Shape]):
    self.sizes: list[int] = []
    self.kinds: list[FactorKind] = []
    self.operands = [[()] * len(s) for s in operand_shapes]
    self.results = [[()] * len(s) for s in result_shapes]

  def add(self, size: int, kind: FactorKind = PASS, operands=(), results=()) -> None:
    """Adds one factor mapped to whole dims: `operands`/`results` are (index, dim) pairs.

    Size-1 factors are dropped: they never shard.
    """
    if size <= 1:
      return
    factor = len(self.sizes)
    self.sizes.append(size)
    self.kinds.append(kind)
    for index, dim in operands:
      self.operands[index][dim] = self.operands[index][dim] + (factor,)
    for index, dim in results:
      self.results[index][dim] = self.results[index][dim] + (factor,)

  def own(
    self, kind: FactorKind, operand_shapes, result_shapes, operand_dims=None, result_dims=None
  ):
    """Gives each listed dimension a factor of its own (all dims when None)."""
    for index, shape in enumerate(operand_shapes):
      for dim in range(len(shape)) if operand_dims is None else operand_dims.get(index, ()):
        self.add(shape[dim], kind, operands=[(index, dim)])
    for index, shape in enumerate(result_shapes):
      for dim in range(len(shape)) if result_dims is None else result_dims.get(index, ()):
        self.add(shape[dim], kind, results=[(index, dim)])

  def build(self) -> Rule:
    return Rule(
      factor_sizes=tuple(self.sizes),
      factor_kinds=tuple(self.kinds),
      operand_dims=tuple(tuple(d) for d in self.operands),
      result_dims=tuple(tuple(d) for d in self.results),
    )


def conservative(operand_shapes, result_shapes, params=None) -> Rule:
  """Every dimension of every operand and result needs replication."""
  f = _Factors(operand_shapes, result_shapes)
  f.own(REPLICATE, operand_shapes, result_shapes)
  return f.build()


def elementwise(operand_shapes, result_shapes, params=None) -> Rule:
  """Results and same-rank operands share one factor per dimension.

  Rank-0 operands (scalars) and size-1 operand dims (implicit broadcasts) map to nothing.
  Several results (e.g. `threefry2x32`, `optimization_barrier`) must share one shape.
  """
  f = _Factors(operand_shapes, result_shapes)
  out = result_shapes[0]
  for dim, size in enumerate(out):
    operands = [
      (i, dim) for i, s in enumerate(operand_shapes) if len(s) == len(out) and s[dim] == size
    ]
    results = [(i, dim) for i, s in enumerate(result_shapes) if s == out]
    f.add(size, PASS, operands, results)
  return f.build()


def pairwise(operand_shapes, result_shapes, params=None) -> Rule:
  """Operand i maps to result i, dim by dim (`device_put`, `optimization_barrier`)."""
  f = _Factors(operand_shapes, result_shapes)
  for index, shape in enumerate(result_shapes):
    for dim, size in enumerate(shape):
      f.add(size, PASS, [(index, dim)], [(index, dim)])
  return f.build()


def dot_general(operand_shapes, result_shapes, params) -> Rule:
  """Batch and free dims pass through; contracting dims are reductions."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
  lhs, rhs = operand_shapes
  f = _Factors(operand_shapes, result_shapes)
  out_dim = 0
  for l, r in zip(lhs_batch, rhs_batch):
    f.add(lhs[l], PASS, [(0, l), (1, r)], [(0, out_dim)])
    out_dim += 1
  for index, shape, used in (
    (0, lhs, (*lhs_contract, *lhs_batch)),
    (1, rhs, (*rhs_contract, *rhs_batch)),
  ):
    for dim in range(len(shape)):
      if dim not in used:
        f.add(shape[dim], PASS, [(index, dim)], [(0, out_dim)])
        out_dim += 1
  for l, r in zip(lhs_contract, rhs_contract):
    f.add(lhs[l], REDUCTION, [(0, l), (1, r)])
  return f.build()


def _reduce(kind: FactorKind) -> RuleBuilder:
  """`reduce_*` and `argmax/argmin`: kept dims pass through; `axes` get `kind`."""

  def build(operand_shapes, result_shapes, params) -> Rule:
    axes = set(params["axes"])
    f = _Factors(operand_shapes, result_shapes)
    out_dim = 0
    for dim, size in enumerate(operand_shapes[0]):
      if dim in axes:
        f.add(size, kind, [(0, dim)])
      else:
        f.add(
          size,
          PASS,
          [(i, dim) for i in range(len(operand_shapes))],
          [(i, out_dim) for i in range(len(result_shapes))],
        )
        out_dim += 1
    return f.build()

  return build


def reduce(operand_shapes, result_shapes, params) -> Rule:
  """`reduce` with a user computation over `n` arrays and their `n` scalar inits: kept dims
  pass through the arrays and results, reduced dims need replication (the computation is
  not known to be a sum, so partial results cannot be priced as one)."""
  arrays = operand_shapes[: len(result_shapes)]
  axes = set(params["dimensions"])
  f = _Factors(operand_shapes, result_shapes)
  out_dim = 0
  for dim, size in enumerate(arrays[0]):
    if dim in axes:
      for index in range(len(arrays)):
        f.add(size, REPLICATE, [(index, dim)])
    else:
      f.add(
        size,
        PASS,
        [(i, dim) for i in range(len(arrays))],
        [(i, out_dim) for i in range(len(result_shapes))],
      )
      out_dim += 1
  return f.build()


def broadcast_in_dim(operand_shapes, result_shapes, params) -> Rule:
  """Mapped dims of equal size pass through; new and size-1-expanded dims are result-only."""
  (operand,), (result,) = operand_shapes[:1], result_shapes
  f = _Factors(operand_shapes, result_shapes)
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
  f = _Factors(operand_shapes, result_shapes)
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
  f = _Factors(operand_shapes, result_shapes)
  for dim, src in enumerate(params["permutation"]):
    f.add(result_shapes[0][dim], PASS, [(0, src)], [(0, dim)])
  return f.build()


def squeeze(operand_shapes, result_shapes, params) -> Rule:
  f = _Factors(operand_shapes, result_shapes)
  dropped = {d % len(operand_shapes[0]) for d in params["dimensions"]}
  kept = [d for d in range(len(operand_shapes[0])) if d not in dropped]
  for dim, src in enumerate(kept):
    f.add(result_shapes[0][dim], PASS, [(0, src)], [(0, dim)])
  return f.build()


def _per_dim(
  special: Callable[
    [Sequence[Shape], Sequence[Shape], Mapping[str, Any]], Mapping[int, FactorKind]
  ],
) -> RuleBuilder:
  """Same-rank ops: dims listed by `special` get their own factors of the given kind; the
  rest pass through all operands and results of that rank."""

  def build(operand_shapes, result_shapes, params) -> Rule:
    rank = len(result_shapes[0])
    kinds = special(operand_shapes, result_shapes, params)
    f = _Factors(operand_shapes, result_shapes)
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


def _changed_dims(operand_shapes, result_shapes, params):
  """Dims whose size differs between the first operand and the result."""
  return {
    d: REPLICATE for d, (a, b) in enumerate(zip(operand_shapes[0], result_shapes[0])) if a != b
  }


def _axis(name: str):
  return lambda operand_shapes, result_shapes, params: {
    params[name] % len(result_shapes[0]): REPLICATE
  }


def _last_dim(operand_shapes, result_shapes, params):
  return {len(result_shapes[0]) - 1: REPLICATE}


def _padded_dims(operand_shapes, result_shapes, params):
  return {d: REPLICATE for d, cfg in enumerate(params["padding_config"]) if any(cfg)}


def _windowed_dims(operand_shapes, result_shapes, params):
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


def _dynamic_update_dims(operand_shapes, result_shapes, params):
  operand, update = operand_shapes[0], operand_shapes[1]
  return {d: REPLICATE for d in range(len(operand)) if operand[d] != update[d]}


def _rev_dims(operand_shapes, result_shapes, params):
  return {d: PERMUTE for d in params["dimensions"]}


def scan_slice(operand_shapes, result_shapes, params=None) -> Rule:
  """One iteration's slice of a stacked scan input, `[L, ...] -> [...]`: the stacked dim
  needs replication, the others pass through."""
  f = _Factors(operand_shapes, result_shapes)
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
  return _per_dim(lambda o, r, p: {p["dimension"]: REPLICATE})(
    operand_shapes, result_shapes, params
  )


def split(operand_shapes, result_shapes, params) -> Rule:
  return _per_dim(lambda o, r, p: {p["axis"] % len(o[0]): REPLICATE})(
    operand_shapes, result_shapes, params
  )


def iota(operand_shapes, result_shapes, params) -> Rule:
  f = _Factors(operand_shapes, result_shapes)
  f.own(PASS, (), result_shapes)
  return f.build()


def _trailing_extra(operand_shapes, result_shapes, params) -> Rule:
  """Leading dims shared by the first operand and result pass through; extra trailing dims
  of either are their own (`random_bits`, `random_split`, `random_wrap/unwrap`,
  `bitcast_convert_type` across widths)."""
  operand, result = operand_shapes[0], result_shapes[0]
  f = _Factors(operand_shapes, result_shapes)
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
  return _trailing_extra(operand_shapes, result_shapes, params)


def gather(operand_shapes, result_shapes, params) -> Rule:
  """Embedding-style gather: index batch dims pass through indices and result; operand
  dims taken whole pass through to their offset dims; indexed dims need replication."""
  dn = params["dimension_numbers"]
  slice_sizes = params["slice_sizes"]
  operand, indices = operand_shapes
  (result,) = result_shapes
  f = _Factors(operand_shapes, result_shapes)
  offset_dims = tuple(dn.offset_dims)
  batch_out = [d for d in range(len(result)) if d not in offset_dims]
  index_dims = [d for d in range(len(indices) - 1)]  # The last dim is the index vector.
  operand_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  indices_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  for out_dim, idx_dim in zip(batch_out, index_dims):
    operands = [(1, idx_dim)]
    if idx_dim in indices_batching:
      operands.append((0, operand_batching[indices_batching.index(idx_dim)]))
    f.add(result[out_dim], PASS, operands, [(0, out_dim)])
  window_operand_dims = [
    d for d in range(len(operand)) if d not in dn.collapsed_slice_dims and d not in operand_batching
  ]
  for out_dim, src in zip(offset_dims, window_operand_dims):
    if slice_sizes[src] == operand[src] and src not in dn.start_index_map:
      f.add(operand[src], PASS, [(0, src)], [(0, out_dim)])
    else:
      f.add(operand[src], REPLICATE, [(0, src)])
      f.add(result[out_dim], REPLICATE, results=[(0, out_dim)])
  for src in range(len(operand)):
    if src not in window_operand_dims and src not in operand_batching:
      f.add(operand[src], REPLICATE, [(0, src)])
  f.add(indices[-1], REPLICATE, [(1, len(indices) - 1)])  # The index vector.
  return f.build()


def _scatter(batch_kind: FactorKind) -> RuleBuilder:
  """Scatter: operand and result share every dim; update window dims taken whole pass
  through; the scattered (index batch) dims of updates and indices get `batch_kind`
  (reduction for scatter-add: shards hold partial sums); indexed operand dims need
  replication."""

  def build(operand_shapes, result_shapes, params) -> Rule:
    dn = params["dimension_numbers"]
    operand, indices, updates = operand_shapes[:3]
    f = _Factors(operand_shapes, result_shapes)
    operand_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    indices_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    window = tuple(dn.update_window_dims)
    window_operand_dims = [
      d
      for d in range(len(operand))
      if d not in dn.inserted_window_dims and d not in operand_batching
    ]
    window_of = dict(zip(window_operand_dims, window))
    for dim, size in enumerate(operand):
      upd = window_of.get(dim)
      if dim in operand_batching:
        continue  # Shared with the indices' batching dims below.
      if dim in dn.scatter_dims_to_operand_dims:
        f.add(size, REPLICATE, [(0, dim)], [(0, dim)])
        if upd is not None:
          f.add(updates[upd], REPLICATE, [(2, upd)])
      elif upd is not None and updates[upd] == size:
        f.add(size, PASS, [(0, dim), (2, upd)], [(0, dim)])
      else:
        f.add(size, REPLICATE, [(0, dim)], [(0, dim)])
        if upd is not None:
          f.add(updates[upd], REPLICATE, [(2, upd)])
    scatter_update_dims = [d for d in range(len(updates)) if d not in window]
    for upd_dim, idx_dim in zip(scatter_update_dims, range(len(indices) - 1)):
      if idx_dim in indices_batching:
        op_dim = operand_batching[indices_batching.index(idx_dim)]
        f.add(updates[upd_dim], PASS, [(2, upd_dim), (1, idx_dim), (0, op_dim)], [(0, op_dim)])
      else:
        f.add(updates[upd_dim], batch_kind, [(2, upd_dim), (1, idx_dim)])
    f.add(indices[-1], REPLICATE, [(1, len(indices) - 1)])  # The index vector.
    return f.build()

  return build


def conv_general_dilated(operand_shapes, result_shapes, params) -> Rule:
  """Convolution, including grouped ones; spatial dims need replication.

  Ungrouped: lhs `[N, C, *S]`, rhs `[O, C, *K]` (in the dimension numbers' order), out
  `[N, O, *S']`: N and O pass through, C is a reduction.

  `feature_group_count = G`: C is `G` groups of `C/G` (factors `(G, C/G)`, major to minor)
  and so are O `(G, O/G)` and the output features; the group factor passes through all
  three and is the only one sharded (a grouped or depthwise conv splits by whole groups,
  which is how XLA partitions it). The per-group input factor, a minor one, needs
  replication (sharding it would split each group's channels, a strided sharding of C).

  `batch_group_count = B` (the kernel gradient of a grouped conv): N is `B` groups of
  `N/B`, O is `(B, O/B)`; the group factor passes through N, O and the output features,
  the per-group batch factor needs replication and C is an ordinary reduction.

  A group factor that an axis does not divide is simply not sharded; the operands are
  then gathered (and XLA never sees a grouped conv split across a group, which makes it
  abort, see tests/test_lower.py).

  Spatial dims need replication: sharding them needs halo exchanges, which neither the
  simulator prices nor the lowering offers (XLA's CPU partitioner computes some of them
  wrongly); `automap_rl.xla.lower` pins a convolution's operands and results to this rule,
  so a spatially sharded activation is gathered before the convolution.
  """
  lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
  lhs, rhs = operand_shapes
  (out,) = result_shapes
  f = _Factors(operand_shapes, result_shapes)
  features, batches = params.get("feature_group_count", 1), params.get("batch_group_count", 1)
  n, c, o = (0, lhs_spec[0]), (0, lhs_spec[1]), (1, rhs_spec[0])
  out_n, out_c, rhs_c = (0, out_spec[0]), (0, out_spec[1]), (1, rhs_spec[1])
  if batches > 1:
    f.add(batches, PASS, [n, o], [out_c])
    f.add(lhs[n[1]] // batches, REPLICATE, [n], [out_n])
    f.add(rhs[o[1]] // batches, PASS, [o], [out_c])
    f.add(lhs[c[1]], REDUCTION, [c, rhs_c])
  else:
    f.add(lhs[n[1]], PASS, [n], [out_n])
    if features > 1:
      f.add(features, PASS, [c, o], [out_c])
      f.add(lhs[c[1]] // features, REPLICATE, [c, rhs_c])
      f.add(rhs[o[1]] // features, PASS, [o], [out_c])
    else:
      f.add(rhs[o[1]], PASS, [o], [out_c])
      f.add(lhs[c[1]], REDUCTION, [c, rhs_c])
  f.own(
    REPLICATE, operand_shapes, result_shapes, {0: lhs_spec[2:], 1: rhs_spec[2:]}, {0: out_spec[2:]}
  )
  return f.build()


def conv_batch_group_factor(rule: Rule) -> int:
  """The batch-group factor of a `conv_general_dilated` op's rule (see
  `conv_general_dilated`), or -1 when `batch_group_count` is 1: a factor that passes
  through the lhs, the kernel and the result of a rule that also has a reduction factor.
  (The group factor of a feature-grouped conv passes through all three too, but such a
  rule has no reduction factor; an ungrouped one has no factor in all three.)"""
  if FactorKind.REDUCTION not in rule.factor_kinds:
    return -1
  lhs, rhs = ({f for dim in dims for f in dim} for dims in rule.operand_dims[:2])
  out = {f for dim in rule.result_dims[0] for f in dim}
  return min((f for f in lhs & rhs & out if rule.factor_kinds[f] == PASS), default=-1)


def stack(operand_shapes, result_shapes, params) -> Rule:
  """`stack[axis]`: every operand's dims pass through to the result's other dims; the new
  dim is the result's own (a shard of it is a local choice of whole operands, as a
  `broadcast_in_dim`'s new dim is)."""
  (out,) = result_shapes
  axis = params["axis"] % len(out)
  f = _Factors(operand_shapes, result_shapes)
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
  f = _Factors(operand_shapes, result_shapes)
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
  f = _Factors(operand_shapes, result_shapes)
  for dim, (size, rep) in enumerate(zip(operand, params["reps"])):
    f.add(rep, PASS, results=[(0, dim)])
    f.add(size, PASS, [(0, dim)], [(0, dim)])
  return f.build()


def fft(operand_shapes, result_shapes, params) -> Rule:
  """`fft`: the transformed (trailing `len(fft_lengths)`) dims need replication, the
  leading batch dims pass through."""
  rank, transformed = len(result_shapes[0]), len(params["fft_lengths"])
  return _per_dim(lambda o, r, p: {d: REPLICATE for d in range(rank - transformed, rank)})(
    operand_shapes, result_shapes, params
  )


def _matrix_dims(operand_shapes, result_shapes, params):
  """Linear algebra on the trailing two dims (`cholesky`, `triangular_solve`, ...): they need
  replication, leading batch dims pass through."""
  rank = len(result_shapes[0])
  return {d: REPLICATE for d in range(max(rank - 2, 0), rank)}


def _approx_top_k_dims(operand_shapes, result_shapes, params):
  return {params["reduction_dimension"] % len(operand_shapes[0]): REPLICATE}


ELEMENTWISE = (
  # Unary.
  "neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan "
  "asin acos atan sinh cosh asinh acosh atanh lgamma digamma erf erfc erf_inv abs sqrt rsqrt "
  "cbrt not integer_pow square one_minus_square population_count clz real imag conj reduce_precision "
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
    "reduce_sum": _reduce(REDUCTION),
    "reduce_max": _reduce(REDUCTION),
    "reduce_min": _reduce(REDUCTION),
    "reduce_prod": _reduce(REDUCTION),
    "reduce_and": _reduce(REDUCTION),
    "reduce_or": _reduce(REDUCTION),
    "reduce_xor": _reduce(REDUCTION),
    "reduce": reduce,
    "argmax": _reduce(REPLICATE),
    "argmin": _reduce(REPLICATE),
    "broadcast_in_dim": broadcast_in_dim,
    "reshape": reshape,
    "squeeze": squeeze,
    "transpose": transpose,
    "rev": _per_dim(_rev_dims),
    "concatenate": concatenate,
    "stack": stack,
    "unstack": unstack,
    "tile": tile,
    "split": split,
    "pad": _per_dim(_padded_dims),
    "slice": _per_dim(_changed_dims),
    "dynamic_slice": _per_dim(_changed_dims),
    "dynamic_update_slice": _per_dim(_dynamic_update_dims),
    "gather": gather,
    "scatter": _scatter(REPLICATE),
    "scatter-add": _scatter(REDUCTION),
    "scatter_add": _scatter(REDUCTION),
    "scatter-mul": _scatter(REPLICATE),
    "scatter_mul": _scatter(REPLICATE),
    "scatter-sub": _scatter(REDUCTION),
    "scatter_sub": _scatter(REDUCTION),
    "scatter-min": _scatter(REPLICATE),
    "scatter_min": _scatter(REPLICATE),
    "scatter-max": _scatter(REPLICATE),
    "scatter_max": _scatter(REPLICATE),
    "iota": iota,
    "conv_general_dilated": conv_general_dilated,
    "reduce_window_sum": _per_dim(_windowed_dims),
    "reduce_window_max": _per_dim(_windowed_dims),
    "reduce_window_min": _per_dim(_windowed_dims),
    "reduce_window": _per_dim(_windowed_dims),
    "select_and_scatter_add": _per_dim(_windowed_dims),
    "select_and_gather_add": _per_dim(_windowed_dims),
    "cumsum": _per_dim(_axis("axis")),
    "cumprod": _per_dim(_axis("axis")),
    "cummax": _per_dim(_axis("axis")),
    "cummin": _per_dim(_axis("axis")),
    "cumlogsumexp": _per_dim(_axis("axis")),
    "sort": _per_dim(_axis("dimension")),
    "top_k": _per_dim(_last_dim),
    "approx_top_k": _per_dim(_approx_top_k_dims),
    "fft": fft,
    "cholesky": _per_dim(_matrix_dims),
    "triangular_solve": _per_dim(_matrix_dims),
    "random_bits": _trailing_extra,
    "random_split": _trailing_extra,
    "random_wrap": _trailing_extra,
    "random_unwrap": _trailing_extra,
    "bitcast_convert_type": bitcast_convert_type,
  }
)


def rule_for(primitive: str, operand_shapes, result_shapes, params) -> tuple[Rule, bool]:
  """Returns the op's rule and whether the primitive is known to the registry."""
  builder = REGISTRY.get(primitive)
  if builder is None:
    return conservative(operand_shapes, result_shapes), False
  return builder(operand_shapes, result_shapes, params), True
