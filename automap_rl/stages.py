"""A pipelined step as its stages run it: each op's stage and phase, and the microbatch
program whose per-op costs price one stage's share of one microbatch.

The microbatch program is the traced program with sizes changed, not a new trace: every
dimension and op factor of the batch's named dimensions (the leading dims of the inputs)
is divided by M and, for a scanned stack, every dimension of its layer classes by S and
its loops' trip counts by S (a stage runs L / S iterations). Values and ops keep their
ids, named dimensions and signatures; flops scale with the product of an op's factor
sizes (contractions, convolutions, elementwise ops; reductions are counted again from
their new shapes) and memory traffic follows the new shapes. This is what a trace at
microbatch size gives, for every value something reads (`tests/test_pipeline.py`), at
no cost and without the user's function, so the simulator's per-op terms on it are the
step's at microbatch size: rooflines of small microbatches turn memory-bound, collectives
of activations shrink, those of weights do not. A dimension that held its size as the
product of its factors and no longer does (a batch held as a minor part of a merged dim)
is refused with an error naming the op.

Phases (`Phase`), from the dataflow and the batch's named dimensions:

* MICROBATCH: ops with a batch factor, and ops on the batch that feed such ops: forward
  and backward work, once per microbatch.
* ACCUMULATED: microbatch ops whose results feed no per-microbatch work (weight
  gradients, the loss): computed per microbatch, their partial sums accumulate locally
  and reduce once per step.
* STEP: everything else, once per step: weight preprocessing (casts), which XLA hoists out
  of the microbatch loop as it hoists loop invariants, and the optimizer update. Not the
  ops of a scanned stack's loop body that depend on its layer: a stage runs its layers'
  loop in every iteration of the stages' loop, so a slice of a stacked weight and what is
  made of it (a cast, a transpose) run per microbatch (MICROBATCH, as they feed its work),
  and so does the stacking of a weight's gradients (ACCUMULATED).

The forward pass is what the loss depends on; the backward pass the other microbatch
ops. Those the trace makes before the loss (the factors a derivative needs, the stacking
of a scanned stack's residuals) run in the forward pass's time: what they make for the
backward pass is its residuals, one set per microbatch in flight.

Stages: the stack's own ops (`ir.stacks`) run on their layer's stage (a scanned stack's
on every stage, each on its own layers). Other forward ops go by the nearest layers they
depend on and that depend on them: an op between two layers of one stage runs there.
Ops off the stack's span run per microbatch on the stage next to them, as Megatron-LM and
MaxText run them: those with no layer before them (the embedding) on the first stage,
those with no layer after them (the head and the loss) on the last; no op but the stack's
own runs on every stage, and none at the whole batch. A weight's gradient with no layer on
either side (the head's gradient of an embedding the first stage also reads) runs where what
it reads is made: the lowered loop sums the gradients of the weights outside the stack over
the stage axis once a step, and sends none of their operands. Ops between the last layer
of one stage and the first of the next (a residual add, the next layer norm) are placed by
a minimum cut of the bytes that cross the boundary: the cut falls on the residual stream
of a transformer.
The backward pass mirrors the forward (its layers run downwards); the forward-time ops
of the backward pass go with the forward op they read from last. A parameter is owned
by the stage of the first microbatch op that reads it; its step ops (cast, optimizer
update, the sum of its gradient's contributions) run there, other step ops with the
first microbatch op they feed.

The stages' loop (`StagedProgram.looped`): the microbatch ops that run in the schedule's
loop (`xla.scheduled`: a tick table of forwards and backwards), whose time the bubble's
S - 1 stage-times (over V) wait for as the M microbatches' do.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import numpy as np
from scipy.cluster.hierarchy import DisjointSet
from scipy.sparse import coo_array
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from automap_rl.ir import NamedDims, Op, Program, Role
from automap_rl.ir.stacks import EVERY_LAYER, OUTSIDE, LayerStack
from automap_rl.mesh import Mesh
from automap_rl.microbatch import resized
from automap_rl.pipeline import Pipeline

EVERY_STAGE = -1  # The stage of a scanned stack's ops: every stage runs them on its layers.


class Phase(enum.IntEnum):
  """How often an op runs in a pipelined step (see the module docstring)."""

  MICROBATCH = 0
  ACCUMULATED = 1
  STEP = 2


@dataclasses.dataclass(frozen=True)
class Transfer:
  """A value one stage sends another: per microbatch (an activation forward, its gradient
  backward) or once per step (a layer's gradient summed on another stage).

  Attributes:
    value: the value id.
    stage: the sending stage (`EVERY_STAGE`: a scanned stack's carry, which every stage
      sends its successor).
    backward: sent by the backward pass (a gradient), else by the forward.
    per_step: sent once per step, else once per microbatch.
  """

  value: int
  stage: int
  backward: bool
  per_step: bool


@dataclasses.dataclass(frozen=True, eq=False)
class StagedProgram:
  """A pipeline's stages on a program.

  Attributes:
    pipeline: the pipeline.
    stack: the layer stack it pipelines.
    program: the microbatch program (module docstring): per-op costs of one stage's
      share of one microbatch.
    mesh: the stage mesh (`Pipeline.stage_mesh`).
    op_stage: stage of each op, `EVERY_STAGE` for a scanned stack's ops, int [num_ops].
    op_phase: `Phase` of each op, int [num_ops].
    forward: whether each op runs in the forward pass's time: the ops the loss depends
      on, and the backward pass's ops the trace makes before the loss (the factors a
      derivative needs, the stacking of a scanned stack's residuals), bool [num_ops].
    loop_invariant: per op, per operand, whether the read is of a value made once per
      step (an argument, a step op's result) by an op that runs per microbatch: XLA
      hoists its resharding out of the loop, bool tuples.
    weight_reads: per op, per operand, whether a microbatch op reads a value the batch
      does not reach (a weight, a slice of a stacked weight, what is made of them): what
      `Pipeline.gather_weights_once` gathers before the loop, bool tuples.
    value_stage: stage of each value: its producer's; an argument's first reader's (0
      when unread), int [num_values].
    residual_stages: per value made in the forward pass's time and read in the backward
      pass's (a per-microbatch activation kept for the backward pass), the stages that
      keep it (its backward readers'), value id -> stages.
    transfers: the values stages send one another.
    looped: whether each op runs in the stages' loop (module docstring): the microbatch
      ops, bool [num_ops].
  """

  pipeline: Pipeline
  stack: LayerStack
  program: Program
  mesh: Mesh
  op_stage: np.ndarray
  op_phase: np.ndarray
  forward: np.ndarray
  loop_invariant: tuple[tuple[bool, ...], ...]
  weight_reads: tuple[tuple[bool, ...], ...]
  value_stage: np.ndarray
  residual_stages: dict[int, frozenset[int]]
  transfers: tuple[Transfer, ...]
  looped: np.ndarray

  @classmethod
  def build(
    cls, program: Program, named: NamedDims, mesh: Mesh, pipeline: Pipeline
  ) -> StagedProgram:
    """Places `program`'s ops on `pipeline`'s stages (ValueError: see `Pipeline.check`)."""
    stack = pipeline.check(program, named, mesh)
    graph = _Graph(program)
    batch = _batch_classes(program, named)
    loops = layers_loop(program, stack)
    phase = _phases(program, named, graph, batch, _layer_dependent(program, loops))
    forward = _forward(program, graph, phase)
    last_forward = np.flatnonzero(forward).max(initial=-1)
    forward_time = forward | ((phase != Phase.STEP) & (np.arange(program.num_ops) < last_forward))
    layer_stage = pipeline.layer_stages(stack.layers)
    op_stage = _place(program, graph, stack, layer_stage, phase, forward, forward_time)
    value_stage = np.zeros(program.num_values, np.int64)
    for op in reversed(program.ops):
      value_stage[list(op.operands)] = op_stage[op.id]
    for op in program.ops:
      value_stage[list(op.results)] = op_stage[op.id]
    ratios = {c: pipeline.microbatches for c in batch}
    loop_ratio = 1
    if stack.scanned:
      ratios.update({c: pipeline.stages for c in stack.layer_classes})
      loop_ratio = pipeline.stages
    return cls(
      pipeline,
      stack,
      resized(program, named, ratios, loops, loop_ratio),
      pipeline.stage_mesh(mesh),
      op_stage,
      phase,
      forward_time,
      _loop_invariant_reads(program, phase),
      _weight_reads(program, phase),
      value_stage,
      _residuals(program, graph, phase, forward_time, op_stage),
      _transfers(program, graph, stack, pipeline.stages, phase, forward_time, op_stage),
      phase != Phase.STEP,
    )


class _Graph:
  """Producers and readers of a program's values."""

  def __init__(self, program: Program):
    self.producer = {v: op.id for op in program.ops for v in op.results}
    self.readers: dict[int, list[int]] = {}
    for op in program.ops:
      for v in dict.fromkeys(op.operands):
        self.readers.setdefault(v, []).append(op.id)

  def producers(self, op: Op) -> list[int]:
    return [self.producer[v] for v in op.operands if v in self.producer]

  def consumers(self, op: Op) -> list[int]:
    return [r for v in op.results for r in self.readers.get(v, ())]


def layers_loop(program: Program, stack: LayerStack) -> np.ndarray:
  """The ops of a scanned stack's loop over its layers (none for an unrolled stack), bool
  [num_ops]."""
  return np.array(
    [stack.op_layer[op.id] == EVERY_LAYER and op.scope.startswith("scan") for op in program.ops],
    bool,
  ).reshape(program.num_ops)


def _loop_invariant_reads(program: Program, phase: np.ndarray) -> tuple[tuple[bool, ...], ...]:
  """Per op, per operand: a microbatch op reading a value made once per step (an
  argument other than the batch, a step op's result)."""
  made_per_step = np.array(
    [v.role not in (Role.INPUT, Role.INTERMEDIATE, Role.OUTPUT) for v in program.values]
  )
  for op in program.ops:
    made_per_step[list(op.results)] = phase[op.id] == Phase.STEP
  return tuple(
    tuple(bool(phase[op.id] != Phase.STEP and made_per_step[v]) for v in op.operands)
    for op in program.ops
  )


def _weight_reads(program: Program, phase: np.ndarray) -> tuple[tuple[bool, ...], ...]:
  """Per op, per operand: a microbatch op reading a value the batch (the inputs of role
  `input`) does not reach."""
  on_batch = np.array([v.role == Role.INPUT for v in program.values])
  for op in program.ops:
    if any(on_batch[v] for v in op.operands):
      on_batch[list(op.results)] = True
  return tuple(
    tuple(bool(phase[op.id] != Phase.STEP and not on_batch[v]) for v in op.operands)
    for op in program.ops
  )


def _batch_classes(program: Program, named: NamedDims) -> set[int]:
  """The named dimensions of the inputs' leading (batch) dims."""
  return {int(named.class_of(v, 0)) for v in program.batch_inputs} - {-1}


def _layer_dependent(program: Program, loop_body: np.ndarray) -> np.ndarray:
  """Which ops of a scanned stack's loop body (`loop_body`, bool [num_ops]) depend on the
  layer the loop is at: its slices of the stacked inputs, its stacking of per-layer
  outputs, and the ops that read what those make; bool [num_ops]. The others are loop
  invariants, which XLA hoists out of the loop."""
  dependent = np.zeros(program.num_ops, bool)
  made = np.zeros(program.num_values, bool)
  for op in program.ops:
    if loop_body[op.id] and (
      op.primitive in ("scan_slice", "scan_stack") or any(made[v] for v in op.operands)
    ):
      dependent[op.id] = True
      made[list(op.results)] = True
  return dependent


def _phases(
  program: Program, named: NamedDims, graph: _Graph, batch: set[int], per_layer: np.ndarray
) -> np.ndarray:
  """The `Phase` of each op (module docstring; `per_layer`: the ops of a scanned stack's
  loop body that depend on its layer, `_layer_dependent`), int [num_ops]."""
  has_batch = np.array(
    [bool(batch & set(named.op_factor_classes(op.id).tolist())) for op in program.ops]
  )
  on_batch = np.array([v.role == Role.INPUT for v in program.values])
  for op in program.ops:
    if any(on_batch[v] for v in op.operands):
      on_batch[list(op.results)] = True
  feeds = np.zeros(program.num_ops, bool)  # Some result reaches an op with a batch factor.
  for op in reversed(program.ops):
    feeds[op.id] = any(has_batch[c] or feeds[c] for c in graph.consumers(op))
  microbatch = has_batch | (
    feeds & np.array([any(on_batch[v] for v in op.operands) for op in program.ops])
  )
  microbatch |= per_layer  # Each stage runs its layers' loop in every iteration.
  return np.where(
    microbatch, np.where(feeds, Phase.MICROBATCH, Phase.ACCUMULATED), Phase.STEP
  ).astype(np.int64)


def _forward(program: Program, graph: _Graph, phase: np.ndarray) -> np.ndarray:
  """Microbatch ops of the forward pass: those the outputs that do not read the optimizer
  state (the loss, updated model state) depend on; in a program without optimizer state,
  those the rank-0 outputs (the loss) depend on."""
  reads_state = np.array([v.role == Role.OPTIMIZER_STATE for v in program.values])
  for op in program.ops:
    if any(reads_state[v] for v in op.operands):
      reads_state[list(op.results)] = True
  has_state = any(program.values[v].role == Role.OPTIMIZER_STATE for v in program.inputs)
  targets = [
    v
    for v in program.outputs
    if (not reads_state[v] if has_state else not program.values[v].shape) and v in graph.producer
  ]
  forward = np.zeros(program.num_ops, bool)
  todo = [graph.producer[v] for v in targets]
  while todo:
    o = todo.pop()
    if not forward[o]:
      forward[o] = True
      todo.extend(graph.producers(program.ops[o]))
  return forward & (phase != Phase.STEP)


def _place(
  program: Program,
  graph: _Graph,
  stack: LayerStack,
  layer_stage: np.ndarray,
  phase: np.ndarray,
  forward: np.ndarray,
  forward_time: np.ndarray,
) -> np.ndarray:
  """The stage of every op (module docstring), int [num_ops]."""
  anchored = stack.op_layer != OUTSIDE
  stage = np.full(program.num_ops, OUTSIDE, np.int64)
  stage[anchored] = np.where(
    stack.op_layer[anchored] == EVERY_LAYER,
    EVERY_STAGE,
    layer_stage[np.maximum(stack.op_layer[anchored], 0)],
  )
  backward = (phase != Phase.STEP) & ~forward
  # Backward-pass ops made in the forward pass's time go with the last forward op that
  # makes or reads what they read.
  helper = forward_time & ~forward & ~anchored
  _place_pass(program, graph, stack, layer_stage, phase, forward, True, stage)
  for o in np.flatnonzero(helper):
    near = [
      n
      for v in program.ops[o].operands
      for n in [graph.producer.get(v, -1), *graph.readers.get(v, ())]
      if n >= 0 and (forward[n] or helper[n]) and stage[n] != OUTSIDE
    ]
    if near:
      stage[o] = stage[max(near)]
  _place_step_ops(program, graph, phase, stage)
  _place_pass(program, graph, stack, layer_stage, phase, backward & ~helper, False, stage)
  for op in program.ops:  # A weight's gradient off the stack: where what it reads is made.
    if stage[op.id] == OUTSIDE and phase[op.id] == Phase.ACCUMULATED:
      near = [p for p in graph.producers(op) if stage[p] not in (OUTSIDE, EVERY_STAGE)]
      if near:
        stage[op.id] = stage[max(near)]
  for op in reversed(
    program.ops
  ):  # What is left (constants, ops off the stack): with a placed reader,
    if stage[op.id] == OUTSIDE:
      near = [c for c in graph.consumers(op) if stage[c] != OUTSIDE]
      stage[op.id] = stage[min(near)] if near else OUTSIDE
  for op in program.ops:  # else with a placed producer, else on the first stage.
    if stage[op.id] == OUTSIDE:
      near = [p for p in graph.producers(op) if stage[p] != OUTSIDE]
      stage[op.id] = stage[max(near)] if near else 0
  return stage


def _place_pass(
  program: Program,
  graph: _Graph,
  stack: LayerStack,
  layer_stage: np.ndarray,
  phase: np.ndarray,
  in_pass: np.ndarray,
  upward: bool,
  stage: np.ndarray,
) -> None:
  """Places the unplaced ops of one pass, in place: by the nearest anchored layer below
  and above each (the forward pass runs the layers upwards, so the layers below are
  upstream; the backward pass downwards), ops between two stages by a minimum cut."""
  num_layers = stack.layers
  anchored = stack.op_layer != OUTSIDE
  low = np.where(
    stack.op_layer == EVERY_LAYER, 0, stack.op_layer
  )  # The anchor's first and last layer.
  high = np.where(stack.op_layer == EVERY_LAYER, num_layers - 1, stack.op_layer)
  below = _reach(program, graph, in_pass, anchored, high, -1, np.maximum, down=not upward)
  above = _reach(program, graph, in_pass, anchored, low, num_layers, np.minimum, down=upward)
  stage_of = lambda layer: int(layer_stage[min(max(layer, 0), num_layers - 1)])
  gaps = []
  for o in np.flatnonzero(in_pass & (stage == OUTSIDE)):
    lower, upper = int(below[o]), int(above[o])
    if lower == -1 and upper == num_layers:
      continue  # Off the stack: placed with its neighbours.
    if lower == -1 and not upward and upper > 0:
      lower = upper - 1  # A backward dead end (a bias's gradient) may run a stage lower.
    if lower == -1 or upper == num_layers:  # Off the stack's span (module docstring).
      stage[o] = stage_of(upper if lower == -1 else lower)
    elif stage_of(lower) == stage_of(upper):
      stage[o] = stage_of(lower)
    else:  # Between two stages: on the side data comes from first, then cut.
      source, target = (
        (stage_of(lower), stage_of(upper)) if upward else (stage_of(upper), stage_of(lower))
      )
      stage[o] = source
      gaps.append((int(o), target))
  _cut(program, graph, stage, gaps, phase)


def _reach(
  program: Program,
  graph: _Graph,
  in_pass: np.ndarray,
  anchored: np.ndarray,
  layer: np.ndarray,
  none: int,
  combine,
  down: bool,
) -> np.ndarray:
  """Per op of the pass, `combine` (max or min) of `layer` over the anchored ops of the
  pass it reaches (downstream, or that reach it), itself included; `none` where none."""
  out = np.full(program.num_ops, none, np.int64)
  order = reversed(program.ops) if down else program.ops
  for op in order:
    if not in_pass[op.id]:
      continue
    near = graph.consumers(op) if down else graph.producers(op)
    found = [out[n] for n in near if in_pass[n]] + ([layer[op.id]] if anchored[op.id] else [])
    if found:
      out[op.id] = combine.reduce(found)
  return out


def _cut(
  program: Program,
  graph: _Graph,
  stage: np.ndarray,
  gaps: Sequence[tuple[int, int]],
  phase: np.ndarray,
) -> None:
  """Places the ops between two stages (`gaps`: (op, the later stage), the op on the
  earlier one for now) where the fewest bytes cross, in place: a minimum cut between the
  earlier stage's placed ops and the later stage's, with a node per value so that a
  value costs its bytes once however many ops read it across, and infinite capacities
  that keep dataflow one-way (no op of the earlier stage reads one of the later)."""
  pairs: dict[tuple[int, int], list[int]] = {}
  for o, target in gaps:
    pairs.setdefault((int(stage[o]), target), []).append(o)
  for (source, target), ops in pairs.items():
    index = {o: i + 2 for i, o in enumerate(ops)}  # Node 0: the earlier stage, 1: the later.
    node = lambda o: index.get(o, 0 if stage[o] == source else 1 if stage[o] == target else None)
    edges: list[tuple[int, int, float]] = []
    values = {v for o in ops for v in (*program.ops[o].operands, *program.ops[o].results)}
    for v in sorted(values):
      made_by = (
        node(graph.producer[v])
        if v in graph.producer and phase[graph.producer[v]] != Phase.STEP
        else None
      )
      read_by = {node(r) for r in graph.readers.get(v, ())} - {None, made_by}
      if made_by is None or not read_by:
        continue
      aux = len(index) + 2 + len(edges)  # A fresh node per value.
      edges.append((made_by, aux, float(program.values[v].nbytes)))
      edges += [(aux, r, math.inf) for r in read_by] + [(r, made_by, math.inf) for r in read_by]
    later = _later_side(len(index) + 2 + len(edges), edges)
    for o, i in index.items():
      stage[o] = target if later[i] else source


def _later_side(num_nodes: int, edges: Sequence[tuple[int, int, float]]) -> np.ndarray:
  """The nodes on the sink's (node 1's) side of a minimum cut from node 0, bool
  [num_nodes]. Capacities are scaled to integers summing to at most 2**20 (scipy's
  max-flow takes int32), and an infinite one to more than all of them together."""
  later = np.ones(num_nodes, bool)
  later[0] = False
  if not edges:
    return later
  rows, cols, caps = (np.array(x) for x in zip(*edges))
  finite = np.isfinite(caps)
  scaled = np.maximum(np.where(finite, caps, 0.0) / max(caps[finite].sum() / 2**20, 1e-9), 1.0)
  infinite = int(scaled[finite].sum()) + 1
  capacity = coo_array(
    (np.where(finite, scaled, infinite).astype(np.int64), (rows, cols)),
    shape=(num_nodes, num_nodes),
  ).tocsr()
  capacity.sum_duplicates()
  capacity.data = np.minimum(capacity.data, infinite).astype(np.int32)
  flow = maximum_flow(capacity, 0, 1).flow
  residual = (capacity - flow).tocsr()
  residual.data = (residual.data > 0).astype(np.int8)
  residual.eliminate_zeros()
  later[breadth_first_order(residual, 0, return_predecessors=False)] = False
  return later


def _place_step_ops(program: Program, graph: _Graph, phase: np.ndarray, stage: np.ndarray) -> None:
  """Places the step ops, in place: a parameter is owned by the stage of the first
  microbatch op that reads it (through its casts); the step ops connected through
  non-scalar step values (a weight's cast, its optimizer update, the sum of its gradient
  contributions) run on the owner of the first parameter they read; others on the stage
  of the first microbatch op they feed."""
  num_ops = program.num_ops
  step = phase == Phase.STEP
  first_reached = np.full(
    num_ops, num_ops, np.int64
  )  # The earliest placed microbatch op downstream.
  for op in reversed(program.ops):
    for c in graph.consumers(op):
      first_reached[op.id] = min(
        first_reached[op.id], first_reached[c] if step[c] else c if stage[c] != OUTSIDE else num_ops
      )
  joined = DisjointSet(np.flatnonzero(step).tolist())
  for op in program.ops:
    if step[op.id]:
      for p in graph.producers(op):
        if step[p] and program.values[program.ops[p].results[0]].shape:
          joined.merge(p, op.id)
  owner = {}  # Parameter -> the stage of the first placed microbatch op it reaches.
  for v in program.inputs:
    if program.values[v].role == Role.PARAMETER:
      reached = [first_reached[r] if step[r] else r for r in graph.readers.get(v, ())]
      reached = [r for r in reached if r < num_ops and stage[r] != OUTSIDE]
      if reached:
        owner[v] = stage[min(reached)]
  for members in joined.subsets():
    unplaced = [o for o in members if stage[o] == OUTSIDE]
    read = sorted((o, v) for o in members for v in program.ops[o].operands if v in owner)
    if read:
      stage[unplaced] = owner[read[0][1]]
    else:
      for o in unplaced:
        if first_reached[o] < num_ops:
          stage[o] = stage[first_reached[o]]


def _residuals(
  program: Program, graph: _Graph, phase: np.ndarray, forward: np.ndarray, stage: np.ndarray
) -> dict[int, frozenset[int]]:
  """Values made in the forward pass's time and read in the backward's -> the stages of
  their backward readers."""
  out = {}
  for v, p in graph.producer.items():
    if forward[p]:
      keepers = {
        int(stage[r]) for r in graph.readers.get(v, ()) if phase[r] != Phase.STEP and not forward[r]
      }
      if keepers:
        out[v] = frozenset(keepers)
  return out


def _transfers(
  program: Program,
  graph: _Graph,
  stack: LayerStack,
  stages: int,
  phase: np.ndarray,
  forward: np.ndarray,
  stage: np.ndarray,
) -> tuple[Transfer, ...]:
  """A scanned stack's carries (each stage sends its successor the carry of its last
  layer, when there are stages); values made on one stage and read on another, but for the
  gradient sums of ops outside the stack that step ops read (the lowered loop sums them over
  the stage axis, `simulator.pipeline_tables`' stage sums)."""
  out = [
    Transfer(v, EVERY_STAGE, not forward[graph.producer[v]], False)
    for v in stack.carries
    if stages > 1
  ]
  for v, p in graph.producer.items():
    if phase[p] == Phase.STEP or stage[p] == EVERY_STAGE:
      continue
    readers = [r for r in graph.readers.get(v, ()) if stage[r] not in (stage[p], EVERY_STAGE)]
    per_step = all(phase[r] == Phase.STEP for r in readers)
    if readers and not (per_step and stack.op_layer[p] == OUTSIDE):
      out.append(Transfer(v, int(stage[p]), not forward[p], per_step))
  return tuple(out)
