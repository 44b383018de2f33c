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
  (XLA counts them apart, as `transcendentals`); `logistic` expands to 3 flops.
* `integer_pow(x, n)`: the multiplies of square-and-multiply, plus a divide when n < 0.
* reductions: `in.size - out.size` applications of the reducer (9 for arg-reductions,
  whose variadic reducer compares and selects); windowed reductions `window - 1` per
  result element.
* data movement (broadcast, reshape, transpose, slices, gathers, concatenate, pad, copy,
  iota) and the IR's own ops: none.

`fusion_copies` then says how many times the compiled CPU module computes each op: XLA
clones cheap producers into every fusion that reads them, and `cost_analysis()` counts each
fusion's instructions, while CSE merges duplicate ops and constant folding removes ops on
constants alone. XLA's algebraic simplifier also removes some arithmetic (a multiply by
one, an add of a literal zero, a negation it moves past a sum); that is not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence, Set as AbstractSet
from typing import Any

from automap_rl.ir.program import FactorKind, Op, Program, Role

Shape = Sequence[int]

ZERO_FLOP = frozenset({
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "copy", "copy_p", "iota", "rev",
    "select_and_gather_add", "stop_gradient", "device_put", "sharding_constraint", "optimization_barrier",
    "random_seed", "random_wrap", "random_unwrap", "random_key_data", "bitcast_convert_type",
    "scan_slice", "scan_stack", "scan_carry", "cond_merge", "split", "squeeze_p", "real", "imag",
    "empty", "zeros_like", "broadcast", "stack", "unstack", "tile",
})
TRANSCENDENTAL = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "sin", "cos", "tan", "asin", "acos", "atan",
    "sinh", "cosh", "asinh", "acosh", "atanh", "atan2", "sqrt", "rsqrt", "cbrt", "pow", "erf",
    "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac", "bessel_i0e", "bessel_i1e",
})
ELEMENTWISE_FLOPS = {"logistic": 3.0}
REDUCTIONS = {"reduce_sum": 1.0, "reduce_max": 1.0, "reduce_min": 1.0, "reduce_prod": 1.0,
              "reduce_and": 1.0, "reduce_or": 1.0, "reduce_xor": 1.0, "argmax": 9.0, "argmin": 9.0}


def _size(shape: Shape) -> int:
  return math.prod(shape)


def _integer_pow_flops(y: int) -> int:
  n = abs(int(y))
  mults = max(n.bit_length() - 1 + bin(n).count("1") - 1, 0) if n else 0
  return mults + (1 if y < 0 else 0)


def _valid_pairs(in_size: int, kernel: int, out_size: int, stride: int, pad_lo: int, lhs_dil: int,
                 rhs_dil: int) -> int:
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
    pairs *= _valid_pairs(in_size, kernel, out_size, strides[d], padding[d][0], lhs_dil[d], rhs_dil[d])
  del out_spec
  return 2.0 * (batch // batch_groups) * (in_features // feature_groups) * out_features * pairs


def primitive_flops(primitive: str, operand_shapes: Sequence[Shape], result_shapes: Sequence[Shape],
                    params: Mapping[str, Any]) -> float:
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


# -- fusion --------------------------------------------------------------------------------
#
# `fusion_copies` replays, on a `Program`, the passes of XLA's CPU compiler that decide how
# often an op is computed (xla/service/cpu/cpu_instruction_fusion.cc,
# xla/service/instruction_fusion.cc, xla/backends/cpu/transforms/library_rewriter.cc):
#
# 1. CSE merges ops with the same primitive, operands, rule and result types; ops that
#    read only constants and literals are folded.
# 2. Contraction operands are brought to the layout the CPU emitters take: a dot operand
#    with several free or contracting dims, or with batch dims that do not lead, is
#    reshaped or transposed (DotDecomposer); a convolution input whose batch and feature
#    dims are not first and last, or a kernel whose input and output features are not the
#    last two dims, is transposed (ConvCanonicalization). Each (value, layout) is one
#    fusible movement op.
# 3. A float sum, max or min reduction with 4096 elements in or out becomes a library (YNN)
#    custom fusion, with the supported elementwise producers read by nothing else; custom
#    fusions neither absorb other ops nor fuse into them.
# 4. Instruction fusion visits consumers in reverse order; a loop-fusible consumer absorbs
#    its loop-fusible producers, cloning one that has other users unless the producer is
#    expensive (a transcendental, a float division, a reduction, a gather) or the consumer
#    reads its elements several times (a broadcast). A producer that is more than unary and
#    reads more elements than it writes is cloned only if it fuses into all its users on
#    all paths. A producer left with users it did not fuse into stays computed on its own.

CHEAP_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "neg", "max", "min", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge",
    "and", "or", "not", "xor", "abs", "sign", "floor", "ceil", "round", "is_finite", "convert_element_type",
    "integer_pow", "square", "copy", "copy_p", "real", "imag", "nextafter", "sin", "cos", "tan", "shift_left",
    "shift_right_logical", "shift_right_arithmetic", "population_count", "clz", "reduce_precision",
})
DIVISIONS = frozenset({"div", "rem"})  # Cheap by a literal (a multiply by its inverse), else expensive.
EXPENSIVE_ELEMENTWISE = TRANSCENDENTAL | {"logistic"}
NO_OPS = frozenset({"device_put", "sharding_constraint", "stop_gradient"})  # Gone by fusion time.
MOVEMENT = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
    "dynamic_update_slice", "concatenate", "pad", "iota", "rev", "split", "gather",
}) | NO_OPS
PERMUTING = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "slice", "concatenate", "rev", "split",
                       "gather"}) | NO_OPS  # Movement that reads each operand element once.
FUSED_REDUCTIONS = frozenset(REDUCTIONS)
LIBRARY_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
LIBRARY_PRODUCERS = frozenset({
    "add", "add_any", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "square", "abs", "ceil", "floor",
    "round", "sign", "neg", "convert_element_type", "erf", "exp", "expm1", "log", "log1p", "logistic", "rsqrt",
    "sqrt", "tanh", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
})
LIBRARY_MIN_ELEMENTS = 4096
MAX_FUSED_REDUCTIONS = 5


def _elementwise(op: Op) -> bool:
  return op.primitive in CHEAP_ELEMENTWISE or op.primitive in EXPENSIVE_ELEMENTWISE or op.primitive in DIVISIONS


def _loop_fusible(op: Op) -> bool:
  """XLA's `CanBeLoopFused`: elementwise ops, movement and reductions."""
  return _elementwise(op) or op.primitive in MOVEMENT or op.primitive in FUSED_REDUCTIONS


def memory_bytes(program: Program) -> list[float]:
  """Bytes each op reads from and writes to memory once XLA has fused loop-fusible
  chains (elementwise ops, data movement, reductions): a loop-fusible op reads an operand
  that a loop-fusible op produced from the fusion, not from memory, and writes a result
  that only loop-fusible ops read (and the program does not return) into it. A loop
  iteration's `scan_slice` reads its slice of the stacked input, not the whole stack (a
  dynamic-slice), and its `scan_stack` writes its slice of the stacked output in place (a
  dynamic-update-slice). Dots, convolutions, and everything else read and write their
  values whole. Per op, [num_ops]."""
  producer = {v: op for op in program.ops for v in op.results}
  consumers: dict[int, list[Op]] = {}
  for op in program.ops:
    for v in set(op.operands):
      consumers.setdefault(v, []).append(op)
  outputs = set(program.outputs)
  fused = lambda op: op is not None and _loop_fusible(op)
  out = []
  for op in program.ops:
    if op.primitive in ("scan_slice", "scan_stack"):
      out.append(2.0 * program.values[op.results[0] if op.primitive == "scan_slice" else op.operands[0]].nbytes)
      continue
    reads = sum(program.values[v].nbytes for v in op.operands
                if not (fused(op) and fused(producer.get(v))))
    writes = sum(program.values[v].nbytes for v in op.results
                 if not (fused(op) and v not in outputs and consumers.get(v)
                         and all(fused(c) for c in consumers[v])))
    out.append(float(reads + writes))
  return out


def _expensive(op: Op) -> bool:
  """Worth materialising rather than recomputing (`CpuInstructionFusion::IsExpensive`)."""
  if op.primitive in DIVISIONS:
    return len(op.operands) > 1  # Literals are dropped: one operand left is a division by a literal.
  return op.primitive not in CHEAP_ELEMENTWISE and (op.primitive not in MOVEMENT or op.primitive == "gather")


def _true_rank(shape: Shape) -> int:
  return sum(1 for d in shape if d > 1)


def _common_subexpressions(program: Program) -> tuple[dict[int, int], frozenset[int]]:
  """(value -> the value CSE replaces it with, the ops CSE removes).

  Literal operands are not in the IR, so ops that differ only in a literal merge too (in
  the zoo: Adam's scalar `b1 ** t` and `b2 ** t`).
  """
  canon: dict[int, int] = {}
  first: dict[tuple, Op] = {}
  merged = set()
  for op in program.ops:
    operands = tuple(canon.get(v, v) for v in op.operands)
    if not operands:
      continue
    key = (op.primitive, operands, tuple((program.values[v].shape, program.values[v].dtype) for v in op.results),
           op.rule, op.flops, op.scope)
    if key in first:
      merged.add(op.id)
      canon.update(zip(op.results, first[key].results))
    else:
      first[key] = op
  return canon, frozenset(merged)


def _constant_ops(program: Program) -> frozenset[int]:
  """Ops that read only constants and literals (transitively): XLA folds them, or sinks
  them into the broadcast of a scalar (the seed of a gradient and what follows it)."""
  constant = {v.id for v in program.values if v.role == Role.CONSTANT}
  folded = set()
  for op in program.ops:
    if all(v in constant for v in op.operands) and not op.scope:
      folded.add(op.id)
      constant.update(op.results)
  return frozenset(folded)


def _dim_roles(op: Op, index: int) -> list[str | None]:
  """Per dim of operand `index` of a dot or convolution, from its rule: 'contract' (a
  reduction factor: contracting dims, a convolution's input features), 'batch' (a dot
  factor shared by both operands and the result), 'free' (passed to the result alone: a
  convolution's batch, a kernel's output features), 'other' (a convolution's spatial
  dims) or None (size 1: no factor)."""
  dims = op.rule.operand_dims
  roles = []
  for factors in dims[index]:
    if not factors:
      roles.append(None)
    elif op.rule.factor_kinds[factors[0]] == FactorKind.REDUCTION:
      roles.append("contract")
    elif op.rule.factor_kinds[factors[0]] != FactorKind.PASS_THROUGH:
      roles.append("other")
    elif op.primitive == "dot_general" and any(factors[0] in d for d in dims[1 - index]):
      roles.append("batch")
    else:
      roles.append("free")
  return roles


def _contraction_layout(op: Op, index: int) -> tuple | None:
  """The layout XLA brings operand `index` of a dot or convolution to, as a hashable key;
  None when it reads the operand as it is (see the notes above `CHEAP_ELEMENTWISE`)."""
  roles = _dim_roles(op, index)
  dims = tuple(d for d, role in enumerate(roles) if role is not None)
  if op.primitive == "dot_general":
    batch, free, contract = (tuple(d for d in dims if roles[d] == role) for role in ("batch", "free", "contract"))
    if len(roles) <= len(batch) + 2 and dims[:len(batch)] == batch and len(free) <= 1 and len(contract) <= 1:
      return None  # Canonical; size-1 dims count towards the rank, not towards the layout.
    return (batch, free, contract) if index == 0 else (batch, contract, free)  # [b, m, k] and [b, k, n].
  if "contract" not in roles or "free" not in roles:
    return None  # A grouped convolution, whose feature dims need replication.
  free, feature = roles.index("free"), roles.index("contract")
  spatial = tuple(d for d in dims if roles[d] == "other")
  order = (free, *spatial, feature) if index == 0 else (*spatial, feature, free)  # b01f, 01io.
  return None if order == dims else order


@dataclasses.dataclass
class _Graph:
  """Ops as XLA's fusion passes see them: nodes are the program's ops, then one layout op
  per (value, contraction layout) (see `_contraction_layout`).

  Attributes:
    operands: producer nodes of each node, unique, in the same computation.
    users: consumer nodes of each node.
    pinned: nodes read by something that never fuses them (an output, another scope).
    fusible: XLA's `CanBeLoopFused`.
    expensive: not cloned into several consumers, nor into one that reuses its elements.
    reduction: a reduction (a fusion holds at most `MAX_FUSED_REDUCTIONS + 1`).
    reuses: operand nodes a node reads elements of several times (broadcasts).
    unary: at most one operand as large as the result (`EffectivelyAtMostUnary`).
    grows: its operands have at most as many elements as its results.
    live: takes part in fusion: not merged by CSE, folded, nor absorbed into a library
      fusion.
    copies: how many times each node is computed so far (0 if merged or folded).
    num_ops: nodes below this are the program's ops, the others layout ops.
  """

  operands: list[list[int]]
  users: list[set[int]]
  pinned: list[bool]
  fusible: list[bool]
  expensive: list[bool]
  reduction: list[bool]
  reuses: list[frozenset[int]]
  unary: list[bool]
  grows: list[bool]
  live: list[bool]
  copies: list[int]
  num_ops: int


def _op_reuses(op: Op, operands: Sequence[int], shapes: Sequence[Shape], producer: Mapping[int, int]
               ) -> frozenset[int]:
  """Producers whose elements `op` reads more than once: all of a broadcast's, and for an
  elementwise op those of operands of another shape (implicit broadcasts)."""
  if _elementwise(op):
    out = shapes[op.results[0]]
    return frozenset(producer[v] for v in op.operands if v in producer and shapes[v] != out) & set(operands)
  if op.primitive in PERMUTING or op.primitive in FUSED_REDUCTIONS:
    return frozenset()
  if op.primitive == "pad":
    return frozenset(operands[1:])
  return frozenset(operands)


def _op_unary(op: Op, shapes: Sequence[Shape], broadcasts: AbstractSet[int]) -> bool:
  """At most one operand has the result's true rank (dims > 1); `broadcasts` (values of
  broadcasts, iotas and folded constants) and an elementwise op's implicitly broadcast
  operands do not count."""
  out = shapes[op.results[0]]
  large = {v for v in op.operands if v not in broadcasts and _true_rank(shapes[v]) >= _true_rank(out)
           and not (_elementwise(op) and shapes[v] != out)}
  return len(large) <= 1


def _edges(program: Program, canon: Mapping[int, int], producer: Mapping[int, int], skip: AbstractSet[int]
           ) -> tuple[list[list[int]], list[bool]]:
  """(operand nodes of each node, pinned nodes): ops read their producers in the same
  scope, contractions through one layout node per (value, layout); a producer read from
  another scope or as an output is pinned. Ops in `skip` (merged, folded) read nothing."""
  ops = program.ops
  outputs = {canon.get(v, v) for v in program.outputs}
  operands: list[list[int]] = [[] for _ in ops]
  pinned = [op.id not in skip and any(v in outputs for v in op.results) for op in ops]
  layouts: dict[tuple, int] = {}
  for op in ops:
    for index, v in enumerate(() if op.id in skip else op.operands):
      v = canon.get(v, v)
      if v not in producer:
        continue
      p = producer[v]
      if ops[p].scope != op.scope:
        pinned[p] = True
        continue
      layout = _contraction_layout(op, index) if op.primitive in ("dot_general", "conv_general_dilated") else None
      if layout is not None:
        if (v, layout) not in layouts:
          layouts[v, layout] = len(operands)
          operands.append([p])
          pinned.append(False)
        p = layouts[v, layout]
      if p not in operands[op.id]:
        operands[op.id].append(p)
  return operands, pinned


def _graph(program: Program, shapes: Sequence[Shape]) -> _Graph:
  """The fusion graph of `program` with values of these (per-device) shapes."""
  ops = program.ops
  canon, merged = _common_subexpressions(program)
  folded = _constant_ops(program)
  skip = merged | folded
  producer = {v: op.id for op in ops if op.id not in skip for v in op.results}
  producer.update({v: producer[c] for v, c in canon.items() if c in producer})
  operands, pinned = _edges(program, canon, producer, skip)
  users: list[set[int]] = [set() for _ in operands]
  for node, mine in enumerate(operands):
    for p in mine:
      users[p].add(node)
  broadcasts = {v for op in ops if op.id in folded or op.primitive in ("broadcast_in_dim", "iota") for v in op.results}
  size = [math.prod(s) for s in shapes]
  layouts = len(operands) - len(ops)
  return _Graph(
      operands=operands,
      users=users,
      pinned=pinned,
      fusible=[_loop_fusible(op) for op in ops] + [True] * layouts,
      expensive=[_expensive(op) for op in ops] + [False] * layouts,
      reduction=[op.primitive in FUSED_REDUCTIONS for op in ops] + [False] * layouts,
      reuses=[_op_reuses(op, operands[op.id], shapes, producer) for op in ops] + [frozenset()] * layouts,
      unary=[not op.results or _op_unary(op, shapes, broadcasts) for op in ops] + [True] * layouts,
      grows=[sum(size[v] for v in set(op.operands)) <= sum(size[v] for v in op.results) for op in ops]
      + [True] * layouts,
      live=[op.id not in skip for op in ops] + [True] * layouts,
      copies=[int(op.id not in skip) for op in ops] + [1] * layouts,
      num_ops=len(ops),
  )


def _library_fusions(program: Program, graph: _Graph, shapes: Sequence[Shape]) -> None:
  """Turns large float reductions into library fusions, in place: each absorbs the
  supported producers that only it reads, takes over their operands, and fuses no further."""
  ops = program.ops
  taken: set[int] = set()
  for op in reversed(ops):
    if (not graph.live[op.id] or op.id in taken or op.primitive not in LIBRARY_REDUCTIONS
        or "float" not in program.values[op.results[0]].dtype
        or max(math.prod(shapes[v]) for v in (*op.operands, *op.results)) < LIBRARY_MIN_ELEMENTS):
      continue
    members, frontier = {op.id}, [op.id]
    while frontier:
      for p in graph.operands[frontier.pop()]:
        if (p < len(ops) and p not in members and p not in taken and not graph.pinned[p]
            and ops[p].primitive in LIBRARY_PRODUCERS and graph.users[p] <= members):
          members.add(p)
          frontier.append(p)
    outside = list(dict.fromkeys(p for m in sorted(members, reverse=True) for p in graph.operands[m]
                                 if p not in members))
    for m in members - {op.id}:
      graph.live[m] = False
      graph.operands[m], graph.users[m] = [], set()
    for p in outside:
      graph.users[p] = (graph.users[p] - members) | {op.id}
    graph.operands[op.id] = outside
    graph.fusible[op.id], graph.expensive[op.id], graph.reduction[op.id] = False, True, False
    taken |= members


def _may_fuse(graph: _Graph, producer: int, reused: AbstractSet[int], duplicates: bool) -> bool:
  """`ShouldFuse` of `producer` into a consumer that reuses the elements of `reused`;
  `duplicates`: the producer has other users, so fusing clones it."""
  return graph.fusible[producer] and not (graph.expensive[producer] and (duplicates or producer in reused))


def _globally_unfusible(graph: _Graph) -> set[int]:
  """Producers that must not be cloned (`ComputeGloballyUnfusible`): more than unary, more
  elements read than written, and not fusible into every user along every path."""
  order = _post_order(graph)
  position = {node: i for i, node in enumerate(order)}
  reach = {}  # Bit set of the positions of the nodes reachable from each node, itself included.
  for node in reversed(order):
    reach[node] = (1 << position[node]) | _union(reach[u] for u in graph.users[node])
  unfusible: set[int] = set()
  cache: dict[tuple[int, int], bool] = {}

  def on_all_paths(producer: int, consumer: int) -> bool:
    if consumer == producer:
      return True
    if (producer, consumer) not in cache:
      cache[producer, consumer] = graph.fusible[consumer] and all(
          o not in unfusible
          and _may_fuse(graph, o, graph.reuses[consumer], len(graph.users[o]) > 1 or graph.pinned[o])
          and on_all_paths(producer, o)
          for o in graph.operands[consumer]
          if position[o] >= position[producer] and reach[producer] >> position[o] & 1)
    return cache[producer, consumer]

  for node in reversed(order):
    if not graph.live[node] or graph.unary[node] or graph.grows[node]:
      continue
    if graph.pinned[node] or not all(on_all_paths(node, u) for u in graph.users[node]):
      unfusible.add(node)
  return unfusible


def _union(bits: Iterable[int]) -> int:
  out = 0
  for b in bits:
    out |= b
  return out


def _post_order(graph: _Graph) -> list[int]:
  """Live nodes, producers first: ops in program order, each layout op just before the
  first op that reads it."""
  def position(node: int) -> float:
    return node if node < graph.num_ops else min(graph.users[node], default=node) - 0.5
  return sorted((node for node in range(len(graph.operands)) if graph.live[node]), key=position)


def _fuse(graph: _Graph, unfusible: set[int]) -> None:
  """Runs instruction fusion on `graph`, in place: `copies` gains one per fusion a node is
  cloned into, and loses the node's own computation when every user fused it."""
  order = _post_order(graph)
  copies = graph.copies
  priority = {node: i for i, node in enumerate(order)}
  queued = set(order)
  fused: set[int] = set()
  reused = {node: set(graph.reuses[node]) for node in order}
  reductions = {node: int(graph.reduction[node]) for node in order}
  while order:
    consumer = order.pop()
    if consumer not in queued:
      continue
    queued.discard(consumer)
    if consumer not in fused and not graph.fusible[consumer]:
      continue
    candidates = sorted((p for p in graph.operands[consumer] if p in queued), key=priority.get, reverse=True)
    for producer in candidates:
      duplicates = len(graph.users[producer]) > 1 or graph.pinned[producer]
      if (producer in unfusible or not _may_fuse(graph, producer, reused[consumer], duplicates)
          or (graph.reduction[producer] and reductions[consumer] > MAX_FUSED_REDUCTIONS)):
        continue
      _fuse_into(graph, consumer, producer, reused)
      fused.add(consumer)
      reductions[consumer] += graph.reduction[producer]
      copies[producer] += 1
      if not graph.users[producer] and not graph.pinned[producer]:
        copies[producer] -= 1  # Every user fused it: it is not computed on its own.
        queued.discard(producer)
        for o in graph.operands[producer]:
          graph.users[o].discard(producer)
      priority[consumer] = len(priority)
      order.append(consumer)
      queued.add(consumer)
      break


def _fuse_into(graph: _Graph, consumer: int, producer: int, reused: dict[int, set[int]]) -> None:
  """Clones `producer` into the fusion `consumer`: the fusion reads the producer's operands
  instead (`UpdateReusedOperandsForFusion` for the reuse sets)."""
  if producer in reused[consumer]:
    reused[consumer] = (reused[consumer] - {producer}) | set(graph.operands[producer])
  else:
    reused[consumer] |= graph.reuses[producer]
  graph.users[producer].discard(consumer)
  graph.operands[consumer] = [o for o in graph.operands[consumer] if o != producer]
  for o in graph.operands[producer]:
    if o not in graph.operands[consumer]:
      graph.operands[consumer].append(o)
    graph.users[o].add(consumer)


def fusion_copies(program: Program, shapes: Sequence[Shape] | None = None) -> tuple[int, ...]:
  """How many times XLA's compiled CPU module computes each op of `program`: 0 for an op
  CSE merges into an identical one or constant folding removes, else 1 plus one per
  fusion XLA clones it into, less one if it is not left standing on its own (see the notes
  above `CHEAP_ELEMENTWISE`).

  Args:
    program: the traced program.
    shapes: per value, its per-device shape under a plan (default: the global shapes).
      Layout and library decisions depend on sizes.
  """
  shapes = [v.shape for v in program.values] if shapes is None else shapes
  graph = _graph(program, shapes)
  _library_fusions(program, graph, shapes)
  _fuse(graph, _globally_unfusible(graph))
  return tuple(graph.copies[:graph.num_ops])
