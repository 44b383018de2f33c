"""HLO module text: array types, instructions, computations and how often each runs.

Pure functions over strings, so each piece can be tested on hand-written HLO. A
computation inside a while-loop body runs once per iteration: `computation_repeats`
multiplies the `known_trip_count`s of the loops around it (1 where XLA did not
annotate one). A conditional's branch runs as often as its caller, unless the branch
each conditional of a loop takes in each iteration is given (`Taken`): a pipeline's
tick loop, whose switch runs one operation a tick on each device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

Shape = tuple[int, ...]


# -- shapes -------------------------------------------------------------------

_ELEMENT_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
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
    f"Unknown HLO element type {dtype!r}; known: {sorted(_ELEMENT_BYTES)} and the f8* types."
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
  return sum(element_bytes(dtype) * math.prod(shape) for dtype, shape in parse_shapes(type_text))


# -- instructions -------------------------------------------------------------


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
  header = next((l for l in hlo_text.splitlines() if l.startswith("HloModule")), "")
  counts = dict(_HEADER_INT_RE.findall(header))
  return int(counts.get("replica_count", 1)), int(counts.get("num_partitions", 1))


# -- computations and loops ---------------------------------------------------

_COMPUTATION_RE = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLED_RE = re.compile(
  r"\b(?P<key>body|condition|calls|true_computation|false_computation)=%?(?P<name>[\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


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


def called_computations(inst: Instruction) -> list[tuple[str, int]]:
  """(computation, runs per run of `inst`) for the computations `inst` calls;
  reducers (`to_apply`) are part of the instruction and are not listed, nor is
  the computation an `async-done` names (its `async-start` ran it). A conditional's
  branches are listed in branch order (`branches`), each as if taken."""
  if inst.opcode.endswith("-done"):
    return []
  trip = _TRIP_COUNT_RE.search(inst.attrs)
  loop = int(trip.group(1)) if trip and inst.opcode == "while" else 1
  called = [
    (m["name"], loop if m["key"] in ("body", "condition") else 1)
    for m in _CALLED_RE.finditer(inst.attrs)
    if m["key"] not in ("true_computation", "false_computation")
  ]
  return called + [(name, 1) for name in branches(inst)]


def branches(inst: Instruction) -> list[str]:
  """A conditional's branch computations by branch index: its `branch_computations`,
  or of the predicated form `false_computation` (index 0) then `true_computation` (1),
  as a predicate converts to an index; [] for any other instruction."""
  listed = _BRANCHES_RE.search(inst.attrs)
  if listed is not None:
    return [name.strip().lstrip("%") for name in listed["names"].split(",") if name.strip()]
  called = {m["key"]: m["name"] for m in _CALLED_RE.finditer(inst.attrs)}
  return [called[k] for k in ("false_computation", "true_computation") if k in called]


# The branch each conditional takes in one iteration of a loop: the conditional's path
# (the branch indices of the conditionals around it inside the loop, outermost first)
# -> the index of the branch it runs. A conditional whose path is not listed is counted
# as if every branch ran.
Taken = Mapping[tuple[int, ...], int]


def computation_repeats(
  bodies: Mapping[str, Sequence[Instruction]], entry: str, taken: Sequence[Taken] = ()
) -> dict[str, int]:
  """How many times each computation runs per call of the module: the entry
  once; a while loop's body and condition their caller's count times the
  loop's `known_trip_count` (1 where XLA did not annotate one); fusions and calls
  their caller's count; a conditional's branches their caller's count each (as if
  always taken), but inside the outermost loop of `len(taken)` iterations, where
  iteration `t` runs the branches `taken[t]` names (`Taken`): a branch there runs in
  the iterations that reach its conditional and take it."""
  repeats = dict.fromkeys(bodies, 0)
  everything = tuple(range(len(taken)))

  def visit(name: str, runs: int, ticks: tuple[int, ...] | None, path: tuple[int, ...]) -> None:
    repeats[name] = repeats.get(name, 0) + runs * (1 if ticks is None else len(ticks))
    for inst in bodies.get(name, ()):
      called = called_computations(inst)
      if ticks is None and inst.opcode == "while" and taken and called[0][1] == len(taken):
        for callee, _ in called:  # The loop the iterations of `taken` are of.
          visit(callee, runs, everything, ())
      elif ticks is not None and inst.opcode == "conditional":
        names = branches(inst)
        if any(taken[t].get(path, 0) >= len(names) for t in ticks):
          raise ValueError(
            f"Conditional {inst.name!r} (path {path}) has {len(names)} branches; the taken"
            f" branches name {max(taken[t].get(path, 0) for t in ticks)}."
          )
        for index, callee in enumerate(names):
          runs_it = tuple(t for t in ticks if taken[t].get(path, index) == index)
          visit(callee, runs, runs_it, (*path, index))
      else:
        for callee, times in called:
          visit(callee, runs * times, ticks, path)

  visit(entry, 1, None, ())
  return repeats


class Module(NamedTuple):
  """An HLO module's text parsed once: its computations (name -> instructions), how
  many times each runs per call (`computation_repeats`), every instruction's type by
  name, `(replica_count, num_partitions)` and the entry computation's name."""

  bodies: dict[str, list[Instruction]]
  repeats: dict[str, int]
  types: dict[str, str]
  counts: tuple[int, int]
  entry: str = ""


def parse_module(hlo_text: str, taken: Sequence[Taken] = ()) -> Module:
  """Parses an HLO module's text (see `Module`); `taken`: the branches one device's
  conditionals take in each iteration of a loop (`computation_repeats`)."""
  bodies, entry = computations(hlo_text)
  return Module(
    bodies,
    computation_repeats(bodies, entry, taken),
    {inst.name: inst.type for body in bodies.values() for inst in body},
    _module_counts(hlo_text),
    entry,
  )
