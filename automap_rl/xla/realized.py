"""Whether XLA realized a plan as written: the compiled module's shardings against the plan's.

`lower` constrains every array result of every program op to the plan's sharding inside a
named scope `scope_name(value id)`, and gives arguments and outputs the plan's shardings.
XLA's sharding propagation then decides a sharding for every instruction, and the SPMD
partitioner partitions each instruction by it. This module reads the module as it enters
the partitioner (the `*before_spmd-partitioning.txt` HLO dump) and compares:

* each entry parameter's `sharding=` (named by its `op_name`, `call_args` plus the pytree
  key path of the argument) with the plan's sharding of that argument;
* each sharding constraint's operand, the instruction computing the op's result, with
  the plan's sharding of that result: where they differ, XLA computes the op sharded
  otherwise and reshards into the constraint, which the plan (and the simulator) did not
  write. Inside a `scan`'s while loop body a result has its per-iteration shape, as its
  program value does;
* each element of the entry's root with the plan's sharding of that output.

Shardings compare as mesh axes per dimension of the plan's value (`hlo.sharding_spec`),
size-1 axes left out; the trailing key-data dim that a PRNG key array has in HLO is not
compared.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from automap_rl.mesh import spec_axes
from automap_rl.xla import hlo
from automap_rl.xla.isolated import CompiledModule, compile_directly

__all__ = [
  "Expected",
  "ShardingDifference",
  "partitioned_compile",
  "partitioner_input",
  "format_spec",
  "normalize",
  "scope_name",
  "sharding_differences",
]

_SCOPE = "automap_value_"
_CONSTRAINT_RE = re.compile(_SCOPE + r"(\d+)/sharding_constraint$")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CONSTRAINT_OPCODES = frozenset(
  {"copy", "custom-call"}
)  # Shardy's copy; GSPMD's custom-call @Sharding.


def scope_name(value: int) -> str:
  """The `jax.named_scope` that `lower` puts the constraint of program value `value` in."""
  return f"{_SCOPE}{value}"


@dataclasses.dataclass(frozen=True)
class Expected:
  """The plan's sharding of one value.

  Attributes:
    value: program value id.
    where: what the value is, for reports: `argument params/...`, `output 3` or
      `result of dot_general (op 12)`.
    spec: mesh axes per dim (see `normalize`).
  """

  value: int
  where: str
  spec: hlo.Spec


@dataclasses.dataclass(frozen=True)
class ShardingDifference:
  """A value XLA shards otherwise than the plan.

  Attributes:
    value: program value id.
    where: see `Expected.where`.
    expected: the plan's sharding, as a `PartitionSpec` string.
    actual: XLA's, as a `PartitionSpec` string (the raw HLO sharding when no mesh axes
      express it, `unannotated` when the instruction has none).
  """

  value: int
  where: str
  expected: str
  actual: str


def normalize(spec: PartitionSpec, rank: int, mesh_shape: Mapping[str, int]) -> hlo.Spec:
  """A `PartitionSpec` as mesh axes per dim, `rank` dims, size-1 axes left out."""
  return tuple(tuple(a for a in dim if mesh_shape[a] > 1) for dim in spec_axes(spec, rank))


def format_spec(spec: hlo.Spec) -> str:
  """`(("data",), ())` -> `P('data', None)`."""
  entry = lambda axes: "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes)
  return f"P({', '.join(entry(axes) for axes in spec)})"


def partitioner_input(stage: Any, devices: np.ndarray, isolated: bool = False) -> str | None:
  """The text of the module `stage` (a `jax.stages.Lowered`) becomes on entering XLA's SPMD
  partitioner, every instruction annotated with the sharding propagation chose: XLA's
  `xla_dump_to` dump of the pass from a compile through the backend itself
  (`isolated.compile_directly`, in a child process when `isolated`), since a hit of jax's
  persistent compilation cache runs no pass and dumps nothing. None when the partitioner
  did not run (a single device)."""
  return _dumped_compile(stage, devices, isolated, analyses=False)[0]


def partitioned_compile(
  stage: Any, devices: np.ndarray, isolated: bool = False
) -> tuple[str | None, CompiledModule]:
  """`partitioner_input` and the compiled module's analyses (`isolated.CompiledModule`)
  from the same one compile."""
  text, compiled = _dumped_compile(stage, devices, isolated, analyses=True)
  assert compiled is not None
  return text, compiled


def _dumped_compile(
  stage: Any, devices: np.ndarray, isolated: bool, analyses: bool
) -> tuple[str | None, CompiledModule | None]:
  with tempfile.TemporaryDirectory(prefix="automap_hlo_") as dump:
    compiled = compile_directly(stage, devices, isolated=isolated, dump_to=dump, analyses=analyses)
    paths = sorted(glob.glob(os.path.join(dump, "*before_spmd-partitioning.txt")))
    if not paths:
      return None, compiled
    with open(paths[-1]) as f:
      return f.read(), compiled


def _op_name(attrs: str) -> str:
  match = _OP_NAME_RE.search(attrs)
  return "" if match is None else match.group(1).replace("\\'", "'").replace('\\"', '"')


def sharding_differences(
  hlo_text: str,
  arguments: Mapping[str, Expected],
  constrained: Mapping[int, Expected],
  outputs: Sequence[Expected],
  axis_names: Sequence[str],
  axis_sizes: Sequence[int],
) -> tuple[ShardingDifference, ...]:
  """Every value of the plan that the module (before SPMD partitioning) shards otherwise.

  Args:
    hlo_text: the module's HLO text, with `sharding=` annotations.
    arguments: the plan for each entry parameter, by its `op_name`.
    constrained: the plan for each constrained result, by value id (see `scope_name`).
    outputs: the plan for each element of the entry's root, in order.
    axis_names, axis_sizes: the mesh; device i is row-major mesh position i.

  Returns:
    The differences in module text order (arguments, results, then outputs), each once: a
    value constrained at several instructions (the copies of an unrolled `scan` body) is
    reported once per sharding XLA gave it; a copy the propagation made of a constrained
    value for a reader that wants it otherwise (named like the constraint) is not compared.
    Values absent from the module (XLA removed them as dead) are not compared.
  """
  differences = []
  shardings = {}
  constraint_of: dict[str, int] = {}  # Constraint instruction -> the value it constrains.
  entry, root = False, None

  def compare(expected: Expected, actual: str | None) -> None:
    spec = (
      None
      if actual is None
      else hlo.sharding_spec(actual, len(expected.spec), axis_names, axis_sizes)
    )
    if spec != expected.spec:
      shown = "unannotated" if actual is None else format_spec(spec) if spec is not None else actual
      differences.append(
        ShardingDifference(expected.value, expected.where, format_spec(expected.spec), shown)
      )

  for line in hlo_text.splitlines():
    if line.startswith("ENTRY"):
      entry = True
    inst = hlo.parse_instruction(line)
    if inst is None:
      continue
    shardings[inst.name] = hlo.sharding_attr(inst.attrs)
    op_name = _op_name(inst.attrs)
    if entry and inst.opcode == "parameter" and op_name in arguments:
      compare(arguments[op_name], shardings[inst.name])
    match = _CONSTRAINT_RE.search(op_name)
    if match and inst.opcode in _CONSTRAINT_OPCODES and int(match.group(1)) in constrained:
      value = int(match.group(1))
      constraint_of[inst.name] = value
      # A copy of the constrained value itself is a reshard the propagation inserted for a
      # reader (it takes the constraint's `op_name`), not the value as computed.
      if constraint_of.get(inst.operands[0]) != value:
        compare(constrained[value], shardings[inst.operands[0]])
    if entry and line.lstrip().startswith("ROOT"):
      root = inst
  if root is not None and outputs:
    is_tuple, whole = root.opcode == "tuple", shardings[root.name]
    elements = root.operands if is_tuple else (root.name,)
    parts = (
      hlo.split_tuple_sharding(whole)
      if is_tuple and whole is not None
      else (whole,) * len(elements)
    )
    for expected, part in zip(outputs, parts):
      compare(expected, part)
  return tuple(dict.fromkeys(differences))
