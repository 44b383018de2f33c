"""XLA's fusion as the cost model sees it: which primitives fuse, and what fusing does to
an op's memory traffic, to how often it is computed and to the memory it holds.

XLA's CPU compiler fuses chains of elementwise ops, data movement and reductions into
loops (`LOOP_FUSIBLE`, XLA's `CanBeLoopFused`). Three consequences are modelled here:

* `memory_traffic`: the bytes an op moves, per operand and result: a loop-fusible op
  reads a loop-fusible producer's result inside their fusion, not from memory.
* `fusion_copies`: how many times the compiled module computes each op: XLA clones cheap
  producers into every fusion that reads them, and `cost_analysis()` counts each fusion's
  instructions, while CSE merges duplicate ops and constant folding removes ops on
  constants alone. XLA's algebraic simplifier also removes some arithmetic (a multiply by
  one, an add of a literal zero, a negation it moves past a sum); that is not modelled.
* `kernel_launches`: how many kernels each op launches a step (each value a fusion or an
  unfused op writes to memory ends one), which a GPU's per-kernel overhead prices.
* `kernel_intermediates`: the values a fused kernel (`ir.kernels`, such as flash
  attention) keeps on chip where the backend runs it fused: no traffic, no memory.
* `unmaterialized_values`: the intermediates that take no memory at the peak. This model
  is narrower than the other two (`KEPT_IN_FUSION` is a subset of `LOOP_FUSIBLE`, and
  only `RECOMPUTED_PER_READER` producers may have several readers), so the peak memory
  errs towards holding a value.

The primitive sets are in `fusion.primitives`, the traffic and peak-memory model in
`fusion.traffic`, and the passes that decide how often an op is computed (with constant
folding and dead-code elimination) in `fusion.copies`; all are importable from here.
"""

from automap_rl.simulator.fusion.copies import constant_ops, dead_ops, fusion_copies
from automap_rl.simulator.fusion.kernels import kernel_intermediates
from automap_rl.simulator.fusion.launches import kernel_launches
from automap_rl.simulator.fusion.primitives import (
  CHEAP_ELEMENTWISE,
  DIVISIONS,
  ELEMENTWISE,
  EXPENSIVE_ELEMENTWISE,
  FUSED_REDUCTIONS,
  KEPT_IN_FUSION,
  LIBRARY_MIN_ELEMENTS,
  LIBRARY_PRODUCERS,
  LIBRARY_REDUCTIONS,
  LOOP_FUSIBLE,
  MAX_FUSED_CONCATENATE_OPERANDS,
  MAX_FUSED_REDUCTIONS,
  MIN_KERNEL_CONCATENATE_BYTES,
  MIN_KERNEL_CONCATENATE_ROW_BYTES,
  MOVEMENT,
  NO_OPS,
  PERMUTING,
  READS_INSIDE_FUSION,
  RECOMPUTED_PER_READER,
  SLICES,
)
from automap_rl.simulator.fusion.traffic import (
  consumers,
  kernel_concatenates,
  memory_traffic,
  unmaterialized_values,
)

__all__ = [
  "CHEAP_ELEMENTWISE",
  "DIVISIONS",
  "ELEMENTWISE",
  "EXPENSIVE_ELEMENTWISE",
  "FUSED_REDUCTIONS",
  "KEPT_IN_FUSION",
  "LIBRARY_MIN_ELEMENTS",
  "LIBRARY_PRODUCERS",
  "LIBRARY_REDUCTIONS",
  "LOOP_FUSIBLE",
  "MAX_FUSED_CONCATENATE_OPERANDS",
  "MAX_FUSED_REDUCTIONS",
  "MIN_KERNEL_CONCATENATE_BYTES",
  "MIN_KERNEL_CONCATENATE_ROW_BYTES",
  "MOVEMENT",
  "NO_OPS",
  "PERMUTING",
  "READS_INSIDE_FUSION",
  "RECOMPUTED_PER_READER",
  "SLICES",
  "constant_ops",
  "consumers",
  "dead_ops",
  "fusion_copies",
  "kernel_concatenates",
  "kernel_intermediates",
  "kernel_launches",
  "memory_traffic",
  "unmaterialized_values",
]
