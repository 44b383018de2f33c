"""Rules of ops that contract, reduce or index: dots, reductions, convolutions, gathers,
scatters and FFTs."""

from __future__ import annotations

from automap_rl.ir.program import FactorKind, Rule
from automap_rl.ir.rules.factors import PASS, REDUCTION, REPLICATE, Factors, RuleBuilder


def dot_general(operand_shapes, result_shapes, params) -> Rule:
  """Batch and free dims pass through; contracting dims are reductions."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
  lhs, rhs = operand_shapes
  f = Factors(operand_shapes, result_shapes)
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


def reduction(kind: FactorKind) -> RuleBuilder:
  """`reduce_*` and `argmax/argmin`: kept dims pass through; `axes` get `kind`."""

  def build(operand_shapes, result_shapes, params) -> Rule:
    axes = set(params["axes"])
    f = Factors(operand_shapes, result_shapes)
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
  f = Factors(operand_shapes, result_shapes)
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


def gather(operand_shapes, result_shapes, params) -> Rule:
  """Embedding-style gather: index batch dims pass through indices and result; operand
  dims taken whole pass through to their offset dims; indexed dims need replication, but
  one: an indexed dim taken one element at a time (a table's rows) is a reduction: each
  shard gathers the rows it holds, zeros for the rest, and the partial results are summed
  (the result's bytes move, not the table's), as XLA partitions a gather over such a dim
  (Megatron-LM's vocab-parallel embedding). `ir.table_rows` keeps that only for a
  parameter's rows. A gather with batching dims (`take_along_axis`: the loss's pick of
  each label's logit) keeps replication: XLA's partitioner aborts on one split by rows
  inside a partially manual computation (a pipeline stage's)."""
  dn = params["dimension_numbers"]
  slice_sizes = params["slice_sizes"]
  operand, indices = operand_shapes
  (result,) = result_shapes
  f = Factors(operand_shapes, result_shapes)
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
  one_row = lambda src: not operand_batching and slice_sizes[src] == 1 and src in dn.start_index_map
  for out_dim, src in zip(offset_dims, window_operand_dims):
    if slice_sizes[src] == operand[src] and src not in dn.start_index_map:
      f.add(operand[src], PASS, [(0, src)], [(0, out_dim)])
    else:
      f.add(operand[src], REDUCTION if one_row(src) else REPLICATE, [(0, src)])
      f.add(result[out_dim], REPLICATE, results=[(0, out_dim)])
  for src in range(len(operand)):
    if src not in window_operand_dims and src not in operand_batching:
      f.add(operand[src], REDUCTION if one_row(src) else REPLICATE, [(0, src)])
  f.add(indices[-1], REPLICATE, [(1, len(indices) - 1)])  # The index vector.
  return f.build()


def scatter(batch_kind: FactorKind) -> RuleBuilder:
  """Scatter: operand and result share every dim; update window dims taken whole pass
  through; the scattered (index batch) dims of updates and indices get `batch_kind`
  (reduction for scatter-add: shards hold partial sums); indexed operand dims need
  replication, but one: an indexed dim each update writes one element of (a table's rows)
  passes through operand and result: each shard applies the updates that land in its
  rows and drops the rest (the updates' bytes move, not the table's), as XLA partitions a
  scatter over such a dim. `ir.table_rows` keeps that only for a parameter's rows."""

  def build(operand_shapes, result_shapes, params) -> Rule:
    dn = params["dimension_numbers"]
    operand, indices, updates = operand_shapes[:3]
    f = Factors(operand_shapes, result_shapes)
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
        one_row = upd is None or updates[upd] == 1
        f.add(size, PASS if one_row else REPLICATE, [(0, dim)], [(0, dim)])
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
  f = Factors(operand_shapes, result_shapes)
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
