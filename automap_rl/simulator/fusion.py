"""XLA's fusion as the cost model sees it: which primitives fuse, and what fusing does to
an op's memory traffic, to how often it is computed and to the memory it holds.

XLA's CPU compiler fuses chains of elementwise ops, data movement and reductions into
loops (`LOOP_FUSIBLE`, XLA's `CanBeLoopFused`). Three consequences are modelled here:

* `memory_traffic`: the bytes an op moves, per operand and result: a loop-fusible op
  reads a loop-fusible producer's result inside their fusion, not from memory.
* `fusion_copies`: how many times the compiled module computes each op: XLA clones cheap
  producers into every fusion that reads them, and `cost_analysis()` counts each fusion's
  instructions, while CSE merges duplicate ops and constant folding removes ops on
  constants alone. XLA's algebraic simplifier also removes some arithmetic (a multiply by
  one, an add of a literal zero, a negation it moves past a sum); that is not modelled.
* `unmaterialized_values`: the intermediates that take no memory at the peak. This model
  is narrower than the other two (`KEPT_IN_FUSION` is a subset of `LOOP_FUSIBLE`, and
  only `RECOMPUTED_PER_READER` producers may have several readers), so the peak memory
  errs towards holding a value.

One file for one model: the primitive sets and the three consequences share them, and
splitting them would put the definition of what fuses apart from what fusing does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from automap_rl.ir.flops import REDUCTIONS, TRANSCENDENTAL
from automap_rl.ir.program import FactorKind, Op, Program, Role

Shape = Sequence[int]

# -- which primitives fuse --------------------------------------------------------------

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
    "reduce_precision",
    "one_minus_square",  # jax 0.11's `1 - x**2`, lowered as `(1 + x) * (1 - x)`.
  }
)
DIVISIONS = frozenset(
  {"div", "rem"}
)  # Cheap by a literal (a multiply by its inverse), else expensive.
EXPENSIVE_ELEMENTWISE = TRANSCENDENTAL | {"logistic"}
NO_OPS = frozenset({"device_put", "sharding_constraint", "stop_gradient"})  # Gone by fusion time.
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
ELEMENTWISE = CHEAP_ELEMENTWISE | DIVISIONS | EXPENSIVE_ELEMENTWISE
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


# -- memory traffic and peak memory -----------------------------------------------------


def consumers(program: Program) -> dict[int, list[Op]]:
  """Value id -> the ops that read it, in program order, each once."""
  readers: dict[int, list[Op]] = {}
  for op in program.ops:
    for v in set(op.operands):
      readers.setdefault(v, []).append(op)
  return readers


def kernel_concatenates(program: Program) -> set[int]:
  """Ids of the concatenates XLA:CPU makes kernels of their own rather than fuse: more
  than `MAX_FUSED_CONCATENATE_OPERANDS` operands, or along the minor (last) dim with rows
  of at least `MIN_KERNEL_CONCATENATE_ROW_BYTES` and `MIN_KERNEL_CONCATENATE_BYTES` in all
  (global shapes: a shard of a value that size is that size or near it)."""
  kernels = set()
  for op in program.ops:
    if op.primitive != "concatenate":
      continue
    result, first = program.values[op.results[0]], program.values[op.operands[0]]
    minor = (
      len(result.shape) > 1
      and result.shape[-1] != first.shape[-1]
      and result.shape[-1] * result.itemsize >= MIN_KERNEL_CONCATENATE_ROW_BYTES
      and result.nbytes >= MIN_KERNEL_CONCATENATE_BYTES
    )
    if minor or len(op.operands) > MAX_FUSED_CONCATENATE_OPERANDS:
      kernels.add(op.id)
  return kernels


def memory_traffic(
  program: Program, multi_output_fusion: bool = True, minor_concatenate_fusion: bool = True
) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
  """Bytes each op reads of each operand and writes of each result once XLA has fused
  loop-fusible chains (elementwise ops, data movement, reductions): a loop-fusible op
  reads an operand that a loop-fusible op produced from the fusion, not from memory, and
  writes a result that only loop-fusible ops read (and the program does not return) into
  it. A loop
  iteration's `scan_slice` reads its slice of the stacked input, not the whole stack (a
  dynamic-slice), and its `scan_stack` writes its slice of the stacked output in place (a
  dynamic-update-slice). Likewise outside loops: a slice or dynamic slice reads the
  elements it keeps, not its whole operand, and a dynamic-update-slice updates its
  operand's buffer in place (it reads nothing of it and writes the update). A reduction
  ends its fusion: its result goes through memory, and a value it reads that another op
  reads too (a normalization's input, read for its statistics and to be normalized) is
  written once and read by each. Dots, convolutions, and everything else read and write
  their values whole; a fusion reads each of its inputs once (an argument that several of
  its ops read, `x * x`). Without `multi_output_fusion` (XLA:CPU), a loop-fusible result
  that is written anyway (returned, or read by an op that does not fuse) ends its fusion,
  and the fusions that read it read it from memory. Without `minor_concatenate_fusion`
  (XLA:CPU), a `kernel_concatenates` concatenate fuses with nothing: it reads its
  operands from memory and writes its result. Per op, `(bytes read per operand, bytes
  written per result)`."""
  producer = {v: op for op in program.ops for v in op.results}
  readers = consumers(program)
  outputs = set(program.outputs)
  kernels = set() if minor_concatenate_fusion else kernel_concatenates(program)
  fused = lambda op: op is not None and op.primitive in LOOP_FUSIBLE and op.id not in kernels
  reduction = lambda op: op is not None and op.primitive in FUSED_REDUCTIONS
  materialized = {
    v
    for v, ops in readers.items()
    if reduction(producer.get(v)) or (len(ops) > 1 and any(reduction(r) for r in ops))
  }
  ends = (
    materialized
    if multi_output_fusion
    else materialized
    | {v for v in producer if v in outputs or any(not fused(c) for c in readers.get(v, ()))}
  )
  inside = lambda op, v: (
    fused(op) and fused(producer.get(v)) and v not in ends
  )  # Read in its fusion.
  fusion = list(range(program.num_ops))  # Union-find over the fused producer-consumer pairs.

  def root(o: int) -> int:
    while fusion[o] != o:
      fusion[o] = fusion[fusion[o]]
      o = fusion[o]
    return o

  for op in program.ops:
    for v in op.operands:
      if inside(op, v):
        fusion[root(op.id)] = root(producer[v].id)
  read_by_fusion: set[tuple[int, int]] = set()
  out = []
  for op in program.ops:
    read_bytes = [float(program.values[v].nbytes) for v in op.operands]
    write_bytes = [float(program.values[v].nbytes) for v in op.results]
    if op.primitive == "scan_slice":  # Reads its slice of the stack, writes the slice.
      out.append(((write_bytes[0],) + (0.0,) * (len(read_bytes) - 1), tuple(write_bytes)))
      continue
    if op.primitive == "scan_stack":  # Reads the slice, writes it into the stack.
      out.append(
        (
          (read_bytes[0],) + (0.0,) * (len(read_bytes) - 1),
          (read_bytes[0],) + (0.0,) * (len(write_bytes) - 1),
        )
      )
      continue
    if op.primitive in SLICES:
      read_bytes[0] = write_bytes[0]
    elif op.primitive == "dynamic_update_slice":
      read_bytes[0], write_bytes[0] = 0.0, read_bytes[1]
    reads = []
    for v, b in zip(op.operands, read_bytes):
      once = (root(op.id) if fused(op) else -1 - op.id, v)  # A fusion reads each input once.
      reads.append(0.0 if inside(op, v) or once in read_by_fusion else b)
      read_by_fusion.add(once)
    writes = tuple(
      0.0
      if (
        fused(op)
        and v not in outputs
        and readers.get(v)
        and v not in materialized
        and all(fused(c) for c in readers[v])
      )
      else b
      for v, b in zip(op.results, write_bytes)
    )
    out.append((tuple(reads), writes))
  return out


def unmaterialized_values(program: Program) -> set[int]:
  """Intermediates XLA never materialises: results of `KEPT_IN_FUSION` ops outside loop
  bodies read by one op that fuses them (`READS_INSIDE_FUSION`), or by several such ops
  when each recomputes them (`RECOMPUTED_PER_READER`: broadcasts, reshapes, converts).
  They live in registers inside a fusion, so they do not count towards peak memory."""
  readers = consumers(program)
  keep = set(program.outputs) | set(program.inputs)
  fused = set()
  for op in program.ops:
    if op.primitive not in KEPT_IN_FUSION or op.scope:
      continue
    for v in op.results:
      primitives = [c.primitive for c in readers.get(v, ())]
      if (
        v not in keep
        and primitives
        and set(primitives) <= READS_INSIDE_FUSION
        and (len(primitives) == 1 or op.primitive in RECOMPUTED_PER_READER)
      ):
        fused.add(v)
  return fused


# -- how often an op is computed -------------------------------------------------------
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


def _expensive(op: Op) -> bool:
  """Worth materialising rather than recomputing (`CpuInstructionFusion::IsExpensive`)."""
  if op.primitive in DIVISIONS:
    return (
      len(op.operands) > 1
    )  # Literals are dropped: one operand left is a division by a literal.
  return op.primitive not in CHEAP_ELEMENTWISE and (
    op.primitive not in MOVEMENT or op.primitive == "gather"
  )


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
    key = (
      op.primitive,
      operands,
      tuple((program.values[v].shape, program.values[v].dtype) for v in op.results),
      op.rule,
      op.flops,
      op.scope,
    )
    if key in first:
      merged.add(op.id)
      canon.update(zip(op.results, first[key].results))
    else:
      first[key] = op
  return canon, frozenset(merged)


def constant_ops(program: Program) -> frozenset[int]:
  """Ops that read only constants and literals (transitively): XLA folds them, or sinks
  them into the broadcast of a scalar (the seed of a gradient and what follows it)."""
  constant = {v.id for v in program.values if v.role == Role.CONSTANT}
  folded = set()
  for op in program.ops:
    if all(v in constant for v in op.operands) and not op.scope:
      folded.add(op.id)
      constant.update(op.results)
  return frozenset(folded)


def dead_ops(program: Program) -> frozenset[int]:
  """Ops whose results reach none of the program's outputs (a loop carry reaches them
  through its tie): XLA's dead-code elimination removes them (a model that computes an
  aggregation twice and uses one)."""
  live_values, live_ops = set(program.outputs), set()
  tied = {}
  for a, b in program.ties:
    tied.setdefault(a, []).append(b)
    tied.setdefault(b, []).append(a)
  changed = True
  while changed:
    changed = False
    for op in reversed(program.ops):
      if op.id not in live_ops and any(v in live_values for v in op.results):
        live_ops.add(op.id)
        live_values.update(op.operands)
        changed = True
    for v in [v for v in live_values if v in tied]:
      new = [u for u in tied.pop(v) if u not in live_values]
      live_values.update(new)
      changed |= bool(new)
  return frozenset(range(program.num_ops)) - live_ops


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
  None when it reads the operand as it is (see "how often an op is computed" above)."""
  roles = _dim_roles(op, index)
  dims = tuple(d for d, role in enumerate(roles) if role is not None)
  if op.primitive == "dot_general":
    batch, free, contract = (
      tuple(d for d in dims if roles[d] == role) for role in ("batch", "free", "contract")
    )
    if (
      len(roles) <= len(batch) + 2
      and dims[: len(batch)] == batch
      and len(free) <= 1
      and len(contract) <= 1
    ):
      return None  # Canonical; size-1 dims count towards the rank, not towards the layout.
    return (
      (batch, free, contract) if index == 0 else (batch, contract, free)
    )  # [b, m, k] and [b, k, n].
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


def _op_reuses(
  op: Op, operands: Sequence[int], shapes: Sequence[Shape], producer: Mapping[int, int]
) -> frozenset[int]:
  """Producers whose elements `op` reads more than once: all of a broadcast's, and for an
  elementwise op those of operands of another shape (implicit broadcasts)."""
  if op.primitive in ELEMENTWISE:
    out = shapes[op.results[0]]
    return frozenset(producer[v] for v in op.operands if v in producer and shapes[v] != out) & set(
      operands
    )
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
  large = {
    v
    for v in op.operands
    if v not in broadcasts
    and _true_rank(shapes[v]) >= _true_rank(out)
    and not (op.primitive in ELEMENTWISE and shapes[v] != out)
  }
  return len(large) <= 1


def _edges(
  program: Program, canon: Mapping[int, int], producer: Mapping[int, int], skip: AbstractSet[int]
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
      layout = (
        _contraction_layout(op, index)
        if op.primitive in ("dot_general", "conv_general_dilated")
        else None
      )
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
  folded = constant_ops(program)
  skip = merged | folded
  producer = {v: op.id for op in ops if op.id not in skip for v in op.results}
  producer.update({v: producer[c] for v, c in canon.items() if c in producer})
  operands, pinned = _edges(program, canon, producer, skip)
  users: list[set[int]] = [set() for _ in operands]
  for node, mine in enumerate(operands):
    for p in mine:
      users[p].add(node)
  broadcasts = {
    v
    for op in ops
    if op.id in folded or op.primitive in ("broadcast_in_dim", "iota")
    for v in op.results
  }
  size = [math.prod(s) for s in shapes]
  layouts = len(operands) - len(ops)
  return _Graph(
    operands=operands,
    users=users,
    pinned=pinned,
    fusible=[op.primitive in LOOP_FUSIBLE for op in ops] + [True] * layouts,
    expensive=[_expensive(op) for op in ops] + [False] * layouts,
    reduction=[op.primitive in FUSED_REDUCTIONS for op in ops] + [False] * layouts,
    reuses=[_op_reuses(op, operands[op.id], shapes, producer) for op in ops]
    + [frozenset()] * layouts,
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
    if (
      not graph.live[op.id]
      or op.id in taken
      or op.primitive not in LIBRARY_REDUCTIONS
      or "float" not in program.values[op.results[0]].dtype
      or max(math.prod(shapes[v]) for v in (*op.operands, *op.results)) < LIBRARY_MIN_ELEMENTS
    ):
      continue
    members, frontier = {op.id}, [op.id]
    while frontier:
      for p in graph.operands[frontier.pop()]:
        if (
          p < len(ops)
          and p not in members
          and p not in taken
          and not graph.pinned[p]
          and ops[p].primitive in LIBRARY_PRODUCERS
          and graph.users[p] <= members
        ):
          members.add(p)
          frontier.append(p)
    outside = list(
      dict.fromkeys(
        p for m in sorted(members, reverse=True) for p in graph.operands[m] if p not in members
      )
    )
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
  return graph.fusible[producer] and not (
    graph.expensive[producer] and (duplicates or producer in reused)
  )


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
        if position[o] >= position[producer] and reach[producer] >> position[o] & 1
      )
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
    candidates = sorted(
      (p for p in graph.operands[consumer] if p in queued), key=priority.get, reverse=True
    )
    for producer in candidates:
      duplicates = len(graph.users[producer]) > 1 or graph.pinned[producer]
      if (
        producer in unfusible
        or not _may_fuse(graph, producer, reused[consumer], duplicates)
        or (graph.reduction[producer] and reductions[consumer] > MAX_FUSED_REDUCTIONS)
      ):
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
  fusion XLA clones it into, less one if it is not left standing on its own (see "how
  often an op is computed" above).

  Args:
    program: the traced program.
    shapes: per value, its per-device shape under a plan (default: the global shapes).
      Layout and library decisions depend on sizes.
  """
  shapes = [v.shape for v in program.values] if shapes is None else shapes
  graph = _graph(program, shapes)
  _library_fusions(program, graph, shapes)
  _fuse(graph, _globally_unfusible(graph))
  return tuple(graph.copies[: graph.num_ops])
