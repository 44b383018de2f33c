"""Flops and bytes accessed of a compiled module's kernels and of what `cost_analysis()`
counts otherwise than the module runs (loop iterations, conditional branches).

`kernel_costs` lists the `(flops, bytes)` of every kernel the module runs per step: each
instruction of a computation that is not a fusion's body (the entry, loop bodies and
conditions, called computations and branches), times how often that computation runs,
its flops those of its fused computation; collectives and control flow are not kernels.
A roofline prices each kernel at the larger of its flop time and its memory time, as the
simulator prices its ops.

`cost_analysis()` counts a while body once and of a conditional its largest branch.
`uncounted_cost` adds, for each computation, (its runs - the times `cost_analysis()`
counts it) times its flops and bytes (a loop's other iterations; a conditional's other
branches where they run, less the largest where it does not), counted from the HLO text for the
instructions that carry nearly all of them (flops: dots, convolutions, reductions and
elementwise arithmetic, not transcendentals, which XLA counts apart; bytes: operands and
result of every unfused instruction) with `HloCostAnalysis`'s conventions, except for
convolutions: `instruction_flops` counts every kernel tap, where `HloCostAnalysis` leaves
out the taps that land on padding or on the holes of an lhs dilation (as
`automap_rl.ir.flops.conv_flops` does), so a padded convolution inside a loop counts
more flops here than XLA's own count of the same instruction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from automap_rl.xla.hlo.collectives import COLLECTIVE_KINDS
from automap_rl.xla.hlo.module import (
  Instruction,
  Module,
  branches,
  called_computations,
  parse_shapes,
  shape_bytes,
)

_CONTRACTING_RE = re.compile(r"\blhs_contracting_dims=\{(?P<dims>[\d,]*)\}")
_DIM_LABELS_RE = re.compile(r"\bdim_labels=[^_]+_(?P<rhs>[^-]+)->")
# Opcodes `HloCostAnalysis` charges one flop per result element (transcendentals
# such as exp and tanh are counted apart, not as flops).
_ELEMENTWISE_FLOPS = frozenset(
  {
    "add",
    "subtract",
    "multiply",
    "divide",
    "maximum",
    "minimum",
    "negate",
    "abs",
    "compare",
    "select",
    "and",
    "or",
    "xor",
    "not",
    "sign",
    "floor",
    "ceil",
    "clamp",
    "remainder",
  }
)


def instruction_flops(inst: Instruction, types: Mapping[str, str]) -> float:
  """Flops of one instruction as `HloCostAnalysis` counts them, for dots,
  reductions and elementwise arithmetic, and for convolutions every kernel tap
  (`HloCostAnalysis` leaves out the taps on padding, see the module docstring);
  0 for anything else (fusions count through their computations)."""
  result = parse_shapes(inst.type)
  if not result:
    return 0.0
  elements = math.prod(result[0][1])
  if inst.opcode == "dot":
    lhs = parse_shapes(types[inst.operands[0]])[0][1]
    dims = _CONTRACTING_RE.search(inst.attrs)
    contracted = math.prod(lhs[int(d)] for d in dims["dims"].split(",") if d) if dims else 1
    return 2.0 * elements * contracted
  if inst.opcode == "convolution":
    kernel = parse_shapes(types[inst.operands[1]])[0][1]
    labels = _DIM_LABELS_RE.search(inst.attrs)
    out_features = kernel[labels["rhs"].index("o")] if labels else 1
    return 2.0 * elements * math.prod(kernel) / out_features
  if inst.opcode == "reduce":
    return float(math.prod(parse_shapes(types[inst.operands[0]])[0][1]))
  return float(elements) if inst.opcode in _ELEMENTWISE_FLOPS else 0.0


# Instructions that move no data of their own (`HloCostAnalysis` charges them no bytes).
_FREE_OPCODES = frozenset(
  {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
  }
)


def _read_fraction(inst: Instruction, operand: int, types: Mapping[str, str]) -> float:
  """The fraction of operand `operand` that `inst` reads: what a (dynamic-)slice keeps
  of its sliced operand, else all of it."""
  if inst.opcode not in ("slice", "dynamic-slice") or operand != 0:
    return 1.0
  elements = lambda type_text: math.prod(parse_shapes(type_text)[0][1])
  return elements(inst.type) / max(elements(types[inst.operands[0]]), 1)


def _parameter_utilization(
  body: Sequence[Instruction], types: Mapping[str, str]
) -> dict[str, float]:
  """The fraction of each parameter of a fused computation that it reads, propagated
  from the root as `HloCostAnalysis` does: a (dynamic-)slice reads the fraction of its
  operand that it keeps, any other instruction as much of its operands as is used of it
  (so a slice of a transposed, copied or elementwise-computed parameter reads only its
  share), users add up, at most 1."""
  used = {body[-1].name: 1.0}
  for inst in reversed(body):
    if inst.opcode in ("parameter", "constant"):
      continue
    share = used.get(inst.name, 0.0)
    for i, name in enumerate(inst.operands):
      used[name] = min(1.0, used.get(name, 0.0) + share * _read_fraction(inst, i, types))
  return {i.name: used.get(i.name, 0.0) for i in body if i.opcode == "parameter"}


def instruction_bytes(
  inst: Instruction, types: Mapping[str, str], bodies: Mapping[str, Sequence[Instruction]]
) -> float:
  """Bytes an unfused instruction reads and writes, as `HloCostAnalysis` counts a
  fusion from its boundary: its operands and its result, except that a (dynamic) slice
  reads only what it keeps, a fusion operand counts only the fraction its computation
  reads (`_parameter_utilization`: a slice of it, even through a transpose or
  elementwise ops), and a dynamic-update-slice, or a fusion whose root updates a
  parameter in place, counts the update twice instead of the whole buffer in and out."""
  if inst.opcode in _FREE_OPCODES:
    return 0.0
  operand_bytes = [
    shape_bytes(types[name]) * _read_fraction(inst, i, types) if name in types else 0
    for i, name in enumerate(inst.operands)
  ]
  result_bytes = shape_bytes(inst.type)
  if inst.opcode == "dynamic-update-slice":  # In place: the update read and written.
    operand_bytes[0], result_bytes = 0, shape_bytes(types[inst.operands[1]])
  fused = called_computations(inst) if inst.opcode == "fusion" else ()
  body = next((bodies.get(callee, ()) for callee, _ in fused), ())
  params = {i.name: int(i.operands[0]) for i in body if i.opcode == "parameter" and i.operands}
  if body:
    for name, used in _parameter_utilization(body, types).items():
      operand_bytes[params[name]] *= used
  root = body[-1] if body else None
  if root is not None and root.opcode == "dynamic-update-slice" and root.operands[0] in params:
    update = 2 * shape_bytes(types[root.operands[1]])
    operand_bytes[params[root.operands[0]]] = 0
    result_bytes = update
  return float(result_bytes + sum(operand_bytes))


def _fused_computations(bodies: Mapping[str, Sequence[Instruction]]) -> set[str]:
  """The computations that are a fusion's body."""
  return {
    callee
    for body in bodies.values()
    for inst in body
    if inst.opcode == "fusion"
    for callee, _ in called_computations(inst)
  }


def _is_kernel(inst: Instruction) -> bool:
  """Whether `inst` runs a kernel of its own: not a collective (its `-start` or `-done`
  either), not control flow, not an instruction that moves no data."""
  base = inst.opcode.removesuffix("-start").removesuffix("-done")
  return inst.opcode not in _FREE_OPCODES and base not in COLLECTIVE_KINDS


def kernel_costs(module: Module) -> tuple[tuple[float, float], ...]:
  """`(flops, bytes accessed)` per step of each kernel of `module` (see the module
  docstring), in text order of the computations; a looped kernel's figures are its trip
  count times one run's."""
  bodies, types = module.bodies, module.types
  fused = _fused_computations(bodies)
  kernels = []
  for name, body in bodies.items():
    runs = module.repeats.get(name, 0)
    if name in fused or runs == 0:
      continue
    for inst in body:
      if not _is_kernel(inst):
        continue
      flops = instruction_flops(inst, types)
      if inst.opcode == "fusion":
        flops += sum(
          instruction_flops(i, types)
          for callee, _ in called_computations(inst)
          for i in bodies.get(callee, ())
        )
      kernels.append((runs * flops, runs * instruction_bytes(inst, types, bodies)))
  return tuple(kernels)


def _own_costs(module: Module) -> dict[str, tuple[float, float]]:
  """Per computation, `(flops, bytes)` of its own instructions as counted from the text
  (bytes only of a computation that is not a fusion's body)."""
  bodies, types = module.bodies, module.types
  fused = _fused_computations(bodies)
  return {
    name: (
      sum(instruction_flops(inst, types) for inst in body),
      0.0 if name in fused else sum(instruction_bytes(inst, types, bodies) for inst in body),
    )
    for name, body in bodies.items()
  }


def analysis_counts(module: Module, own: Mapping[str, float]) -> dict[str, int]:
  """How many times `cost_analysis()` counts each computation's cost `own` (one of its
  properties): the entry once, every computation its instructions call once per count
  of its caller (a while body once, not per iteration), and of a conditional only the
  branch whose cost, with what it calls, is largest (`HloCostAnalysis` takes the
  largest branch's, property by property)."""
  bodies, totals = module.bodies, {}

  def total(name: str) -> float:
    if name not in totals:
      totals[name] = own.get(name, 0.0) + sum(
        max(map(total, branches(inst)), default=0.0)
        if inst.opcode == "conditional"
        else sum(total(callee) for callee, _ in called_computations(inst))
        for inst in bodies.get(name, ())
      )
    return totals[name]

  counts = dict.fromkeys(bodies, 0)

  def count(name: str) -> None:
    counts[name] = counts.get(name, 0) + 1
    for inst in bodies.get(name, ()):
      if inst.opcode == "conditional" and (names := branches(inst)):
        count(max(names, key=total))
      else:
        for callee, _ in called_computations(inst):
          count(callee)

  count(module.entry)
  return counts


def uncounted_cost(module: Module) -> tuple[float, float]:
  """`(flops, bytes accessed)` that `cost_analysis()` leaves out of the runs of
  `module.repeats`, less what it counts that does not run: for every computation,
  (its runs - the times `cost_analysis()` counts it, `analysis_counts`) times its
  instructions' flops, and for the unfused ones their bytes. A loop's iterations after
  the first add; of a conditional, the branches that run add, and the branch
  `cost_analysis()` counted but a device does not run (`Taken`) subtracts."""
  own = _own_costs(module)
  totals = []
  for prop in (0, 1):
    cost = {name: costs[prop] for name, costs in own.items()}
    counted = analysis_counts(module, cost)
    totals.append(
      sum((module.repeats.get(name, 0) - counted.get(name, 0)) * c for name, c in cost.items())
    )
  return totals[0], totals[1]
