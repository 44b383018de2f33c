"""Inspection of compiled XLA modules: collectives, flops and memory.

The entry point is `inspect_compiled`, which reads the optimized, SPMD partitioned HLO
text of `jax.jit(f).lower(...).compile()` together with its `memory_analysis()` and
`cost_analysis()`. One module per job, each a handful of pure functions over strings so
that each piece can be tested on hand-written HLO:

* `module`: array types, instructions, computations and how often loops run them;
* `groups`: replica groups in their three formats, XLA's device id modes, mesh axes;
* `sharding`: `sharding=` attributes as the mesh axes of each array dim;
* `collectives`: the collectives of a module and their bytes (the byte convention
  shared with the simulator);
* `cost`: the flops and bytes of each kernel, and of what `cost_analysis()` counts
  otherwise than the module runs (loop iterations, the branches of conditionals);
* `compiled`: all of it for a `jax.stages.Compiled`.
"""

from automap_rl.xla.hlo.collectives import (
  COLLECTIVE_KINDS,
  Collective,
  collectives_from_hlo,
  module_collectives,
  summarize,
)
from automap_rl.xla.hlo.compiled import CompiledStats, inspect_compiled
from automap_rl.xla.hlo.cost import (
  instruction_bytes,
  instruction_flops,
  kernel_costs,
  uncounted_cost,
)
from automap_rl.xla.hlo.groups import (
  axes_for_groups,
  crossed_axes,
  device_groups,
  group_mode,
  mesh_axes_groups,
  parse_explicit_groups,
  parse_iota_groups,
  parse_mesh_groups,
  parse_replica_groups,
  permute_groups,
)
from automap_rl.xla.hlo.module import (
  Instruction,
  Module,
  Taken,
  computation_repeats,
  computations,
  element_bytes,
  parse_instruction,
  parse_module,
  parse_shapes,
  shape_bytes,
)
from automap_rl.xla.hlo.sharding import Spec, sharding_attr, sharding_spec, split_tuple_sharding

__all__ = [
  "COLLECTIVE_KINDS",
  "Collective",
  "CompiledStats",
  "Instruction",
  "Module",
  "Spec",
  "Taken",
  "axes_for_groups",
  "collectives_from_hlo",
  "computation_repeats",
  "computations",
  "crossed_axes",
  "device_groups",
  "element_bytes",
  "group_mode",
  "inspect_compiled",
  "instruction_bytes",
  "instruction_flops",
  "kernel_costs",
  "mesh_axes_groups",
  "module_collectives",
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
  "uncounted_cost",
]
