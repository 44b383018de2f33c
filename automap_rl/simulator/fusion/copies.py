"""How often XLA's compiled CPU module computes each op (`fusion_copies`): CSE, constant
folding, dead-code elimination, contraction layouts, library fusions and instruction
fusion's cloning of producers into their consumers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from automap_rl.ir.program import FactorKind, Op, Program, Role
from automap_rl.simulator.fusion.primitives import (
  CHEAP_ELEMENTWISE,
  DIVISIONS,
  ELEMENTWISE,
  FUSED_REDUCTIONS,
  LIBRARY_MIN_ELEMENTS,
  LIBRARY_PRODUCERS,
  LIBRARY_REDUCTIONS,
  LOOP_FUSIBLE,
  MAX_FUSED_REDUCTIONS,
  MOVEMENT,
  PERMUTING,
)

Shape = Sequence[int]

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


def cloned_though_written(program: Program) -> frozenset[int]:
  """Ops XLA:CPU's instruction fusion clones into every fusible reader even where their
  result is written for an output or for a reader that does not fuse (a convolution's
  input): cheap (`IsExpensive` false), and effectively at most unary or reading no more
  elements than they write; a written op is read on some path that does not fuse, so
  `ComputeGloballyUnfusible` forbids cloning the others. A residual stream's `relu(y + x)`
  is one: each block's fusion computes it again from the block before's inputs."""
  shapes = [v.shape for v in program.values]
  broadcasts = _broadcast_values(program, constant_ops(program))
  return frozenset(
    op.id
    for op in program.ops
    if op.results
    and op.primitive in LOOP_FUSIBLE
    and not _expensive(op)
    and (_op_unary(op, shapes, broadcasts) or _op_grows(op, shapes))
  )


def _op_grows(op: Op, shapes: Sequence[Shape]) -> bool:
  """Its operands have at most as many elements as its results."""
  size = lambda values: sum(math.prod(shapes[v]) for v in values)
  return size(set(op.operands)) <= size(op.results)


def _broadcast_values(program: Program, folded: AbstractSet[int]) -> set[int]:
  """Values of broadcasts, iotas and `folded` (constant) ops: not large operands of an
  effectively unary op (`_op_unary`)."""
  return {
    v
    for op in program.ops
    if op.id in folded or op.primitive in ("broadcast_in_dim", "iota")
    for v in op.results
  }


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
  broadcasts = _broadcast_values(program, folded)
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
    grows=[_op_grows(op, shapes) for op in ops] + [True] * layouts,
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
