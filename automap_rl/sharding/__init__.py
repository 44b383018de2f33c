"""Decisions and their resolution into per-value and per-op shardings.

A strategy is an ordered list of `Decision(target, axis)`; earlier decisions win. A target
is an argument dimension (`ArgDim`, Automap's action), a named dimension (its class id,
TOAST's) or a `Group` of classes. Every target expands to classes; every dimension of a
class then takes the axis in decision order, unless its value (op) already uses the axis on
another dimension (factor) or the size does not divide. A dimension split over several
axes lays them out with the axis more values of its class are split over major
(`specs.dim_axes`): the order decides which decision wins, not the layout of the shards.

Resolution is a pure `jax.numpy` function of small arrays: the program is compressed to
its unique value and op *signatures* (the classes and sizes of their dims or factors),
since every value (op) of one signature resolves the same way. A 12-layer GPT training
step of ~7000 ops has a few hundred signatures.

Modules, one job each: `decisions` (the user's decisions and their classes),
`signatures` (the compressed program), `resolution` (the one rule and its batched,
bit-packed form), `specs` (`PartitionSpec`s of a resolved plan).
"""

from automap_rl.sharding.decisions import ArgDim, Decision, Group, classes_of, encode
from automap_rl.sharding.resolution import (
  NO_SLOT_RANK,
  Owners,
  Resolution,
  apply_decision,
  decision_slots,
  resolve,
  resolve_batch_last,
  resolve_tile,
  takes_axis,
  with_slots,
)
from automap_rl.sharding.signatures import (
  LINEAR_COMBINES,
  Signatures,
  divisibility_bits,
  pending_partial_sums,
  signatures,
)
from automap_rl.sharding.specs import class_axis_use, dim_axes, op_partition_specs, partition_spec

__all__ = [
  "LINEAR_COMBINES",
  "NO_SLOT_RANK",
  "ArgDim",
  "Decision",
  "Group",
  "Owners",
  "Resolution",
  "Signatures",
  "apply_decision",
  "class_axis_use",
  "classes_of",
  "decision_slots",
  "dim_axes",
  "divisibility_bits",
  "encode",
  "op_partition_specs",
  "partition_spec",
  "pending_partial_sums",
  "resolve",
  "resolve_batch_last",
  "resolve_tile",
  "signatures",
  "takes_axis",
  "with_slots",
]
