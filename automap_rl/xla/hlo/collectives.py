"""The collectives of a compiled module: kind, bytes, device groups, mesh axes.

Byte convention (shared with the simulator): `Collective.bytes` is, per
device, the size of the larger, group-level buffer of the collective:

* all-reduce: its operand (== its result);
* all-gather: its result (== operand * group size);
* reduce-scatter: its operand (== result * group size);
* all-to-all: its operand (== its result);
* collective-permute: its operand (== its result).

Combined collectives (several operands, tuple-shaped result) sum over their
elements. Async pairs (`*-start` / `*-done`) are counted once, at the start;
ops wrapped by `async-start` are counted where they appear, inside the wrapped
computation. A collective inside a while-loop body runs once per iteration:
`Collective.repeat` is the product of the `known_trip_count`s of the loops
around it (1 where XLA did not annotate one).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence

from automap_rl.xla.hlo.groups import (
  axes_for_groups,
  crossed_axes,
  device_groups,
  group_mode,
  parse_replica_groups,
  parse_source_target_pairs,
  permute_groups,
)
from automap_rl.xla.hlo.module import (
  Instruction,
  Module,
  Shape,
  element_bytes,
  parse_module,
  parse_shapes,
)

COLLECTIVE_KINDS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled module.

  Attributes:
    kind: One of `COLLECTIVE_KINDS` (async `-start` forms map to their kind).
    bytes: Per-device bytes of the larger buffer (see module docstring).
    group_size: Devices per group (for collective-permute: the largest
      connected component of its source->target pairs).
    num_groups: Number of disjoint groups.
    mesh_axes: Mesh axes whose combination yields exactly these groups, in
      mesh order; `()` when every group is a single device; None if no subset
      of axes matches. Of a collective-permute: the axes its pairs move along
      (`groups.crossed_axes`), the links its hops take.
    dtype: HLO element type of the buffer, e.g. 'f32'; for combined
      collectives of mixed types, the distinct types joined by ','.
    shape: Shape of the larger buffer; for combined collectives a tuple with
      one shape per element.
    repeat: How many times it runs per call of the module (the trip counts of
      the while loops around it).
    op_name: the jax op it partitions (its `metadata={op_name=...}` less the outer
      `jit(...)/`), "" where XLA wrote none.
  """

  kind: str
  bytes: int
  group_size: int
  num_groups: int
  mesh_axes: tuple[str, ...] | None
  dtype: str
  shape: tuple
  repeat: int = 1
  op_name: str = ""


_OP_NAME_RE = re.compile(r'op_name="(?:jit\([^)]*\)/)?(?P<name>[^"]*)"')
_DIMENSIONS_RE = re.compile(r"\bdimensions=\{(\d+)\}")


def _kind(opcode: str) -> str | None:
  """The collective kind of `opcode` (`*-start` counts, `*-done` does not)."""
  base = opcode.removesuffix("-start")
  return base if base in COLLECTIVE_KINDS else None


def _buffer(
  kind: str, inst: Instruction, types: Mapping[str, str], group_size: int
) -> tuple[tuple[str, Shape], ...]:
  """Arrays of the collective's larger buffer (see the byte convention)."""
  operands = inst.operands
  if kind == "collective-permute" and "slice_sizes=" in inst.attrs:
    operands = operands[:1]  # In-place form: (input, output, offsets...).
  try:
    shapes = [s for name in operands for s in parse_shapes(types[name])]
  except KeyError as e:
    raise ValueError(
      f"Operand {e.args[0]!r} of {inst.name!r} is not defined in the module."
    ) from None
  if kind == "all-gather":
    match = _DIMENSIONS_RE.search(inst.attrs)
    if match is None:
      raise ValueError(f"All-gather {inst.name!r} has no dimensions={{d}}.")
    dim = int(match.group(1))
    shapes = [
      (dtype, shape[:dim] + (shape[dim] * group_size,) + shape[dim + 1 :])
      for dtype, shape in shapes
    ]
  return tuple(shapes)


def _collective(
  kind: str,
  inst: Instruction,
  types: Mapping[str, str],
  counts: tuple[int, int],
  axis_names: Sequence[str],
  axis_sizes: Sequence[int],
) -> Collective:
  """Builds the `Collective` record of one collective instruction."""
  mode = group_mode(inst.opcode, inst.attrs)
  if kind == "collective-permute":
    pairs = device_groups(parse_source_target_pairs(inst.attrs), mode, *counts)
    groups = permute_groups(pairs)
    mesh_axes = crossed_axes(pairs, axis_names, axis_sizes)
  else:
    groups = device_groups(parse_replica_groups(inst.attrs) or (), mode, *counts)
    covers_mesh = sum(map(len, groups)) == math.prod(axis_sizes)
    mesh_axes = axes_for_groups(groups, axis_names, axis_sizes) if covers_mesh else None
  group_size = max(len(g) for g in groups)
  shapes = _buffer(kind, inst, types, group_size)
  dtypes = dict.fromkeys(dtype for dtype, _ in shapes)
  return Collective(
    kind=kind,
    bytes=sum(element_bytes(d) * math.prod(s) for d, s in shapes),
    group_size=group_size,
    num_groups=len(groups),
    mesh_axes=mesh_axes,
    dtype=",".join(dtypes),
    shape=shapes[0][1] if len(shapes) == 1 else tuple(s for _, s in shapes),
    op_name=match["name"] if (match := _OP_NAME_RE.search(inst.attrs)) else "",
  )


def collectives_from_hlo(
  hlo_text: str, axis_names: Sequence[str], axis_sizes: Sequence[int]
) -> tuple[Collective, ...]:
  """All collectives of an HLO module's text, in text order, each with the
  number of times it runs per call of the module."""
  return module_collectives(parse_module(hlo_text), axis_names, axis_sizes)


def module_collectives(
  module: Module, axis_names: Sequence[str], axis_sizes: Sequence[int]
) -> tuple[Collective, ...]:
  """`collectives_from_hlo` of a parsed module."""
  return tuple(
    dataclasses.replace(
      _collective(kind, inst, module.types, module.counts, axis_names, axis_sizes),
      repeat=module.repeats.get(name, 1),
    )
    for name, body in module.bodies.items()
    for inst in body
    if (kind := _kind(inst.opcode)) is not None
  )


def summarize(collectives: Iterable[Collective]) -> dict[str, tuple[int, int]]:
  """Kind -> (count, total bytes) per call of the module, loop iterations
  included, for kinds that occur."""
  summary: dict[str, tuple[int, int]] = {}
  for c in collectives:
    count, total = summary.get(c.kind, (0, 0))
    summary[c.kind] = (count + c.repeat, total + c.repeat * c.bytes)
  return summary
