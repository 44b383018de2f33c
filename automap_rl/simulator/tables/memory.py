"""The memory sub-table of `CostTables`: global bytes of each value signature live at the
points of the program where the peak memory can be (numpy; `live_bytes`)."""

from __future__ import annotations

import itertools

import numpy as np

from automap_rl.ir import Program
from automap_rl.sharding import Signatures
from automap_rl.simulator.fusion import dead_ops, kernel_intermediates, unmaterialized_values

_MEMORY_PROBES = 256


def loop_spans(program: Program) -> list[tuple[int, int]]:
  """The op ranges `(first, last)` of the program's loops, nested ones included: for every
  depth k, maximal runs of consecutive ops at a loop depth of at least k (the `scan` and
  `while` parts of their scope), a run of a scan's `scan_stack` ops joined to its body
  across the carries out between them (`ir.trace` emits body, carries, stacks). Two loops
  one right after the other, with no op between, read as one."""
  ops = program.ops
  depth = [sum(part in ("scan", "while") for part in op.scope.split("/")) for op in ops]
  spans: list[tuple[int, int]] = []
  for k in range(1, max(depth, default=0) + 1):
    level: list[tuple[int, int]] = []
    first = None
    for i, d in enumerate([*depth, 0]):
      if d >= k and first is None:
        first = i
      elif d < k and first is not None:
        if (
          level
          and all(op.primitive == "scan_stack" for op in ops[first:i])
          and all(op.primitive == "scan_carry" for op in ops[level[-1][1] + 1 : first])
        ):
          level[-1] = (level[-1][0], i - 1)
        else:
          level.append((first, i - 1))
        first = None
    spans += level
  return spans


def live_matrix(
  program: Program, sigs: Signatures, loops: bool = True, fused_kernels: bool = False
) -> np.ndarray:
  """Global bytes of each value signature live after each op, [num_ops, Uv].

  Value v is live from the op that makes it to its last use (a dead op's results never); arguments
  from the start,
  and to the end unless donated; outputs to the end. Fused intermediates (see
  `fusion.unmaterialized_values`) take no memory, but their readers recompute them, so
  what they are computed from stays live to their last reader. A loop's body is inlined once
  (`ir.trace`), but it runs every iteration: a value made before the loop and read in it
  (the stacked inputs its `scan_slice` ops read, weights, constants) stays live to the
  loop's last op, and a stacked output (`scan_stack`) is one buffer from the loop's first
  op, as XLA's while loop holds them. `loops=False`: liveness ends at the last read in
  program order (a pipelined stage's rows, whose loop's residual sets and gradient sums
  are pipeline terms of their own). `fused_kernels`: the backend runs fused kernels as one
  (`Hardware.fused_kernels`): their intermediates (`fusion.kernel_intermediates`) stay on
  chip and take no memory.
  """
  num_ops = max(program.num_ops, 1)
  num_sigs = len(sigs.value_keys)
  start = np.zeros(program.num_values, np.int64)
  end = np.zeros(program.num_values, np.int64)
  for op in program.ops:
    for v in op.results:
      start[v] = op.id
      end[v] = max(end[v], op.id)
    for v in op.operands:
      end[v] = max(end[v], op.id)
  for first, last in loop_spans(program) if loops else ():
    for op in program.ops[first : last + 1]:
      for v in op.operands:
        if start[v] < first:
          end[v] = max(end[v], last)
      if op.primitive == "scan_stack":
        start[list(op.results)] = np.minimum(start[list(op.results)], first)
  for value_id, donated in zip(program.inputs, program.donated):
    if not donated:
      end[value_id] = num_ops - 1
  end[list(program.outputs)] = num_ops - 1
  fused = unmaterialized_values(program)
  for op in reversed(program.ops):  # Readers recompute a fused value from its operands.
    if any(v in fused for v in op.results):
      last = max(end[v] for v in op.results)
      for v in op.operands:
        end[v] = max(end[v], last)
  diff = np.zeros((num_ops + 1, num_sigs), np.float64)
  nbytes = np.array([v.nbytes for v in program.values], np.float64)
  nbytes[list(fused)] = 0.0
  if fused_kernels:
    nbytes[list(kernel_intermediates(program))] = 0.0
  for op_id in dead_ops(program):  # XLA's dead-code elimination: never allocated.
    nbytes[list(program.ops[op_id].results)] = 0.0
  np.add.at(diff, (start, sigs.value_sig), nbytes)
  np.add.at(diff, (end + 1, sigs.value_sig), -nbytes)
  return np.cumsum(diff, axis=0)[:num_ops]


def probe_rows(live: np.ndarray, seed: int = 0, kinds: np.ndarray | None = None) -> np.ndarray:
  """The rows of a live-bytes matrix [num_ops, Uv] that can be a peak: those that attain
  the maximum for the replicated plan or for one of `_MEMORY_PROBES` random per-signature
  shard factors, so that `max(rows @ 1/shards)` is the peak for the plans that matter at
  a fraction of the cost, float32 [T, Uv]. With `kinds` (an int per signature, [Uv]),
  also every shard factor per kind (plans shard values of a kind alike: weights apart
  from activations)."""
  rng = np.random.default_rng(seed)
  num_sigs = live.shape[1]
  probes = np.concatenate(
    [np.ones((1, num_sigs)), 1.0 / rng.choice([1, 2, 4, 8, 16], (_MEMORY_PROBES, num_sigs))]
  )
  if kinds is not None:
    _, kinds = np.unique(kinds, return_inverse=True)
    factors = np.array(list(itertools.product([1, 8, 64], repeat=kinds.max() + 1)), np.float64)
    probes = np.concatenate([probes, 1.0 / factors[:, kinds]])
  rows = np.unique(np.argmax(live @ probes.T, axis=0))
  return live[rows].astype(np.float32)
