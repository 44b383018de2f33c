"""The op sub-tables of `CostTables`: each op's flops, and its compute and HBM time summed
onto its op signature (or, for ops that shard like their values, its first result's value
signature), with the repeat counts and resharding shares its operand edges take (numpy)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import numpy as np

from automap_rl.ir import Op, Program
from automap_rl.ir.rules import conv_batch_group_factor
from automap_rl.mesh import Hardware
from automap_rl.sharding import Signatures
from automap_rl.simulator.fusion import (
  fusion_copies,
  kernel_intermediates,
  kernel_launches,
  memory_traffic,
)


def op_flops(program: Program, op: Op) -> float:
  """Flops of one call of `op`: `op.flops` when the tracer set it (XLA's convention, see
  `automap_rl.ir.flops`); for hand-built ops, 2 per multiply-add for contractions (the
  full window for convolutions), else one per element."""
  if op.flops is not None:
    return op.flops
  if op.primitive == "dot_general":
    return 2.0 * math.prod(op.rule.factor_sizes)
  if op.primitive == "conv_general_dilated":
    out = program.values[op.results[0]]
    rhs = program.values[op.operands[1]]
    out_features = rhs.shape[op.rule and _conv_out_feature_dim(op, program)]
    return 2.0 * out.size * rhs.size / max(out_features, 1)
  sizes = [program.values[v].size for v in (*op.operands, *op.results)]
  return float(max(sizes, default=0))


def program_flops(program: Program, shapes: Sequence[Sequence[int]] | None = None) -> np.ndarray:
  """Flops of one call of each op as XLA's compiled CPU module does them, [num_ops]:
  `op_flops` times how often the module computes the op (`fusion.fusion_copies`: 0 once
  CSE merges it or constant folding removes it, more when fusion clones it into several
  consumers), for values of these per-device shapes (default: global)."""
  copies = fusion_copies(program, shapes)
  return np.array([op_flops(program, op) * n for op, n in zip(program.ops, copies)], np.float64)


def dense_group_factors(program: Program, hardware: Hardware) -> np.ndarray:
  """Per op, the factor whose groups a backend that computes batch-grouped convolutions
  dense (`Hardware.dense_batch_group_conv`) multiplies the op's flops by, -1 for none,
  int [num_ops]. XLA partitions first, so a device computes `G / k` times the flops of
  its share, G the factor's size and k its shards."""
  if not hardware.dense_batch_group_conv:
    return np.full(program.num_ops, -1)
  return np.array(
    [
      conv_batch_group_factor(op.rule) if op.primitive == "conv_general_dilated" else -1
      for op in program.ops
    ]
  )


def _conv_out_feature_dim(op: Op, program: Program) -> int:
  """The kernel dim that maps to the output feature factor (the rhs dim shared with the result)."""
  result_factors = {f for dim in op.rule.result_dims[0] for f in dim}
  for dim, factors in enumerate(op.rule.operand_dims[1]):
    if factors and factors[0] in result_factors:
      return dim
  return 0


class OpSums(NamedTuple):
  """Per-op costs summed onto signatures (float64 sums, in program order). Shapes: Uo op
  signatures, Uv value signatures; `dict`s map an op signature to an array over its
  operands (and results).

  Attributes:
    compute: flop time at peak of the signature's ops, times their repeat counts, [Uo].
    launch: the per-kernel overhead of the kernels the signature's ops launch a step
      (`fusion.kernel_launches`, `Hardware.kernel_overhead_s`), seconds, [Uo].
    value_compute, value_memory, value_launch: flop time, HBM time and kernel overhead of
      the ops with no op signature, by their first result's value signature, [Uv].
    dense_factor: the batch-group factor a backend computes dense (`dense_group_factors`),
      -1 for none, int32 [Uo].
    dots: the signature's ops are dots, bool [Uo].
    weight: the ops' summed repeat counts, [Uo]: the result edges' `edge_weight`.
    buffers: how many ops the signature has, [Uo]: the result edges' `edge_buffers`.
    operand_weight: per operand, its reads' runs a step times their share of a resharding
      (`CostTables.edge_weight`), sig -> [operands].
    operand_buffers: per operand, the shares of reads that share a resharding, sig ->
      [operands].
    operand_transient: per operand, how many reads reshard for themselves alone, sig ->
      [operands].
    use_memory: HBM seconds of each operand, then each result, sig -> [operands + results].
  """

  compute: np.ndarray
  launch: np.ndarray
  value_compute: np.ndarray
  value_memory: np.ndarray
  value_launch: np.ndarray
  dense_factor: np.ndarray
  dots: np.ndarray
  weight: np.ndarray
  buffers: np.ndarray
  operand_weight: dict[int, np.ndarray]
  operand_buffers: dict[int, np.ndarray]
  operand_transient: dict[int, np.ndarray]
  use_memory: dict[int, np.ndarray]


def times_made(program: Program) -> np.ndarray:
  """How often each value is made a step (its op's repeat count; 1 for arguments),
  float64 [num_values]. A loop carry inside the body (the first of a `Program.ties`
  pair) is made as often as the body's value it is tied to: each iteration's carry is
  the last iteration's result, so a resharding of it runs in every iteration (XLA cannot
  hoist it out of the loop), however often the carry's initial value is made."""
  made = np.ones(program.num_values, np.float64)
  for op in program.ops:
    made[list(op.results)] = op.repeat
  for carry, result in program.ties:
    made[carry] = max(made[carry], made[result])
  return made


def sum_ops(
  program: Program,
  sigs: Signatures,
  hw: Hardware,
  dead: AbstractSet[int],
  read_share: dict[tuple[int, int], float],
  made: np.ndarray,
) -> OpSums:
  """Sums each op's flop time, HBM time (bytes as XLA's fused module moves them,
  `fusion.memory_traffic`) and edge weights onto its signature; `dead` ops (XLA removes
  them) cost nothing. `read_share`: each read's share of its operand's resharding
  (`edges.operand_read_shares`); `made`: `times_made`."""
  num_ops = len(sigs.op_keys)
  compute = np.zeros(num_ops, np.float64)
  weight = np.zeros(num_ops, np.float64)
  value_compute = np.zeros(len(sigs.value_keys), np.float64)
  value_memory = np.zeros(len(sigs.value_keys), np.float64)
  launch = np.zeros(num_ops, np.float64)
  value_launch = np.zeros(len(sigs.value_keys), np.float64)
  buffers = np.zeros(num_ops, np.float64)
  operand_weight, operand_buffers, operand_transient, use_memory = {}, {}, {}, {}
  for sig, (_, _, operands, results, _) in enumerate(sigs.op_keys):
    for table in (operand_weight, operand_buffers, operand_transient):
      table[sig] = np.zeros(len(operands), np.float64)
    use_memory[sig] = np.zeros(len(operands) + len(results), np.float64)
  flops = program_flops(program)
  dense = dense_group_factors(program, hw)
  dense_factor = np.full(num_ops, -1, np.int32)
  on_chip = kernel_intermediates(program) if hw.fused_kernels else frozenset()
  traffic = memory_traffic(
    program,
    hw.multi_output_fusion,
    hw.minor_concatenate_fusion,
    on_chip,
    hw.canonical_convolutions,
  )
  overhead_s = kernel_launches(program, traffic, dead) * hw.kernel_overhead_s
  dots = np.zeros(num_ops, bool)
  for op in program.ops:
    if op.id in dead:
      continue
    sig = sigs.op_sig[op.id]
    dtype = program.values[op.results[0]].dtype if op.results else "float32"
    groups = op.rule.factor_sizes[dense[op.id]] if dense[op.id] >= 0 and sig >= 0 else 1
    flop_s = op.repeat * flops[op.id] * groups / hw.achievable_flops(op.primitive, dtype)
    if groups > 1:
      dense_factor[sig] = dense[op.id]
    reads, writes = traffic[op.id]
    memory_s = op.repeat * np.array(reads + writes, np.float64) / hw.hbm_bandwidth
    if sig < 0:  # Sharded like its values: charged to its first result.
      value_compute[sigs.value_sig[op.results[0]]] += flop_s
      value_memory[sigs.value_sig[op.results[0]]] += memory_s.sum()
      value_launch[sigs.value_sig[op.results[0]]] += overhead_s[op.id]
      continue
    compute[sig] += flop_s
    launch[sig] += overhead_s[op.id]
    use_memory[sig] += memory_s
    dots[sig] |= op.primitive == "dot_general"
    weight[sig] += op.repeat
    shares = np.array([read_share[op.id, i] for i in range(len(op.operands))], np.float64)
    operand_weight[sig] += np.minimum(op.repeat, made[list(op.operands)]) * shares
    operand_buffers[sig] += np.where(shares < 1.0, shares, 0.0)  # Copies several reads share.
    operand_transient[sig] += shares == 1.0  # Copies made for this read alone.
    buffers[sig] += 1.0
  return OpSums(
    compute,
    launch,
    value_compute,
    value_memory,
    value_launch,
    dense_factor,
    dots,
    weight,
    buffers,
    operand_weight,
    operand_buffers,
    operand_transient,
    use_memory,
  )
