"""Expert strategies, found from the program's structure, never from parameter names.

Each tactic reads what the step does with each named dimension (`Structure`): which
parameter dims belong to it, whether matmuls (dot_general, convolution) contract or carry
it as a feature, whether they carry it as a batch dim, and whether anything else reduces
over it (normalization statistics, softmax, the loss). The same rules then find the same
dims in a Flax, Haiku or Equinox transformer, whatever its parameters are called:

* tensor-parallel (Megatron) dims are parameter dims that matmuls use as features, that
  no other op reduces over and that no input carries: the FFN hidden dim and the
  attention heads, not the residual width (normalized), the vocabulary (softmax) or the
  sequence. A parameter takes at most one of them, the most major (heads before the
  head dim; in a chain of dense layers, every other hidden dim).
* expert dims are parameter dims that matmuls carry as a batch dim and that something
  reduces over (the router's softmax): the experts of a mixture of experts.
* sequence dims are dim 1 of integer inputs of rank 2 or more (token ids `[batch, seq]`).
* embedding rows are the rows of a parameter table that a gather indexes with token ids
  (an integer input): the vocabulary of a token embedding, which Megatron-LM's
  vocab-parallel embedding splits like the head's.

The data axis is the mesh axis named `data` (else the first); the model axis is `model`
(else the last, the fastest link); FSDP stores parameters over `fsdp` when the mesh has that
axis, FSDP x TP over every axis but the model axis.

`best_expert` is the one definition of the yardstick every ratio is relative to: the
fastest applicable tactic whose plan fits in memory.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from automap_rl import simulator
from automap_rl.ir import FactorKind, Role
from automap_rl.ir.stacks import LayerStack, what_is_looked_for
from automap_rl.pipeline import Pipeline, batch_size
from automap_rl.problem import Problem
from automap_rl.sharding import ArgDim, Decision

MATMULS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class Structure:
  """What the step does with its named dimensions.

  Attributes:
    parameter_dims: class -> the `(path, dim)`s of parameters in it, in argument order.
    tensor_parallel: Megatron's classes, in argument order.
    vocabulary: Megatron's vocabulary-parallel classes, in argument order: output features
      of a projection that a softmax or norm reduces and that no matmul of the forward
      pass contracts (a language model's head, column-parallel, with the loss's reductions
      over the vocabulary all-reduced, as Megatron-LM's vocab-parallel cross entropy does).
    experts: expert classes, in argument order.
    sequence_dims: `(path, dim)` of the sequence dim of every token input.
    embedding_rows: the classes of parameter rows a gather indexes with token ids, in
      argument order (each shard gathers the rows it holds; the partial embeddings are
      summed, as Megatron-LM's vocab-parallel embedding does).
  """

  parameter_dims: dict[int, tuple[tuple[str, int], ...]]
  tensor_parallel: tuple[int, ...]
  vocabulary: tuple[int, ...]
  experts: tuple[int, ...]
  sequence_dims: tuple[tuple[str, int], ...]
  embedding_rows: tuple[int, ...]

  @property
  def kept_on_model(self) -> tuple[int, ...]:
    """The classes that keep the model axis to themselves when storage is also sharded
    (FSDP takes another dim): tensor-parallel ones and embedding rows, which a lookup reads
    split over the model axis alone."""
    return self.tensor_parallel + self.embedding_rows


def _uses(problem: Problem) -> tuple[set[int], set[int], set[int]]:
  """(matmul feature classes, matmul batch classes, classes reduced by other ops)."""
  features, batch, reduced = set(), set(), set()
  for op in problem.program.ops:
    classes = problem.named.op_factor_classes(op.id)
    for factor, kind in enumerate(op.rule.factor_kinds):
      cls = int(classes[factor])
      if cls < 0:
        continue
      if op.primitive not in MATMULS:
        if kind == FactorKind.REDUCTION:
          reduced.add(cls)
      elif kind == FactorKind.REDUCTION:
        features.add(cls)
      elif kind == FactorKind.PASS_THROUGH:
        in_every_operand = all(any(factor in dim for dim in dims) for dims in op.rule.operand_dims)
        (batch if in_every_operand else features).add(cls)
  return features, batch, reduced


def _forward_contractions(problem: Problem) -> set[int]:
  """The classes that a matmul of the forward pass (an op a scalar output, the loss,
  depends on) contracts."""
  program, named = problem.program, problem.named
  producer = {v: op for op in program.ops for v in op.results}
  todo = [producer[v] for v in program.outputs if v in producer and not program.values[v].shape]
  seen: set[int] = set()
  while todo:
    op = todo.pop()
    if op.id not in seen:
      seen.add(op.id)
      todo.extend(producer[v] for v in op.operands if v in producer)
  classes = set()
  for op_id in seen:
    op = program.ops[op_id]
    if op.primitive in MATMULS:
      factors = named.op_factor_classes(op_id)
      kinds = op.rule.factor_kinds
      classes.update(
        int(factors[f])
        for f, k in enumerate(kinds)
        if k == FactorKind.REDUCTION and factors[f] >= 0
      )
  return classes


def _embedding_rows(problem: Problem, parameter_classes: set[int]) -> set[int]:
  """The parameter classes a gather reduces over (rows taken one at a time) whose indices
  come from an integer input of the step (token ids), through any ops but matmuls."""
  program, named = problem.program, problem.named
  producer = {v: op for op in program.ops for v in op.results}

  def from_tokens(value_id: int) -> bool:
    todo, seen = [value_id], set()
    while todo:
      v = todo.pop()
      value = program.values[v]
      if value.role == Role.INPUT and np.issubdtype(np.dtype(value.dtype), np.integer):
        return True
      op = producer.get(v)
      if v not in seen and op is not None and op.primitive not in MATMULS:
        seen.add(v)
        todo.extend(op.operands)
    return False

  rows = set()
  for op in program.ops:
    if op.primitive == "gather" and from_tokens(op.operands[1]):
      classes = named.op_factor_classes(op.id)
      rows.update(
        int(classes[f])
        for f, kind in enumerate(op.rule.factor_kinds)
        if kind == FactorKind.REDUCTION and int(classes[f]) in parameter_classes
      )
  return rows


_STRUCTURES: weakref.WeakKeyDictionary[Problem, Structure] = weakref.WeakKeyDictionary()


def structure(problem: Problem) -> Structure:
  """Reads `Structure` off the problem's ops and named dimensions (once per problem)."""
  if problem not in _STRUCTURES:
    _STRUCTURES[problem] = _read_structure(problem)
  return _STRUCTURES[problem]


def _read_structure(problem: Problem) -> Structure:
  program, named = problem.program, problem.named
  parameter_dims: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
  parameter_classes: list[np.ndarray] = []
  input_classes, sequence_dims = set(), []
  for value_id in program.inputs:
    value, classes = program.values[value_id], named.value_classes(value_id)
    if value.role == Role.PARAMETER:
      parameter_classes.append(classes)
      for dim, cls in enumerate(classes):
        if cls >= 0:
          parameter_dims[int(cls)].append((value.path, dim))
    elif value.role == Role.INPUT:
      input_classes.update(int(c) for c in classes if c >= 0)
      if (
        len(value.shape) >= 2
        and np.issubdtype(np.dtype(value.dtype), np.integer)
        and classes[1] >= 0
      ):
        sequence_dims.append((value.path, 1))
  features, batch, reduced = _uses(problem)
  candidates = {
    c for c in parameter_dims if c in features and c not in reduced and c not in input_classes
  }
  tensor_parallel: list[int] = []
  for classes in parameter_classes:
    picked = [int(c) for c in classes if c in candidates]
    if (
      picked
      and picked[0] not in tensor_parallel
      and not set(tensor_parallel) & set(classes.tolist())
    ):
      tensor_parallel.append(picked[0])
  # Experts: parameter dims that matmuls batch over and a router reduces over (one-hot
  # dispatch), or that no matmul treats as a feature (tokens permuted to them by index).
  experts = [
    c
    for c in parameter_dims
    if c in batch and (c in reduced or c not in features) and c not in input_classes
  ]
  contracted = _forward_contractions(problem)
  vocabulary = [
    c
    for c in parameter_dims
    if c in features
    and c in reduced
    and c not in batch
    and c not in input_classes
    and c not in contracted
    and c not in tensor_parallel
  ]
  embedding_rows = _embedding_rows(problem, set(parameter_dims)) - set(vocabulary)
  return Structure(
    {c: tuple(dims) for c, dims in parameter_dims.items()},
    tuple(tensor_parallel),
    tuple(vocabulary),
    tuple(experts),
    tuple(sequence_dims),
    tuple(c for c in parameter_dims if c in embedding_rows),
  )


def data_axis(problem: Problem) -> str:
  names = problem.mesh.axis_names
  return "data" if "data" in names else names[0]


def model_axis(problem: Problem) -> str:
  names = problem.mesh.axis_names
  return "model" if "model" in names else names[-1]


def _shard_classes(problem: Problem, classes: tuple[int, ...], axis: str) -> list[Decision]:
  """One decision per class, on its first parameter dim (so plans read as paths)."""
  dims = structure(problem).parameter_dims
  return [Decision(ArgDim(*dims[c][0]), axis) for c in classes]


def replicated(problem: Problem) -> list[Decision]:
  """Everything replicated: the baseline every reward is relative to."""
  return []


def data_parallel(problem: Problem) -> list[Decision]:
  """Shard dim 0 of every input (the batch) over the data axis."""
  axis = data_axis(problem)
  return [
    Decision(ArgDim(problem.program.values[v].path, 0), axis) for v in problem.program.batch_inputs
  ]


def megatron(problem: Problem) -> list[Decision]:
  """Megatron tensor parallelism on the model axis: heads and FFN hidden dims
  (column-parallel into, row-parallel out of each block), the head's vocabulary and the
  token embedding's rows."""
  found = structure(problem)
  classes = found.tensor_parallel + found.vocabulary + found.embedding_rows
  return _shard_classes(problem, classes, model_axis(problem))


def data_axes(problem: Problem) -> tuple[str, ...]:
  """Every mesh axis but the model axis, in mesh order: the axes data parallelism and
  ZeRO-3/FSDP use when the model axis carries tensor parallelism."""
  model = model_axis(problem)
  return tuple(a for a in problem.mesh.axis_names if a != model) or (model,)


def _batch_over(problem: Problem, axes: tuple[str, ...]) -> list[Decision]:
  """Data parallelism over `axes`: the batch of every input over each, in order."""
  batch = data_parallel(problem)
  return [Decision(d.target, axis) for axis in axes for d in batch]


def _store_sharded(
  problem: Problem, axes: tuple[str, ...], avoid: tuple[int, ...] = ()
) -> list[Decision]:
  """ZeRO-3 storage: every parameter (and with it its gradient and optimizer state)
  sharded over `axes` on its largest dim that their product divides, gathered at use.
  Dims of the classes in `avoid` (tensor-parallel ones, which keep their own axis) and the
  layer dims of scanned stacks (which pipeline stages split: a stage's share of the layers
  need not divide) are taken only when no other dim divides."""
  size = int(np.prod([problem.mesh.axis_size(a) for a in axes]))
  named, decisions = problem.named, []
  layers = {c for stack in problem.layer_stacks if stack.scanned for c in stack.layer_classes}
  avoided = set(avoid) | layers
  for value_id in problem.program.inputs:
    value = problem.program.values[value_id]
    if value.role != Role.PARAMETER:
      continue
    dims = [d for d in range(len(value.shape)) if value.shape[d] % size == 0]
    if not dims:
      continue
    largest = max(dims, key=lambda d: (named.class_of(value_id, d) not in avoided, value.shape[d]))
    decisions += [Decision(ArgDim(value.path, largest), axis) for axis in axes]
  return decisions


def fsdp(problem: Problem) -> list[Decision]:
  """ZeRO-3/FSDP: data parallel, then every parameter (and with it its gradient and
  optimizer state) stored sharded on its largest divisible dim, gathered at use: over
  the `fsdp` axis when the mesh has one (which then shards the batch too), else over
  the data axis."""
  axis = "fsdp" if "fsdp" in problem.mesh.axis_names else data_axis(problem)
  batch_axes = tuple(dict.fromkeys((data_axis(problem), axis)))
  return _batch_over(problem, batch_axes) + _store_sharded(problem, (axis,))


def hsdp(problem: Problem) -> list[Decision]:
  """Hybrid sharded data parallelism (PyTorch FSDP's hybrid shard, MaxText's FSDP within a
  slice and data parallelism across): the batch over every mesh axis, and every parameter
  (with its gradient and optimizer state) stored sharded over the model axis, the
  innermost and fastest links, on its largest divisible dim, gathered at use; replicated
  across the other axes, whose gradients are all-reduced. A mesh's named axes are only
  devices here: no axis is left computing a copy of another's work."""
  return _batch_over(problem, tuple(problem.mesh.axis_names)) + _store_sharded(
    problem, (model_axis(problem),)
  )


def data_megatron(problem: Problem) -> list[Decision]:
  """Data parallel on the data axis and Megatron on the model axis (2-D data x tensor)."""
  return data_parallel(problem) + megatron(problem)


def fsdp_megatron(problem: Problem) -> list[Decision]:
  """ZeRO-3/FSDP x tensor parallelism, as large models are trained: the batch over every
  data axis (all axes but the model axis), Megatron on the model axis, and every
  parameter's storage (so its gradient and optimizer state) sharded over all data axes
  on a dim tensor parallelism leaves free, gathered at use."""
  axes = data_axes(problem)
  found = structure(problem)
  return (
    _batch_over(problem, axes)
    + megatron(problem)
    + _store_sharded(problem, axes, found.kept_on_model)
  )


def fsdp_megatron_sp(problem: Problem) -> list[Decision]:
  """`fsdp_megatron` with Megatron's sequence parallelism: the sequence of every token
  input also over the model axis, so activations between the tensor-parallel blocks
  (normalization, residual) are stored split by sequence, gathered before the
  column-parallel matmuls and reduce-scattered after the row-parallel ones."""
  sequence = sequence_split(problem, model_axis(problem))
  axes = data_axes(problem)
  found = structure(problem)
  return (
    _batch_over(problem, axes)
    + megatron(problem)
    + sequence
    + _store_sharded(problem, axes, found.kept_on_model)
  )


def expert_parallel(problem: Problem) -> list[Decision]:
  """GShard/Switch: data parallel, and the experts over the data axis (tokens reach
  their experts by all-to-all), with Megatron inside the experts on the model axis."""
  experts = _shard_classes(problem, structure(problem).experts, data_axis(problem))
  return data_parallel(problem) + experts + megatron(problem)


def sequence_split(problem: Problem, axis: str) -> list[Decision]:
  """The sequence of every token input over `axis` (with Megatron on that axis: Megatron-LM's
  sequence parallelism; alone: context parallelism)."""
  return [Decision(ArgDim(*dim), axis) for dim in structure(problem).sequence_dims]


def embedding_split(problem: Problem, axis: str) -> list[Decision]:
  """The model width (the embedding table's feature dim, the residual stream's) over `axis`:
  with Megatron on that axis, activations between the tensor-parallel blocks are stored
  split on their feature dim, gathered before the column-parallel matmuls and
  reduce-scattered after the row-parallel ones (T5X's 2-D activation partitioning, as
  GSPMD lays out PaLM); parameters keep Megatron's split."""
  vocabulary = set(structure(problem).vocabulary)
  found = structure(problem).parameter_dims
  tables = {path for c in vocabulary for path, _ in found[c]}
  width = {
    c for c, dims in found.items() if c not in vocabulary and any(p in tables for p, _ in dims)
  }
  return [Decision(ArgDim(*found[c][0]), axis) for c in sorted(width)]


def sequence_parallel(problem: Problem) -> list[Decision]:
  """Context parallelism: data parallel, and the sequence of every token input over the
  model axis (attention gathers keys and values across it)."""
  return data_parallel(problem) + sequence_split(problem, model_axis(problem))


def stage_axis(problem: Problem) -> str:
  """The axis pipeline stages go along: the one with the slowest link (the network between
  nodes on GPUs, DCN between TPU slices), the most major on a tie; never the model axis
  while another axis exists."""
  mesh = problem.mesh
  names = [a for a in mesh.axis_names if a != model_axis(problem)] or list(mesh.axis_names)
  return min(names, key=lambda a: (mesh.link(a).bandwidth, mesh.axis_index(a)))


def _largest_stack(problem: Problem) -> tuple[int, LayerStack]:
  """The index and stack of the program's largest layer stack; ValueError when it has none."""
  stacks = problem.layer_stacks
  if not stacks:
    raise ValueError(
      f"the program has no repeated layer stack to pipeline: looked for {what_is_looked_for()}"
    )
  index = max(range(len(stacks)), key=lambda i: stacks[i].layers)
  return index, stacks[index]


def _pipelined(
  problem: Problem, batch_axes: tuple[str, ...], inside: list[Decision]
) -> tuple[list[Decision], Pipeline]:
  """A 1F1B pipeline of the largest layer stack over `stage_axis`, with the batch over
  `batch_axes` and `inside` decisions in every stage.

  Stages: the most that divide both the stage axis and the layers (at least two). Where
  they leave devices of the stage axis to each stage, those shard the batch too.
  Microbatches, as Megatron-LM runs its GPT models: one sequence per data-parallel replica
  (microbatch size 1), so M = batch / data-parallel degree, the most microbatches the batch
  allows and the smallest bubble, (S - 1) / (M + S - 1); 1F1B keeps only S of them in
  flight whatever M is."""
  axis = stage_axis(problem)
  index, stack = _largest_stack(problem)
  size = problem.mesh.axis_size(axis)
  stages = max(
    (s for s in range(2, size + 1) if size % s == 0 and stack.layers % s == 0), default=0
  )
  if not stages:
    raise ValueError(
      f"no stage count of 2 or more divides both the {size} devices of mesh axis {axis!r} and the "
      f"{stack.layers} layers of the {stack.describe()}"
    )
  axes = tuple(a for a in batch_axes if a != axis) + ((axis,) if stages < size else ())
  replicas = int(
    np.prod([size // stages if a == axis else problem.mesh.axis_size(a) for a in axes])
  )
  microbatches = max(batch_size(problem.program) // replicas, 1)
  pipeline = Pipeline(axis, stages=stages, microbatches=microbatches, schedule="1f1b", stack=index)
  return _batch_over(problem, axes) + inside, pipeline


def megatron_3d(problem: Problem) -> tuple[list[Decision], Pipeline]:
  """Megatron-LM's DP x PP x TP: tensor parallelism on the model axis (the fastest link),
  pipeline stages on the slowest axis (`stage_axis`), data parallelism over the axes
  between; the stages' layers and microbatches as in `_pipelined`."""
  return _pipelined(problem, data_axes(problem), megatron(problem))


def fsdp_megatron_3d(problem: Problem) -> tuple[list[Decision], Pipeline]:
  """`megatron_3d` with each stage's parameters, gradients and optimizer state stored
  sharded over its data-parallel axes (ZeRO-3 inside the stages, as Megatron-LM's
  distributed optimizer and MaxText's FSDP-within-stage configurations do for the largest
  models). A stacked weight is never stored split on its layer dim, which the stages
  split."""
  axes = tuple(a for a in data_axes(problem) if a != stage_axis(problem))
  _, stack = _largest_stack(problem)
  layers = stack.layer_classes if stack.scanned else ()
  avoid = structure(problem).kept_on_model + tuple(layers)
  storage = _store_sharded(problem, axes, avoid) if axes else []
  return _pipelined(problem, data_axes(problem), megatron(problem) + storage)


def pipeline(problem: Problem) -> tuple[list[Decision], Pipeline]:
  """Pipeline parallelism alone (GPipe/PipeDream over the slowest axis, `stage_axis`) with
  data parallelism over every other axis."""
  return _pipelined(problem, problem.mesh.axis_names, [])


PIPELINE_TACTICS: dict[str, Callable[[Problem], tuple[list[Decision], Pipeline]]] = {
  "megatron_3d": megatron_3d,
  "fsdp_megatron_3d": fsdp_megatron_3d,
  "pipeline": pipeline,
}


def applicable_pipelines(problem: Problem) -> dict[str, tuple[list[Decision], Pipeline]]:
  """The pipelined expert tactics that apply: the program has a layer stack, the mesh a
  stage axis besides the model axis whose size shares a divisor with the layers, and
  (but for `pipeline`) tensor-parallel dims."""
  if len(problem.mesh.axis_names) < 2:
    return {}
  out = {}
  for name, tactic in PIPELINE_TACTICS.items():
    if name != "pipeline" and not structure(problem).tensor_parallel:
      continue
    try:
      out[name] = tactic(problem)
    except ValueError:
      continue
  return out


TACTICS: dict[str, Callable[[Problem], list[Decision]]] = {
  "replicated": replicated,
  "data_parallel": data_parallel,
  "megatron": megatron,
  "fsdp": fsdp,
  "hsdp": hsdp,
  "data_megatron": data_megatron,
  "fsdp_megatron": fsdp_megatron,
  "fsdp_megatron_sp": fsdp_megatron_sp,
  "expert_parallel": expert_parallel,
  "sequence_parallel": sequence_parallel,
}


def applicable(problem: Problem) -> dict[str, list[Decision]]:
  """The tactics that apply to the problem's program: Megatron needs tensor-parallel dims,
  expert parallelism experts, sequence parallelism token inputs, hybrid sharding two mesh
  axes (on one it is `fsdp`)."""
  found = structure(problem)
  needs = {
    "hsdp": len(problem.mesh.axis_names) > 1,
    "megatron": found.tensor_parallel,
    "data_megatron": found.tensor_parallel,
    "fsdp_megatron": found.tensor_parallel,
    "fsdp_megatron_sp": found.tensor_parallel and found.sequence_dims,
    "expert_parallel": found.experts,
    "sequence_parallel": found.sequence_dims,
  }
  return {name: tactic(problem) for name, tactic in TACTICS.items() if needs.get(name, True)}


def applicable_costs(problem: Problem) -> dict[str, tuple[list[Decision], simulator.Cost]]:
  """Each applicable tactic's plan and its simulated cost, all evaluated in one call
  (`Problem.costs`: one compile for the set)."""
  plans = applicable(problem)
  return {
    name: (plan, cost)
    for (name, plan), cost in zip(plans.items(), problem.costs(list(plans.values())))
  }


class Score(NamedTuple):
  """What the yardstick reads of a plan's cost: seconds per step, bytes per device at
  the peak, and whether that fits the device."""

  step_time: float
  peak_memory: float
  fits: bool

  @classmethod
  def of(cls, cost: simulator.Cost) -> Score:
    return cls(float(cost.step_time), float(cost.peak_memory), bool(cost.fits))

  @property
  def yardstick_order(self) -> tuple[bool, float]:
    """The key `best_expert` takes the least of: every plan that fits before any that
    does not; among those that fit the fastest, among the others the least memory."""
    return (not self.fits, self.step_time if self.fits else self.peak_memory)


def best_expert(scores: Mapping[str, Score]) -> str:
  """The yardstick every ratio in the project is relative to, from the scores of the
  applicable expert tactics (`applicable`, the replicated plan among them): the fastest
  plan that fits in memory. A plan that does not fit cannot run, so it is never the
  yardstick while one that fits exists. When none fits, the one with the least memory per
  device (the closest to running), which callers must report as "no expert fits" and
  never use as a denominator beside a plan that fits."""
  if not scores:
    raise ValueError("No expert scores to choose the best expert from.")
  return min(scores, key=lambda n: scores[n].yardstick_order)


@dataclasses.dataclass(frozen=True)
class Expert:
  """An expert tactic's plan on a problem and its simulated cost."""

  name: str
  decisions: tuple[Decision, ...]
  cost: simulator.Cost

  @property
  def fits(self) -> bool:
    return bool(self.cost.fits)


def expert_plans(problem: Problem) -> list[Expert]:
  """Every applicable tactic's plan and cost (`applicable_costs`), in the yardstick's order
  (`Score.yardstick_order`): the `best_expert` first, then the other plans that fit from
  the fastest, then those that do not fit from the least memory per device."""
  experts = [Expert(n, tuple(plan), cost) for n, (plan, cost) in applicable_costs(problem).items()]
  return sorted(experts, key=lambda e: Score.of(e.cost).yardstick_order)


def best_expert_plan(problem: Problem) -> Expert:
  """The problem's `best_expert`, with its plan and cost."""
  return expert_plans(problem)[0]
