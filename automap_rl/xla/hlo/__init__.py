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
* `cost`: the flops and bytes of each kernel, and of the loop iterations
  `cost_analysis()` leaves out;
* `compiled`: all of it for a `jax.stages.Compiled`.
"""

from automap_rl.xla.hlo.collectives import COLLECTIVE_KINDS
from automap_rl.xla.hlo.collectives import Collective
from automap_rl.xla.hlo.collectives import collectives_from_hlo
from automap_rl.xla.hlo.collectives import module_collectives
from automap_rl.xla.hlo.collectives import summarize
from automap_rl.xla.hlo.compiled import CompiledStats
from automap_rl.xla.hlo.compiled import inspect_compiled
from automap_rl.xla.hlo.cost import instruction_bytes
from automap_rl.xla.hlo.cost import instruction_flops
from automap_rl.xla.hlo.cost import kernel_costs
from automap_rl.xla.hlo.cost import uncounted_loop_cost
from automap_rl.xla.hlo.groups import axes_for_groups
from automap_rl.xla.hlo.groups import crossed_axes
from automap_rl.xla.hlo.groups import device_groups
from automap_rl.xla.hlo.groups import group_mode
from automap_rl.xla.hlo.groups import mesh_axes_groups
from automap_rl.xla.hlo.groups import parse_explicit_groups
from automap_rl.xla.hlo.groups import parse_iota_groups
from automap_rl.xla.hlo.groups import parse_mesh_groups
from automap_rl.xla.hlo.groups import parse_replica_groups
from automap_rl.xla.hlo.groups import permute_groups
from automap_rl.xla.hlo.module import Instruction
from automap_rl.xla.hlo.module import Module
from automap_rl.xla.hlo.module import computation_repeats
from automap_rl.xla.hlo.module import computations
from automap_rl.xla.hlo.module import element_bytes
from automap_rl.xla.hlo.module import parse_instruction
from automap_rl.xla.hlo.module import parse_module
from automap_rl.xla.hlo.module import parse_shapes
from automap_rl.xla.hlo.module import shape_bytes
from automap_rl.xla.hlo.sharding import Spec
from automap_rl.xla.hlo.sharding import sharding_attr
from automap_rl.xla.hlo.sharding import sharding_spec
from automap_rl.xla.hlo.sharding import split_tuple_sharding

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CompiledStats",
    "Instruction",
    "Module",
    "Spec",
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
    "uncounted_loop_cost",
]
