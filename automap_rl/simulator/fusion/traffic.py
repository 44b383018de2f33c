"""The memory an op moves and holds once XLA has fused loop-fusible chains: bytes read and
written per operand and result (`memory_traffic`), and the intermediates that take no
memory at the peak (`unmaterialized_values`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Set as AbstractSet

from automap_rl.ir.program import Op, Program
from automap_rl.simulator.fusion.copies import cloned_though_written
from automap_rl.simulator.fusion.primitives import (
  EXPENSIVE_ELEMENTWISE,
  FUSED_REDUCTIONS,
  KEPT_IN_FUSION,
  LOOP_FUSIBLE,
  MAX_FUSED_CONCATENATE_OPERANDS,
  MIN_KERNEL_CONCATENATE_BYTES,
  MIN_KERNEL_CONCATENATE_ROW_BYTES,
  READS_INSIDE_FUSION,
  RECOMPUTED_PER_READER,
  SLICES,
)


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


@dataclasses.dataclass
class _LoopFusions:
  """The loop fusions of a program (`memory_traffic`): which ops fuse, which values end a
  fusion, and a union-find over the fused producer-consumer pairs.

  Attributes:
    producer: value id -> the op that makes it.
    readers: value id -> the ops that read it (`consumers`).
    outputs: the program's outputs.
    kernels: the concatenates that fuse with nothing (`kernel_concatenates`).
    materialized: values a reduction makes, or reads beside other readers.
    ends: values that end their fusion (with `multi_output_fusion` off, also those
      written anyway whose producer is not cloned into its readers,
      `copies.cloned_though_written`).
    fusion: the union-find's parent of each op.
  """

  producer: dict[int, Op]
  readers: dict[int, list[Op]]
  outputs: set[int]
  kernels: set[int]
  materialized: set[int]
  ends: set[int]
  fusion: list[int]

  @classmethod
  def of(
    cls, program: Program, multi_output_fusion: bool, minor_concatenate_fusion: bool
  ) -> _LoopFusions:
    producer = {v: op for op in program.ops for v in op.results}
    readers = consumers(program)
    outputs = set(program.outputs)
    kernels = set() if minor_concatenate_fusion else kernel_concatenates(program)
    reduction = lambda op: op is not None and op.primitive in FUSED_REDUCTIONS
    materialized = {
      v
      for v, ops in readers.items()
      if reduction(producer.get(v)) or (len(ops) > 1 and any(reduction(r) for r in ops))
    }
    loops = cls(producer, readers, outputs, kernels, materialized, materialized, [])
    if not multi_output_fusion:
      cloned = cloned_though_written(program)
      loops.ends = materialized | {
        v
        for v, op in producer.items()
        if op.id not in cloned
        and (v in outputs or any(not loops.fused(c) for c in readers.get(v, ())))
      }
    loops.fusion = list(range(program.num_ops))
    for op in program.ops:
      for v in op.operands:
        if loops.inside(op, v):
          loops.fusion[loops.root(op.id)] = loops.root(producer[v].id)
    return loops

  def fused(self, op: Op | None) -> bool:
    """Whether `op` fuses into loops (a loop-fusible op, not a kernel concatenate)."""
    return op is not None and op.primitive in LOOP_FUSIBLE and op.id not in self.kernels

  def inside(self, op: Op, v: int) -> bool:
    """Whether `op` reads value `v` inside its fusion."""
    return self.fused(op) and self.fused(self.producer.get(v)) and v not in self.ends

  def root(self, o: int) -> int:
    """The fusion op `o` is in (its union-find root)."""
    fusion = self.fusion
    while fusion[o] != o:
      fusion[o] = fusion[fusion[o]]
      o = fusion[o]
    return o


def transposed_convolution_operands(op: Op) -> tuple[bool, bool]:
  """Whether a convolution's input and kernel are out of the canonical layout XLA:CPU
  runs convolutions in (input [batch, spatial..., features], kernel [spatial..., input
  features, output features]), read off its rule: the batch is the factor the input
  shares with the result alone, the input features the factor it shares with the kernel,
  the output features the one the kernel shares with the result. The forward convolution
  of an NHWC / HWIO step is canonical; its kernel gradient (the batch contracted) has
  both operands transposed, its input gradient the kernel. (A result out of the layout
  is not transposed: layout assignment hands its readers the layout it has.)"""
  (lhs, rhs), (out,) = op.rule.operand_dims, op.rule.result_dims
  factors = lambda dims: {f for dim in dims for f in dim}
  in_lhs, in_rhs, in_out = factors(lhs), factors(rhs), factors(out)
  batch = (in_lhs & in_out) - in_rhs
  in_features, out_features = (in_lhs & in_rhs) - in_out, (in_rhs & in_out) - in_lhs
  holds = lambda dim, wanted: bool(set(dim) & wanted)
  return (
    not (holds(lhs[0], batch) and holds(lhs[-1], in_features)),
    not (holds(rhs[-2], in_features) and holds(rhs[-1], out_features)),
  )


def memory_traffic(
  program: Program,
  multi_output_fusion: bool = True,
  minor_concatenate_fusion: bool = True,
  on_chip: AbstractSet[int] = frozenset(),
  canonical_convolutions: bool = False,
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
  and the fusions that read it read it from memory, unless XLA clones its producer into
  them (`copies.cloned_though_written`: a residual stream's `relu(y + x)`, which each
  fusion that reads it computes again); and each written result roots a fusion of its own
  that reads its inputs (`_single_output_reads`). Without `minor_concatenate_fusion`
  (XLA:CPU), a `kernel_concatenates` concatenate fuses with nothing: it reads its
  operands from memory and writes its result. With `canonical_convolutions` (XLA:CPU), a
  convolution's input or kernel out of the canonical layout
  (`transposed_convolution_operands`) is transposed by a kernel of its own, once per value
  and operand: it is written once more, and read, or computed again from its producer's
  inputs where the producer is cloned into its readers. Values in `on_chip` (a fused
  kernel's intermediates, `fusion.kernel_intermediates`) are neither written nor read. An
  op that computes again what an earlier one did (`Op.same_as`) moves nothing: XLA's
  common subexpression elimination leaves the earlier one's results, read by both ops'
  readers. Per op, `(bytes read per operand, bytes written per result)`."""
  unique = _without_repeats(program)
  traffic = _fused_traffic(
    unique, multi_output_fusion, minor_concatenate_fusion, on_chip, canonical_convolutions
  )
  return [
    ((0.0,) * len(op.operands), (0.0,) * len(op.results)) if op.same_as >= 0 else moved
    for op, moved in zip(program.ops, traffic)
  ]


def _without_repeats(program: Program) -> Program:
  """`program` with each op that computes again what an earlier one did (`Op.same_as`)
  reading and making nothing, and every read of its results (and the program's outputs
  among them) a read of the earlier op's."""
  same: dict[int, int] = {}
  for op in program.ops:
    if op.same_as >= 0:
      for result, earlier in zip(op.results, program.ops[op.same_as].results):
        same[result] = same.get(earlier, earlier)
  if not same:
    return program
  ops = tuple(
    dataclasses.replace(op, primitive="", operands=(), results=())
    if op.same_as >= 0
    else dataclasses.replace(op, operands=tuple(same.get(v, v) for v in op.operands))
    if any(v in same for v in op.operands)
    else op
    for op in program.ops
  )
  outputs = tuple(same.get(v, v) for v in program.outputs)
  return dataclasses.replace(program, ops=ops, outputs=outputs)


def _fused_traffic(
  program: Program,
  multi_output_fusion: bool,
  minor_concatenate_fusion: bool,
  on_chip: AbstractSet[int],
  canonical_convolutions: bool,
) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
  """`memory_traffic` of a program without repeated ops (`_without_repeats`)."""
  loops = _LoopFusions.of(program, multi_output_fusion, minor_concatenate_fusion)
  fused, inside, root = loops.fused, loops.inside, loops.root
  readers, outputs, materialized = loops.readers, loops.outputs, loops.materialized
  read_by_fusion: set[tuple[int, int]] = set()
  own_reads: dict[int, list[float]] = {}  # What each op reads of each operand, unfused.
  transposes: dict[tuple[int, int], int] = {}  # (value, operand index) -> first conv reading it.
  out = []
  for op in program.ops:
    read_bytes = [0.0 if v in on_chip else float(program.values[v].nbytes) for v in op.operands]
    write_bytes = [0.0 if v in on_chip else float(program.values[v].nbytes) for v in op.results]
    if op.primitive == "scan_slice":  # Reads its slice of the stack, writes the slice.
      own_reads[op.id] = [write_bytes[0]] + [0.0] * (len(read_bytes) - 1)
      out.append((tuple(own_reads[op.id]), tuple(write_bytes)))
      continue
    if op.primitive == "scan_stack":  # Reads the slice, writes it into the stack.
      own_reads[op.id] = [read_bytes[0]] + [0.0] * (len(read_bytes) - 1)
      out.append(
        (
          tuple(own_reads[op.id]),
          (read_bytes[0],) + (0.0,) * (len(write_bytes) - 1),
        )
      )
      continue
    if op.primitive in SLICES:
      read_bytes[0] = write_bytes[0]
    elif op.primitive == "dynamic_update_slice":
      read_bytes[0], write_bytes[0] = 0.0, read_bytes[1]
    own_reads[op.id] = read_bytes
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
    if canonical_convolutions and op.primitive == "conv_general_dilated":
      for i, (v, t) in enumerate(zip(op.operands, transposed_convolution_operands(op))):
        if t and (v, i) not in transposes:  # One transpose of a value to one layout.
          transposes[v, i] = op.id
          reads[i] += 2.0 * read_bytes[i]
    out.append((tuple(reads), writes))
  if not multi_output_fusion:
    out = _single_output_reads(program, loops, own_reads, out, transposes)
  return out


def _single_output_reads(
  program: Program,
  loops: _LoopFusions,
  own_reads: dict[int, list[float]],
  traffic: list[tuple[tuple[float, ...], tuple[float, ...]]],
  transposes: dict[tuple[int, int], int],
) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
  """`traffic` with the reads of loop fusions that have one output each (no multi-output
  fusion, XLA:CPU): a fused op whose result is written roots a fusion of its own, into
  which the cheap fused ops it reads are duplicated; one that two fusions would compute
  is written once and read by each instead where it is expensive
  (`EXPENSIVE_ELEMENTWISE`: a transcendental) or one of them is a reduction's. A fusion
  reads each value from outside it once, so a value two fusions read is read by each.
  A convolution operand's transpose (`transposes`: (value, operand index) -> the
  convolution charged for it) is a fusion too: where the value's producer is cloned into
  its readers, it computes the value again from the producer's inputs. `own_reads`
  [op id] are an op's reads of its operands."""

  writes = [list(w) for _, w in traffic]
  reads_out = [list(r) for r, _ in traffic]
  transposing: dict[int, set[int]] = {}  # Producer op id -> the transposes reading it.
  for k, (v, _) in enumerate(transposes):
    if loops.fused(loops.producer.get(v)):
      transposing.setdefault(loops.producer[v].id, set()).add(-1 - k)
  roots = [op for op in program.ops if loops.fused(op) and any(writes[op.id])]
  # Which fusions would compute each fused op (up to two of them, and whether one is a
  # reduction's), readers before producers: an op that two would compute is written once
  # instead where it is expensive or one of them is a reduction's, and then its own
  # fusion alone computes what it reads.
  root_ids = {op.id for op in roots}
  computing: dict[int, tuple[frozenset[int], bool]] = {}
  for op in reversed(program.ops):
    if not loops.fused(op):
      continue
    ids, reduction = set(), False
    for v in op.results:
      for reader in loops.readers.get(v, ()):
        if reader.id in computing and loops.inside(reader, v):
          ids |= computing[reader.id][0]
          reduction |= computing[reader.id][1]
    if op.id in root_ids:  # Written; the fusions that read it clone it, but a reduction's.
      if reduction:
        loops.ends.update(op.results)
        ids = set()
      else:
        ids |= transposing.get(op.id, set())
      computing[op.id] = (frozenset(sorted(ids | {op.id})[:2]), op.primitive in FUSED_REDUCTIONS)
      continue
    if (
      len(ids) > 1
      and op.primitive not in RECOMPUTED_PER_READER
      and (op.primitive in EXPENSIVE_ELEMENTWISE or reduction)
    ):
      loops.ends.update(op.results)  # Written once, read by each fusion.
      writes[op.id] = [float(program.values[v].nbytes) for v in op.results]
      roots.append(op)
      root_ids.add(op.id)
      ids, reduction = {op.id}, op.primitive in FUSED_REDUCTIONS
    computing[op.id] = (frozenset(sorted(ids)[:2]), reduction)
  # Each fusion: the fused ops it computes, back from its root, and its reads of the
  # values from outside it, each once.
  reads = {op.id: [0.0] * len(op.operands) for op in program.ops if loops.fused(op)}
  pulled: set[int] = set()  # Fused ops some fusion computes.
  starts = list(roots)
  for (v, i), conv in transposes.items():
    producer = loops.producer.get(v)
    if loops.fused(producer) and v not in loops.ends:  # Cloned into the transpose.
      reads_out[conv][i] -= own_reads[conv][i]
      starts.append(producer)
  for root in starts:
    from_outside, todo, seen = set(), [root], set()
    while todo:
      op = todo.pop()
      if op.id in seen:
        continue
      seen.add(op.id)
      for i, v in enumerate(op.operands):
        if loops.inside(op, v):
          todo.append(loops.producer[v])
        elif v not in from_outside:
          from_outside.add(v)
          reads[op.id][i] += own_reads[op.id][i]
    pulled |= seen
  return [
    (tuple(reads[op.id] if op.id in pulled else own), tuple(w))
    for op, own, w in zip(program.ops, reads_out, writes)
  ]


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
