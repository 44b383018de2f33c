"""Collectives, flops and memory of a `jax.stages.Compiled`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from automap_rl.xla.hlo.collectives import Collective, module_collectives
from automap_rl.xla.hlo.cost import kernel_costs, uncounted_cost
from automap_rl.xla.hlo.module import Taken, computation_repeats, parse_module


@dataclasses.dataclass(frozen=True)
class CompiledStats:
  """Per-device costs of a compiled module: of what one device runs, every loop
  iteration counted, of a conditional the branches the device takes where they are
  known (`inspect_compiled`'s `taken`), else every branch.

  Attributes:
    collectives: Collectives in program text order, each with its runs (`repeat`, 0 for
      one in a branch the device never takes).
    flops: XLA's flop count for one device's program, corrected to its runs
      (`cost_analysis()` counts a while body once and a conditional's largest branch;
      `uncounted_cost` adds the difference).
    bytes_accessed: XLA's estimate of memory traffic, bytes, corrected likewise.
    kernels: `(flops, bytes accessed)` per step of each kernel (`cost.kernel_costs`),
      for a per-kernel roofline.
    argument_bytes: Size of the inputs.
    output_bytes: Size of the outputs.
    temp_bytes: Size of XLA's temporary allocations.
    alias_bytes: Bytes of outputs aliased to (donated) inputs.
    peak_bytes: `argument + output + temp - alias`, an estimate of peak
      memory: it assumes inputs, outputs and every temporary are live at once
      and counts aliased buffers once. Not a measured high-water mark. One figure for
      every device of an SPMD module: its temporaries are allocated for every branch of
      its conditionals (those of a branch a device never takes included).
  """

  collectives: tuple[Collective, ...]
  flops: float
  bytes_accessed: float
  kernels: tuple[tuple[float, float], ...]
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  peak_bytes: int


def _cost(cost_analysis: Any, key: str) -> float:
  """Sums `key` over a cost analysis that is a dict, a list of dicts or None."""
  if cost_analysis is None:
    return 0.0
  if isinstance(cost_analysis, Mapping):
    cost_analysis = [cost_analysis]
  return float(sum(entry.get(key, 0.0) for entry in cost_analysis))


def inspect_compiled(
  compiled: Any,
  axis_names: Sequence[str],
  axis_sizes: Sequence[int],
  taken: Sequence[Sequence[Taken]] = (),
) -> CompiledStats:
  """Collectives, flops and memory of a `jax.stages.Compiled`.

  Args:
    compiled: The result of `jax.jit(f).lower(...).compile()`.
    axis_names: Names of the mesh axes the program was partitioned over.
    axis_sizes: Their sizes; partition `i` is row-major mesh position `i`.
    taken: Where devices take different branches of a loop's conditionals (a pipeline's
      stages, each running its operations of a tick table), for each group of devices
      the branches it takes in each iteration (`module.computation_repeats`): the
      figures are then the group's that runs the most flops. Empty: every branch runs.
  """
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  parsed = parse_module(compiled.as_text())
  modules = [
    parsed._replace(repeats=computation_repeats(parsed.bodies, parsed.entry, t)) for t in taken
  ]
  analysed = (_cost(cost, "flops"), _cost(cost, "bytes accessed"))
  module, (flops, nbytes) = max(
    ((m, _corrected(analysed, uncounted_cost(m))) for m in modules or [parsed]),
    key=lambda pair: pair[1][0],
  )
  argument = int(memory.argument_size_in_bytes)
  output = int(memory.output_size_in_bytes)
  temp = int(memory.temp_size_in_bytes)
  alias = int(memory.alias_size_in_bytes)
  return CompiledStats(
    collectives=module_collectives(module, axis_names, axis_sizes),
    flops=flops,
    bytes_accessed=nbytes,
    kernels=kernel_costs(module),
    argument_bytes=argument,
    output_bytes=output,
    temp_bytes=temp,
    alias_bytes=alias,
    peak_bytes=argument + output + temp - alias,
  )


def _corrected(
  analysed: tuple[float, float], uncounted: tuple[float, float]
) -> tuple[float, float]:
  """`cost_analysis()`'s (flops, bytes) plus `uncounted_cost`'s."""
  return analysed[0] + uncounted[0], analysed[1] + uncounted[1]
