"""Collectives, flops and memory of a `jax.stages.Compiled`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from automap_rl.xla.hlo.collectives import Collective, module_collectives
from automap_rl.xla.hlo.cost import kernel_costs, uncounted_loop_cost
from automap_rl.xla.hlo.module import parse_module


@dataclasses.dataclass(frozen=True)
class CompiledStats:
  """Per-device costs of a compiled module.

  Attributes:
    collectives: Collectives in program text order.
    flops: XLA's flop count for one device's program, every loop iteration
      counted (`cost_analysis()` counts a while body once; `uncounted_loop_cost`
      adds the other iterations).
    bytes_accessed: XLA's estimate of memory traffic, bytes, every loop
      iteration counted likewise.
    kernels: `(flops, bytes accessed)` per step of each kernel (`cost.kernel_costs`),
      for a per-kernel roofline.
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
    kernels=kernel_costs(module),
    argument_bytes=argument,
    output_bytes=output,
    temp_bytes=temp,
    alias_bytes=alias,
    peak_bytes=argument + output + temp - alias,
  )
