"""Inspection of compiled XLA modules: collectives, flops and memory.

The entry point is `inspect_compiled`, which reads the optimized, SPMD
partitioned HLO text of `jax.jit(f).lower(...).compile()` together with its
`memory_analysis()` and `cost_analysis()`. The HLO text parser is a handful of
pure functions over strings so each piece can be tested on hand-written HLO.

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

Flops and bytes accessed. `cost_analysis()` counts a while body once.
`CompiledStats` adds the iterations it leaves out: `(repeat - 1)` times the
flops and bytes of each looped computation, counted from the HLO text with
`HloCostAnalysis`'s conventions for the instructions that carry nearly all of
them (flops: dots, convolutions, reductions and elementwise arithmetic, not
transcendentals, which it counts apart; bytes: operands and result of every
unfused instruction).

Device ids. With `use_global_device_ids=true` groups hold flattened ids
`replica * num_partitions + partition`; with a `channel_id` but no such flag
they hold partition ids (all-to-all, collective-permute) or replica ids whose
partitions all join (all-reduce, all-gather, reduce-scatter); without a
`channel_id` they hold replica ids. Everything is converted to flattened ids.
For a jitted SPMD program there is one replica, so flattened ids are
partition ids, i.e. row-major positions in the mesh's device order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CompiledStats",
    "Instruction",
    "Module",
    "axes_for_groups",
    "collectives_from_hlo",
    "computation_repeats",
    "computations",
    "device_groups",
    "element_bytes",
    "group_mode",
    "inspect_compiled",
    "instruction_flops",
    "module_collectives",
    "mesh_axes_groups",
    "parse_explicit_groups",
    "parse_instruction",
    "parse_iota_groups",
    "parse_mesh_groups",
    "parse_module",
    "parse_replica_groups",
    "parse_shapes",
    "permute_groups",
    "shape_bytes",
    "sharding_attr",
    "sharding_spec",
    "split_tuple_sharding",
    "summarize",
    "instruction_bytes",
    "uncounted_loop_cost",
]

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

Groups = tuple[tuple[int, ...], ...]
Shape = tuple[int, ...]


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
      of axes matches.
    dtype: HLO element type of the buffer, e.g. 'f32'; for combined
      collectives of mixed types, the distinct types joined by ','.
    shape: Shape of the larger buffer; for combined collectives a tuple with
      one shape per element.
    repeat: How many times it runs per call of the module (the trip counts of
      the while loops around it).
  """

  kind: str
  bytes: int
  group_size: int
  num_groups: int
  mesh_axes: tuple[str, ...] | None
  dtype: str
  shape: tuple
  repeat: int = 1


@dataclasses.dataclass(frozen=True)
class CompiledStats:
  """Per-device costs of a compiled module.

  Attributes:
    collectives: Collectives in program text order.
    flops: XLA's flop count for one device's program, every loop iteration
      counted (see the module docstring).
    bytes_accessed: XLA's estimate of memory traffic, bytes, every loop
      iteration counted.
    argument_bytes: Size of the inputs.
    output_bytes: Size of the outputs.
    temp_bytes: Size of XLA's temporary allocations.
    alias_bytes: Bytes of outputs aliased to (donated) inputs.
    peak_bytes: `argument + output + temp - alias`, an estimate of peak
      memory: it assumes inputs, outputs and every temporary are live at once
      and counts aliased buffers once. Not a measured high-water mark.
  """

  collectives: tuple[Collective, ...]
  flops: float
  bytes_accessed: float
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  peak_bytes: int


# ----------------------------------------------------------------------------
# Shapes.

_ELEMENT_BYTES = {
    "pred": 1, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}
# An array type: element type then dimensions, e.g. `f32[8,128]` or
# `f32[<=8]`; the layout suffix `{1,0}` is not part of the match.
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


def element_bytes(dtype: str) -> int:
  """Bytes per element of the HLO element type `dtype` (e.g. 'bf16' -> 2)."""
  if dtype in _ELEMENT_BYTES:
    return _ELEMENT_BYTES[dtype]
  if dtype.startswith("f8"):  # f8e4m3fn, f8e5m2, ...
    return 1
  raise ValueError(
      f"Unknown HLO element type {dtype!r}; known: {sorted(_ELEMENT_BYTES)} "
      "and the f8* types."
  )


def parse_shapes(type_text: str) -> tuple[tuple[str, Shape], ...]:
  """Arrays of an HLO type, flattening tuples.

  `"(f32[4]{0}, bf16[2,8]{1,0})"` -> `(("f32", (4,)), ("bf16", (2, 8)))`.
  Layouts are ignored, dynamic bounds `<=8` read as 8, `token[]` is skipped.
  """
  shapes = []
  for dtype, dims in _ARRAY_RE.findall(type_text):
    if dtype == "token":
      continue
    shape = tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d)
    shapes.append((dtype, shape))
  return tuple(shapes)


def shape_bytes(type_text: str) -> int:
  """Total bytes of all arrays in an HLO type (summed over tuple elements)."""
  return sum(
      element_bytes(dtype) * math.prod(shape)
      for dtype, shape in parse_shapes(type_text)
  )


# ----------------------------------------------------------------------------
# Instructions.


class Instruction(NamedTuple):
  """One HLO instruction line: `name = type opcode(operands), attrs`."""

  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str


_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*"
    r"(?P<type>.*?)\s(?P<opcode>[a-z][a-z0-9\-]*)\("
)
_HEADER_INT_RE = re.compile(r"\b(num_partitions|replica_count)=(\d+)")
# XLA prints `/*index=5*/` comments inside long operand lists.
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def _split_call(text: str) -> tuple[str, str]:
  """Splits `"a, (b), c), rest"` into the text before the closing paren that
  balances an already-open one, and the text after it."""
  depth = 1
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return text[:i], text[i + 1 :]
  raise ValueError(f"Unbalanced parentheses in HLO operands {text!r}.")


def _operand_names(text: str) -> tuple[str, ...]:
  """Names of comma-separated operands, which may carry inline types."""
  names, depth, start = [], 0, 0
  for i, char in enumerate(text + ","):
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    elif char == "," and depth == 0:
      operand = text[start:i].strip()
      if operand:
        names.append(operand.split()[-1].lstrip("%"))
      start = i + 1
  return tuple(names)


def parse_instruction(line: str) -> Instruction | None:
  """Parses one line of HLO text; None if it is not an instruction. Inline
  `/*...*/` comments (XLA's `/*index=5*/` in long operand lists) are dropped."""
  line = _COMMENT_RE.sub("", line)
  match = _INSTRUCTION_RE.match(line)
  if match is None:
    return None
  operands, attrs = _split_call(line[match.end() :])
  return Instruction(
      name=match["name"],
      type=match["type"],
      opcode=match["opcode"],
      operands=_operand_names(operands),
      attrs=attrs,
  )


def _module_counts(hlo_text: str) -> tuple[int, int]:
  """(replica_count, num_partitions) from the `HloModule` header line."""
  header = next(
      (l for l in hlo_text.splitlines() if l.startswith("HloModule")), ""
  )
  counts = dict(_HEADER_INT_RE.findall(header))
  return int(counts.get("replica_count", 1)), int(counts.get("num_partitions", 1))


# ----------------------------------------------------------------------------
# Computations and loops.

_COMPUTATION_RE = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLED_RE = re.compile(
    r"\b(?P<key>body|condition|calls|true_computation|false_computation)=%?(?P<name>[\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACTING_RE = re.compile(r"\blhs_contracting_dims=\{(?P<dims>[\d,]*)\}")
_DIM_LABELS_RE = re.compile(r"\bdim_labels=[^_]+_(?P<rhs>[^-]+)->")
# Opcodes `HloCostAnalysis` charges one flop per result element (transcendentals
# such as exp and tanh are counted apart, not as flops).
_ELEMENTWISE_FLOPS = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
    "compare", "select", "and", "or", "xor", "not", "sign", "floor", "ceil", "clamp",
    "remainder",
})


def computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
  """The module's computations (name -> its instructions, in text order) and
  the name of the entry computation. Instructions before any computation
  header (a bare snippet of HLO) form a computation named `""`, the entry
  unless an `ENTRY` header follows."""
  bodies: dict[str, list[Instruction]] = {"": []}
  entry = current = ""
  for line in hlo_text.splitlines():
    header = _COMPUTATION_RE.match(line)
    if header is not None and not line.startswith("HloModule"):
      current = header["name"]
      bodies[current] = []
      entry = current if header["entry"] else entry
    elif (inst := parse_instruction(line)) is not None:
      bodies[current].append(inst)
  return bodies, entry


def _calls(inst: Instruction) -> list[tuple[str, int]]:
  """(computation, runs per run of `inst`) for the computations `inst` calls;
  reducers (`to_apply`) are part of the instruction and are not listed, nor is
  the computation an `async-done` names (its `async-start` ran it)."""
  if inst.opcode.endswith("-done"):
    return []
  trip = _TRIP_COUNT_RE.search(inst.attrs)
  loop = int(trip.group(1)) if trip and inst.opcode == "while" else 1
  called = [(m["name"], loop if m["key"] in ("body", "condition") else 1)
            for m in _CALLED_RE.finditer(inst.attrs)]
  branches = _BRANCHES_RE.search(inst.attrs)
  if branches is not None:
    called += [(name.strip().lstrip("%"), 1) for name in branches["names"].split(",") if name.strip()]
  return called


def computation_repeats(bodies: Mapping[str, Sequence[Instruction]], entry: str) -> dict[str, int]:
  """How many times each computation runs per call of the module: the entry
  once; a while loop's body and condition their caller's count times the
  loop's `known_trip_count` (1 where XLA did not annotate one); fusions, calls
  and branches their caller's count (a branch as if always taken)."""
  callers: dict[str, list[tuple[str, int]]] = {}
  for name, body in bodies.items():
    for inst in body:
      for callee, times in _calls(inst):
        callers.setdefault(callee, []).append((name, times))
  repeats: dict[str, int] = {entry: 1}

  def count(name: str) -> int:
    if name not in repeats:
      repeats[name] = 0  # Guards against a cycle; HLO call graphs have none.
      repeats[name] = sum(count(caller) * times for caller, times in callers.get(name, ()))
    return repeats[name]

  for name in bodies:
    count(name)
  return repeats


class Module(NamedTuple):
  """An HLO module's text parsed once: its computations (name -> instructions), how
  many times each runs per call (`computation_repeats`), every instruction's type by
  name, and `(replica_count, num_partitions)`."""

  bodies: dict[str, list[Instruction]]
  repeats: dict[str, int]
  types: dict[str, str]
  counts: tuple[int, int]


def parse_module(hlo_text: str) -> Module:
  """Parses an HLO module's text (see `Module`)."""
  bodies, entry = computations(hlo_text)
  return Module(bodies, computation_repeats(bodies, entry),
                {inst.name: inst.type for body in bodies.values() for inst in body}, _module_counts(hlo_text))


def instruction_flops(inst: Instruction, types: Mapping[str, str]) -> float:
  """Flops of one instruction as `HloCostAnalysis` counts them, for dots,
  convolutions (every kernel tap; padding not discounted), reductions and
  elementwise arithmetic; 0 for anything else (fusions count through their
  computations)."""
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
_FREE_OPCODES = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id",
})


def _read_fraction(inst: Instruction, operand: int, types: Mapping[str, str]) -> float:
  """The fraction of operand `operand` that `inst` reads: what a (dynamic-)slice keeps
  of its sliced operand, else all of it."""
  if inst.opcode not in ("slice", "dynamic-slice") or operand != 0:
    return 1.0
  elements = lambda type_text: math.prod(parse_shapes(type_text)[0][1])
  return elements(inst.type) / max(elements(types[inst.operands[0]]), 1)


def _parameter_utilization(body: Sequence[Instruction], types: Mapping[str, str]) -> dict[str, float]:
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


def instruction_bytes(inst: Instruction, types: Mapping[str, str],
                      bodies: Mapping[str, Sequence[Instruction]]) -> float:
  """Bytes an unfused instruction reads and writes, as `HloCostAnalysis` counts a
  fusion from its boundary: its operands and its result, except that a fusion operand
  counts only the fraction its computation reads (`_parameter_utilization`: a slice of
  it, even through a transpose or elementwise ops), and a fusion whose root updates a
  parameter in place (`dynamic-update-slice`) counts the update twice instead of the
  whole buffer in and out."""
  if inst.opcode in _FREE_OPCODES:
    return 0.0
  operand_bytes = [shape_bytes(types[name]) if name in types else 0 for name in inst.operands]
  result_bytes = shape_bytes(inst.type)
  body = next((bodies.get(callee, ()) for callee, _ in _calls(inst)), ()) if inst.opcode == "fusion" else ()
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


def uncounted_loop_cost(module: Module) -> tuple[float, float]:
  """`(flops, bytes accessed)` of the loop iterations `cost_analysis()` leaves out:
  for every computation that runs `r > 1` times, `(r - 1)` times its instructions'
  flops, and for the unfused ones among them (not the body of a fusion), their bytes."""
  bodies, types = module.bodies, module.types
  fused = {callee for body in bodies.values() for inst in body if inst.opcode == "fusion"
           for callee, _ in _calls(inst)}
  flops = nbytes = 0.0
  for name, body in bodies.items():
    extra = module.repeats.get(name, 1) - 1
    if extra > 0:
      flops += extra * sum(instruction_flops(inst, types) for inst in body)
      if name not in fused:
        nbytes += extra * sum(instruction_bytes(inst, types, bodies) for inst in body)
  return flops, nbytes


# ----------------------------------------------------------------------------
# Replica groups.

_EXPLICIT_RE = re.compile(r"\{\s*((?:\{[\d,\s]*\}\s*,?\s*)*)\}")
_INNER_GROUP_RE = re.compile(r"\{([\d,\s]*)\}")
_IOTA_RE = re.compile(
    r"\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\))?"
    r"\s*\{(?P<refs>[^}]*)\}"
)
_MESH_AXIS_RE = re.compile(r"'?(?P<name>[^'=,\s]+)'?=(?P<size>\d+)")
_AXIS_REF_RE = re.compile(
    r"'?(?P<name>[^',:\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?"
)
_DEVICE_IOTA_RE = re.compile(r"\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_REPLICA_GROUPS_RE = re.compile(
    r"replica_groups=(?P<value>" + _MESH_RE.pattern + "|" + _IOTA_RE.pattern
    + r"|\{\s*(?:\{[\d,\s]*\}\s*,?\s*)*\})"
)
_PAIRS_RE = re.compile(
    r"source_target_pairs=(?P<value>\{\s*(?:\{[\d,\s]*\}\s*,?\s*)*\})"
)


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def parse_explicit_groups(text: str) -> Groups:
  """`"{{0,1},{2,3}}"` -> `((0, 1), (2, 3))`; `"{}"` -> `()` (all devices)."""
  match = _EXPLICIT_RE.fullmatch(text.strip())
  if match is None:
    raise ValueError(f"Malformed explicit replica groups {text!r}.")
  return tuple(_ints(g) for g in _INNER_GROUP_RE.findall(match.group(1)))


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
  """`arange(prod(reshape)).reshape(reshape).transpose(perm)`, flattened."""
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return (ids if perm is None else ids.transpose(perm)).reshape(-1)


def parse_iota_groups(text: str) -> Groups:
  """Expands iota groups, e.g. `"[4,2]<=[2,4]T(1,0)"`.

  `[G,S]<=[d...]T(p...)` means: `iota(prod(d)).reshape(d).transpose(p)`
  reshaped to `G` groups of `S` ids.
  """
  match = _IOTA_RE.fullmatch(text.strip())
  if match is None:
    raise ValueError(f"Malformed iota replica groups {text!r}.")
  dims = _ints(match["dims"])
  perm = _ints(match["perm"]) if match["perm"] else None
  ids = _iota(_ints(match["reshape"]), perm)
  if len(dims) != 2 or math.prod(dims) != ids.size:
    raise ValueError(
        f"Iota replica groups {text!r}: group dims {dims} must be [groups, "
        f"size] with product {ids.size}."
    )
  return tuple(tuple(int(i) for i in row) for row in ids.reshape(dims))


def mesh_axes_groups(
    axis_sizes: Sequence[int],
    group_axes: Sequence[tuple[int, int | None, int | None]],
    device_ids: Sequence[int] | None = None,
) -> Groups:
  """Groups of devices varying along some (sub-)axes of a row-major mesh.

  Args:
    axis_sizes: Mesh shape.
    group_axes: `(axis, pre_size, size)` per grouped axis; `pre_size` and
      `size` are None for a whole axis. A sub-axis `(pre, size)` is the
      factor of size `size` after (more minor than) factors of total `pre`.
    device_ids: Device id at each row-major mesh position; default iota.

  Returns:
    One group per combination of the non-grouped coordinates.
  """
  splits = [{1, n} for n in axis_sizes]
  for axis, pre, size in group_axes:
    if pre is not None:
      splits[axis] |= {pre, pre * size}
  splits = [sorted(s) for s in splits]
  factors = [[b // a for a, b in zip(s, s[1:])] or [1] for s in splits]
  offsets = np.cumsum([0] + [len(f) for f in factors])
  grouped = []
  for axis, pre, size in group_axes:
    lo = 0 if pre is None else splits[axis].index(pre)
    hi = len(factors[axis]) if pre is None else splits[axis].index(pre * size)
    grouped.extend(range(offsets[axis] + lo, offsets[axis] + hi))
  ids = np.arange(math.prod(axis_sizes)) if device_ids is None else device_ids
  refined = np.asarray(ids).reshape([f for fs in factors for f in fs])
  others = [d for d in range(refined.ndim) if d not in grouped]
  group_size = math.prod(refined.shape[d] for d in grouped)
  rows = refined.transpose(others + grouped).reshape(-1, group_size)
  return tuple(tuple(int(i) for i in row) for row in rows)


def parse_mesh_groups(text: str) -> Groups:
  """Expands mesh-axes groups, e.g. `"mesh['x'=2,'y'=4] {'y'}"`.

  The mesh may carry `device_ids=(...)`, either an iota `[4,2]T(1,0)` or an
  explicit comma-separated list; grouped axes may be sub-axes `'x':(1)2`.
  """
  match = _MESH_RE.fullmatch(text.strip())
  if match is None:
    raise ValueError(f"Malformed mesh replica groups {text!r}.")
  axes = _MESH_AXIS_RE.findall(match["axes"])
  names = [name for name, _ in axes]
  sizes = [int(size) for _, size in axes]
  device_ids = None
  if match["ids"]:
    iota = _DEVICE_IOTA_RE.fullmatch(match["ids"].strip())
    if iota:
      perm = _ints(iota["perm"]) if iota["perm"] else None
      device_ids = _iota(_ints(iota["reshape"]), perm)
    else:
      device_ids = np.array(_ints(match["ids"].strip("[] ")))
  group_axes = []
  for ref in filter(None, (r.strip() for r in match["refs"].split(","))):
    ref_match = _AXIS_REF_RE.fullmatch(ref)
    if ref_match is None or ref_match["name"] not in names:
      raise ValueError(f"Unknown mesh axis {ref!r} in replica groups {text!r}.")
    pre = int(ref_match["pre"]) if ref_match["pre"] else None
    size = int(ref_match["size"]) if ref_match["size"] else None
    group_axes.append((names.index(ref_match["name"]), pre, size))
  return mesh_axes_groups(sizes, group_axes, device_ids)


def parse_replica_groups(attrs: str) -> Groups | None:
  """Replica groups of an instruction's attributes, in any of the formats
  (explicit, iota, mesh axes); `()` for `{}` (all), None when absent."""
  match = _REPLICA_GROUPS_RE.search(attrs)
  if match is None:
    return None
  value = match["value"]
  if value.startswith("mesh"):
    return parse_mesh_groups(value)
  if value.startswith("["):
    return parse_iota_groups(value)
  return parse_explicit_groups(value)


def permute_groups(pairs: Iterable[Sequence[int]]) -> Groups:
  """Connected components of collective-permute source->target pairs, each
  sorted, ordered by smallest member; `((0,1),(1,0),(2,2))` -> `((0,1),(2,))`.
  """
  parent: dict[int, int] = {}

  def root(i: int) -> int:
    while parent.setdefault(i, i) != i:
      i = parent[i]
    return i

  for source, target in pairs:
    parent[root(source)] = root(target)
  components: dict[int, list[int]] = {}
  for i in sorted(parent):
    components.setdefault(root(i), []).append(i)
  return tuple(sorted(tuple(c) for c in components.values()))


def group_mode(opcode: str, attrs: str) -> str:
  """How a collective's ids are interpreted (XLA's CollectiveOpGroupMode).

  Returns one of 'cross_replica', 'cross_partition',
  'cross_replica_and_partition', 'flattened_id'.
  """
  if "channel_id=" not in attrs:
    return "cross_replica"
  if opcode.startswith(("all-to-all", "collective-permute")):
    return "cross_partition"
  if "use_global_device_ids=true" in attrs:
    return "flattened_id"
  return "cross_replica_and_partition"


def device_groups(
    groups: Groups, mode: str, num_replicas: int, num_partitions: int
) -> Groups:
  """Converts id groups in `mode` to groups of flattened device ids
  `replica * num_partitions + partition`. Empty `groups` means all ids."""
  r_all, p_all = range(num_replicas), range(num_partitions)
  if mode == "flattened_id":
    return groups or (tuple(range(num_replicas * num_partitions)),)
  if mode == "cross_partition":
    groups = groups or (tuple(p_all),)
    return tuple(
        tuple(r * num_partitions + p for p in g) for r in r_all for g in groups
    )
  groups = groups or (tuple(r_all),)
  if mode == "cross_replica":
    return tuple(
        tuple(r * num_partitions + p for r in g) for p in p_all for g in groups
    )
  if mode == "cross_replica_and_partition":
    return tuple(
        tuple(r * num_partitions + p for r in g for p in p_all) for g in groups
    )
  raise ValueError(f"Unknown collective group mode {mode!r}.")


def _canonical(groups: Iterable[Iterable[int]]) -> frozenset[frozenset[int]]:
  return frozenset(frozenset(g) for g in groups)


def axes_for_groups(
    groups: Iterable[Iterable[int]],
    axis_names: Sequence[str],
    axis_sizes: Sequence[int],
) -> tuple[str, ...] | None:
  """Mesh axes whose combination produces exactly `groups`.

  Device position `i` is the row-major index over `axis_sizes`. Among the
  subsets of axes that match, the smallest (first in mesh order) is returned,
  so size-1 axes are left out. Returns `()` when every group is a single
  device and None when no subset of axes matches (e.g. groups that do not
  cover the mesh, or that cut across axes).
  """
  target = _canonical(groups)
  for k in range(len(axis_names) + 1):
    for subset in itertools.combinations(range(len(axis_names)), k):
      candidate = mesh_axes_groups(axis_sizes, [(a, None, None) for a in subset])
      if _canonical(candidate) == target:
        return tuple(axis_names[a] for a in subset)
  return None


# ----------------------------------------------------------------------------
# Shardings.

Spec = tuple[tuple[str, ...], ...]
_TILED_RE = re.compile(
    r"\{devices=\[(?P<dims>[\d,]+)\](?P<ids>[^\s}]+)(?P<rest>.*)\}"
)
_LAST_TILE_DIMS_RE = re.compile(r"last_tile_dims=\{(?P<kinds>[^}]*)\}")


def _balanced(text: str, start: int) -> str:
  """The brace group of `text` opening at `start` (`text[start] == '{'`)."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[start : i + 1]
  raise ValueError(f"Unbalanced braces in HLO sharding {text[start:]!r}.")


def sharding_attr(attrs: str) -> str | None:
  """The `{...}` of an instruction's `sharding=` attribute; None when absent."""
  at = attrs.find("sharding={")
  return None if at < 0 else _balanced(attrs, at + len("sharding="))


def split_tuple_sharding(text: str) -> tuple[str, ...]:
  """The element shardings of a tuple sharding `{{a}, {b}}`; `(text,)` for an
  array's sharding."""
  inner = text.strip()[1:-1].strip()
  if not inner.startswith("{"):
    return (text.strip(),)
  parts, i = [], 0
  while i < len(inner):
    if inner[i] == "{":
      parts.append(_balanced(inner, i))
      i += len(parts[-1])
    else:
      i += 1
  return tuple(parts)


def _tile_assignment(dims: Sequence[int], ids: str) -> np.ndarray:
  """Device ids laid out as the tile array `dims`, from an iota `<=[..]T(..)`
  or an explicit `0,1,2,...` list."""
  if ids.startswith("<="):
    match = _DEVICE_IOTA_RE.fullmatch(ids[2:])
    if match is None:
      raise ValueError(f"Malformed iota tile assignment {ids!r}.")
    perm = _ints(match["perm"]) if match["perm"] else None
    flat = _iota(_ints(match["reshape"]), perm)
  else:
    flat = np.array(_ints(ids))
  return flat.reshape(dims)


def _dim_axes(
    index: np.ndarray, count: int, coords: np.ndarray, sizes: Sequence[int],
    free: Sequence[int],
) -> tuple[int, ...] | None:
  """The ordered mesh axes (major first, drawn from `free`) whose row-major
  coordinate gives each device's tile `index` [num_devices] along a dim
  tiled `count` ways; None when none do."""
  for k in range(1, len(free) + 1):
    for axes in itertools.permutations(free, k):
      if math.prod(sizes[a] for a in axes) != count:
        continue
      position = np.zeros(len(index), np.int64)
      for a in axes:
        position = position * sizes[a] + coords[:, a]
      if np.array_equal(position, index):
        return axes
  return None


def sharding_spec(
    text: str, rank: int, axis_names: Sequence[str], axis_sizes: Sequence[int]
) -> Spec | None:
  """The mesh axes each dim of an array is tiled over under the HLO sharding
  `text` (one array's, e.g. `{devices=[1,4,2]<=[2,4]T(1,0)
  last_tile_dim_replicate}`), major axis first, size-1 axes left out:
  `(("model",), ())` for that example on a `data=2,model=4` mesh. `((),) * rank`
  for `{replicated}`; None for a sharding no mesh axes express (maximal,
  manual, or tiles in another device order)."""
  text = text.strip()
  if text == "{replicated}":
    return ((),) * rank
  match = _TILED_RE.fullmatch(text)
  if match is None:
    return None
  kinds = _LAST_TILE_DIMS_RE.search(match["rest"])
  if kinds and "manual" in kinds["kinds"]:
    return None
  dims = _ints(match["dims"])
  tiles = _tile_assignment(dims, match["ids"])
  if len(dims) < rank or tiles.size != math.prod(axis_sizes):
    return None
  coords = np.array(np.unravel_index(np.arange(tiles.size), axis_sizes)).T
  index = np.zeros((tiles.size, len(dims)), np.int64)
  index[tiles.reshape(-1)] = np.array(np.unravel_index(np.arange(tiles.size), dims)).T
  free = [a for a, n in enumerate(axis_sizes) if n > 1]
  spec = []
  for d in range(rank):
    if dims[d] == 1:
      spec.append(())
      continue
    axes = _dim_axes(index[:, d], dims[d], coords, axis_sizes, free)
    if axes is None:
      return None
    free = [a for a in free if a not in axes]
    spec.append(tuple(axis_names[a] for a in axes))
  return tuple(spec)


# ----------------------------------------------------------------------------
# Collectives.

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
    pairs_match = _PAIRS_RE.search(inst.attrs)
    pairs = parse_explicit_groups(pairs_match["value"]) if pairs_match else ()
    groups = permute_groups(device_groups(pairs, mode, *counts))
  else:
    groups = device_groups(
        parse_replica_groups(inst.attrs) or (), mode, *counts
    )
  group_size = max(len(g) for g in groups)
  covers_mesh = sum(map(len, groups)) == math.prod(axis_sizes)
  shapes = _buffer(kind, inst, types, group_size)
  dtypes = dict.fromkeys(dtype for dtype, _ in shapes)
  return Collective(
      kind=kind,
      bytes=sum(element_bytes(d) * math.prod(s) for d, s in shapes),
      group_size=group_size,
      num_groups=len(groups),
      mesh_axes=(
          axes_for_groups(groups, axis_names, axis_sizes)
          if covers_mesh else None
      ),
      dtype=",".join(dtypes),
      shape=shapes[0][1] if len(shapes) == 1 else tuple(s for _, s in shapes),
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


def _cost(cost_analysis: Any, key: str) -> float:
  """Sums `key` over a cost analysis that is a dict, a list of dicts or None."""
  if cost_analysis is None:
    return 0.0
  if isinstance(cost_analysis, Mapping):
    cost_analysis = [cost_analysis]
  return float(sum(entry.get(key, 0.0) for entry in cost_analysis))


def inspect_compiled(
    compiled: Any, axis_names: Sequence[str], axis_sizes: Sequence[int]
) -> CompiledStats:
  """Collectives, flops and memory of a `jax.stages.Compiled`.

  Args:
    compiled: The result of `jax.jit(f).lower(...).compile()`.
    axis_names: Names of the mesh axes the program was partitioned over.
    axis_sizes: Their sizes; partition `i` is row-major mesh position `i`.
  """
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  module = parse_module(compiled.as_text())
  loop_flops, loop_bytes = uncounted_loop_cost(module)
  argument = int(memory.argument_size_in_bytes)
  output = int(memory.output_size_in_bytes)
  temp = int(memory.temp_size_in_bytes)
  alias = int(memory.alias_size_in_bytes)
  return CompiledStats(
      collectives=module_collectives(module, axis_names, axis_sizes),
      flops=_cost(cost, "flops") + loop_flops,
      bytes_accessed=_cost(cost, "bytes accessed") + loop_bytes,
      argument_bytes=argument,
      output_bytes=output,
      temp_bytes=temp,
      alias_bytes=alias,
      peak_bytes=argument + output + temp - alias,
  )
