"""Repeated layer stacks: what a pipeline splits into stages, found from structure.

A stack has one of two forms:

* scanned: a top-level loop (`scan`, as `nn.scan`, `hk.layer_stack` or `lax.scan` over
  stacked weights write it; its ops joined through body values and carries) whose body
  slices parameters stacked along a leading dimension, together with the loops of the
  same length that slice the same weights (the loop that differentiates it, the one that
  recomputes it under remat) and those that read constants alone (a layer's zero
  auxiliary loss, stacked). The loops' bodies run once per layer. The stack's ops are the
  loops' ops, their carries, and every op with a factor in a stacked dimension (the
  optimizer update of the stacked weights); its layer classes are the named dimensions
  of the stacked dims.
* unrolled: structural groups (`ir.dims`) of L >= 2 named dimensions, each holding dims of
  other parameters than the rest (one class per layer: the FFN hidden dims of layers 0 to
  L - 1). Groups of the same depth whose layers interleave in program order are one stack.
  Layers are numbered in the order the program first uses them; layer l's ops are the ops
  with a factor or a value dim in one of its classes.

Ops that belong to no layer (a residual-stream layer norm between two layers' matmuls,
the embedding, the loss) are not part of the stack; `automap_rl.stages` places them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from scipy.cluster.hierarchy import DisjointSet

from automap_rl.ir.dims import NamedDims
from automap_rl.ir.program import Program, Role

# `LayerStack.op_layer` of an op outside the stack, and of an op of a scanned stack (whose
# loop body runs every layer).
OUTSIDE = -2
EVERY_LAYER = -1


@dataclasses.dataclass(frozen=True, eq=False)
class LayerStack:
  """A stack of repeated layers.

  Attributes:
    scanned: whether a loop runs the layers (else one copy of the ops per layer).
    layers: the number of layers, L.
    op_layer: the layer of each op, `EVERY_LAYER` for the ops of a scanned stack,
      `OUTSIDE` for ops that belong to no layer, int [num_ops].
    layer_classes: scanned: the named dimensions of the stacked (layer) dims; unrolled:
      the classes of every layer.
    carries: scanned: the loop-body values carried from one layer to the next (the
      residual stream and, in the backward loop, its gradient); unrolled: ().
    example: a parameter dim of the stack, to name it in messages.
  """

  scanned: bool
  layers: int
  op_layer: np.ndarray
  layer_classes: tuple[int, ...]
  carries: tuple[int, ...]
  example: str

  def describe(self) -> str:
    return (
      f"{'scanned' if self.scanned else 'unrolled'} stack of {self.layers} layers ({self.example})"
    )

  def stacked_inputs(self, program: Program, named: NamedDims) -> list[int]:
    """The arguments stacked along the layers ([L, ...]: a scanned stack's weights and
    their optimizer state), by value id."""
    classes = set(self.layer_classes)
    return [
      v for v in program.inputs if program.values[v].shape and named.class_of(v, 0) in classes
    ]


def layer_stacks(program: Program, named: NamedDims) -> tuple[LayerStack, ...]:
  """The program's layer stacks, scanned ones first, each in order of its first op."""
  scanned = _scanned_stacks(program, named)
  taken = {c for stack in scanned for c in stack.layer_classes}
  unrolled = _unrolled_stacks(program, named, taken)
  first = lambda stack: int(np.flatnonzero(stack.op_layer != OUTSIDE)[0])
  return tuple(sorted(scanned, key=first)) + tuple(sorted(unrolled, key=first))


def what_is_looked_for() -> str:
  """One phrase naming what `layer_stacks` looks for, for error messages."""
  return (
    "a loop (scan) whose body slices stacked parameters, or groups of two or more "
    "per-layer parameter dimensions (unrolled repeats)"
  )


def _in_loop(scope: str) -> bool:
  return scope == "scan" or scope.startswith("scan/")


def _parameter_derived(program: Program) -> np.ndarray:
  """Values computed from parameters (and constants) alone: parameters, their casts,
  their stacks, bool [num_values]."""
  derived = np.array([v.role in (Role.PARAMETER, Role.CONSTANT) for v in program.values])
  has_parameter = np.array([v.role == Role.PARAMETER for v in program.values])
  for op in program.ops:
    if (
      op.operands
      and all(derived[v] for v in op.operands)
      and any(has_parameter[v] for v in op.operands)
    ):
      derived[list(op.results)] = True
      has_parameter[list(op.results)] = True
  return derived & has_parameter


def _scanned_stacks(program: Program, named: NamedDims) -> list[LayerStack]:
  producer = {v: op.id for op in program.ops for v in op.results}
  in_loop = np.array([_in_loop(op.scope) for op in program.ops])
  carry = (
    np.array([op.primitive == "scan_carry" for op in program.ops]) & ~in_loop
  )  # A top-level loop's carries.
  loops = DisjointSet(np.flatnonzero(in_loop | carry).tolist())
  for op in program.ops:
    for v in op.operands:
      p = producer.get(v)
      if p is not None and (
        in_loop[op.id] and (in_loop[p] or carry[p]) or carry[op.id] and in_loop[p]
      ):
        loops.merge(p, op.id)
  derived = _parameter_derived(program)
  carried_in = {a for a, _ in program.ties}
  found: list[tuple[int, set[int], set[int]]] = []  # (length, loop ops, parameters sliced)
  loose: list[
    tuple[int, set[int]]
  ] = []  # Loops that read constants alone (a layer's zero auxiliary loss).
  for members in loops.subsets():
    top = [program.ops[o] for o in sorted(members) if program.ops[o].scope == "scan"]
    repeats = {op.repeat for op in top}
    if len(repeats) != 1 or min(repeats) < 2:
      continue
    sliced = set().union(
      *(
        _sources(v, producer, program, derived)
        for op in top
        if op.primitive == "scan_slice"
        for v in op.operands
      )
    )
    if not sliced:
      if all(
        producer.get(v) in members or program.values[v].role == Role.CONSTANT
        for o in members
        for v in program.ops[o].operands
      ):
        loose.append((min(repeats), set(members)))
      continue
    # The loop that differentiates a stack (or recomputes it under remat) slices the same weights.
    same = next((entry for entry in found if entry[0] == min(repeats) and entry[2] & sliced), None)
    if same is None:
      found.append((min(repeats), set(members), sliced))
    else:
      same[1].update(members)
      same[2].update(sliced)
  for length, members in loose:
    owners = [entry for entry in found if entry[0] == length]
    if len(owners) == 1:
      owners[0][1].update(members)
  stacks = []
  for length, members, _ in found:
    top = [program.ops[o] for o in sorted(members) if program.ops[o].scope == "scan"]
    stacked = [op.operands[0] for op in top if op.primitive == "scan_slice"]
    stacked += [op.results[0] for op in top if op.primitive == "scan_stack"]
    classes = {int(named.class_of(v, 0)) for v in stacked} - {-1}
    op_layer = np.full(program.num_ops, OUTSIDE, np.int64)
    op_layer[sorted(members)] = EVERY_LAYER
    carries = []
    for op in program.ops:
      if op.id in members and carry[op.id]:
        carries += [v for v in op.results if v in carried_in]
      elif classes & set(named.op_factor_classes(op.id).tolist()):
        op_layer[op.id] = EVERY_LAYER
    example = next(
      (
        f"{program.values[v].path}:0"
        for v in program.inputs
        if program.values[v].role == Role.PARAMETER
        and program.values[v].shape
        and named.class_of(v, 0) in classes
      ),
      f"a loop of {length} iterations",
    )
    stacks.append(
      LayerStack(True, length, op_layer, tuple(sorted(classes)), tuple(carries), example)
    )
  return stacks


def _sources(
  value: int, producer: dict[int, int], program: Program, derived: np.ndarray
) -> set[int]:
  """The parameters a parameter-derived value is computed from (empty for other values)."""
  out, todo = set(), [value]
  while todo:
    v = todo.pop()
    if not derived[v]:
      continue
    if program.values[v].role == Role.PARAMETER:
      out.add(v)
    elif v in producer:
      todo.extend(program.ops[producer[v]].operands)
  return out


def _unrolled_stacks(program: Program, named: NamedDims, taken: set[int]) -> list[LayerStack]:
  parameter_classes: dict[int, set[int]] = {}  # Class -> the parameter values with a dim in it.
  for v in program.inputs:
    if program.values[v].role == Role.PARAMETER:
      for c in named.value_classes(v):
        if c >= 0:
          parameter_classes.setdefault(int(c), set()).add(v)
  first_use = np.full(len(named.classes), program.num_ops, np.int64)
  for op in reversed(program.ops):
    classes = named.op_factor_classes(op.id)
    first_use[classes[classes >= 0]] = op.id
  layered = []  # Each per-layer group's classes, in layer order.
  for members in named.groups:
    if (
      len(members) < 2
      or taken & set(members)
      or not all(c in parameter_classes for c in members)
      or _share_a_parameter([parameter_classes[c] for c in members])
    ):
      continue
    layered.append(sorted(members, key=lambda c: first_use[c]))
  clusters: list[list[list[int]]] = []
  for group in sorted(layered, key=lambda g: first_use[g[0]]):
    home = next(
      (cluster for cluster in clusters if _interleave(cluster[0], group, first_use)), None
    )
    if home is None:
      clusters.append([group])
    else:
      home.append(group)
  stacks = []
  for cluster in clusters:
    layer_of = {c: layer for group in cluster for layer, c in enumerate(group)}
    op_layer = np.full(program.num_ops, OUTSIDE, np.int64)
    for op in program.ops:
      classes = {int(c) for c in named.op_factor_classes(op.id)}
      for v in (*op.operands, *op.results):
        classes.update(int(c) for c in named.value_classes(v))
      layers = {layer_of[c] for c in classes if c in layer_of}
      if len(layers) == 1:
        op_layer[op.id] = layers.pop()
    first_class = cluster[0][0]
    path, dim = next(
      (program.values[v].path, d)
      for v in program.inputs
      for d, c in enumerate(named.value_classes(v))
      if c == first_class
    )
    stacks.append(
      LayerStack(False, len(cluster[0]), op_layer, tuple(sorted(layer_of)), (), f"{path}:{dim}")
    )
  return stacks


def _share_a_parameter(holders: Sequence[set[int]]) -> bool:
  """Whether some parameter has dims in two of the classes (two dims of one weight)."""
  seen: set[int] = set()
  for values in holders:
    if seen & values:
      return True
    seen |= values
  return False


def _interleave(a: Sequence[int], b: Sequence[int], first_use: np.ndarray) -> bool:
  """Whether two per-layer groups are layers of one stack: each layer of either is used
  before the next layer of the other."""
  if len(a) != len(b):
    return False
  pa, pb = first_use[list(a)], first_use[list(b)]
  return bool(np.all(pa[:-1] < pb[1:]) and np.all(pb[:-1] < pa[1:]))
