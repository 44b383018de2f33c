"""A partitioning problem: one program on one mesh, with everything static precomputed;
with pipeline stages (`PipelineProblem`), the same program priced stage by stage."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from automap_rl import buckets, ir, sharding, simulator
from automap_rl.batching import next_power_of_two
from automap_rl.compile_options import SearchJit
from automap_rl.ir.stacks import LayerStack, layer_stacks
from automap_rl.mesh import Mesh, spec_axes
from automap_rl.pipeline import Pipeline
from automap_rl.simulator.tables import padding
from automap_rl.stages import StagedProgram


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
  """The static tables of a program on a mesh; `evaluate` is the pure cost function.

  Attributes:
    program: the traced step.
    named: its named dimensions.
    mesh: the mesh and hardware.
    sigs: the program compressed to signatures.
    tables: the simulator's cost tables.
  """

  program: ir.Program
  named: ir.NamedDims
  mesh: Mesh
  sigs: sharding.Signatures
  tables: simulator.CostTables

  @classmethod
  def build(cls, program: ir.Program, mesh: Mesh, named: ir.NamedDims | None = None) -> Problem:
    named = ir.analyze(program) if named is None else named
    sigs = sharding.signatures(program, named)
    return cls(program, named, mesh, sigs, simulator.build_cost_tables(program, sigs, mesh))

  def encode(self, decisions: Sequence[sharding.Decision], length: int | None = None):
    """Decisions as `(classes, axes)` int32 arrays of shape [length]."""
    return sharding.encode(decisions, self.program, self.named, self.mesh, length)

  @functools.cached_property
  def owners(self) -> sharding.Owners:
    """The slot layout that resolution runs on."""
    return sharding.Owners.from_signatures(self.sigs, self.mesh.axis_sizes)

  def resolve(self, dec_class: jax.Array, dec_axis: jax.Array) -> sharding.Resolution:
    return sharding.resolve(self.owners, len(self.named.classes), dec_class, dec_axis)

  def evaluate(self, dec_class: jax.Array, dec_axis: jax.Array) -> simulator.Cost:
    """The cost of encoded decisions; pure, so it jits and vmaps."""
    return simulator.evaluate(
      self.tables, self.owners, len(self.named.classes), dec_class, dec_axis
    )

  @functools.cached_property
  def layer_stacks(self) -> tuple[LayerStack, ...]:
    """The program's layer stacks (`ir.stacks.layer_stacks`), found once: seconds on a
    program of thousands of ops."""
    return layer_stacks(self.program, self.named)

  @functools.cached_property
  def plan_length(self) -> int:
    """The length encoded plans are padded to (a longer plan: the power of two above it):
    the power of two at or above the classes' bucket times the mesh axes (each class decided
    once on each axis), so that the jitted resolution and cost compile once per bucket."""
    return next_power_of_two(self.bucketed.num_classes * len(self.mesh.axis_sizes), 16)

  @functools.cached_property
  def bucketed(self) -> BucketedTables:
    """The owners and cost tables padded to their buckets (`automap_rl.buckets`): what the
    jitted resolution and cost take, so that the problems of one bucket share a compile."""
    owners, tables = self.owners, self.tables
    size = buckets.bucket_sizes(padding.table_sizes(tables), padding.VARYING)
    return BucketedTables(
      owners=jax.device_put(
        owners.padded(
          buckets.bucket("U", len(owners.classes)),
          buckets.bucket("S", owners.classes.shape[1]),
          (size["Uv"], size["Rv"]),
          (size["Uo"], size["Rf"]),
        )
      ),
      tables=jax.device_put(padding.pad_tables(tables, size)),
      num_classes=buckets.bucket("C", len(self.named.classes)),
    )

  def _exact(self, resolution: sharding.Resolution) -> sharding.Resolution:
    """A resolution on the bucketed tables (host arrays, [..., Uv', Rv'] and [..., Uo',
    Rf']) cut to this problem's signatures."""
    (uv, rv), (uo, rf) = self.sigs.value_class.shape, self.sigs.op_class.shape
    return sharding.Resolution(
      value_mask=resolution.value_mask[..., :uv, :rv], op_mask=resolution.op_mask[..., :uo, :rf]
    )

  @functools.cached_property
  def _terms_jit(self):
    return SearchJit(
      lambda dec_class, dec_axis: simulator.terms(self.tables, self.resolve(dec_class, dec_axis)),
      "few",
    )

  def encode_padded(self, decisions: Sequence[sharding.Decision]) -> tuple[np.ndarray, np.ndarray]:
    """`encode` padded with -1 to `plan_length` entries (or the power of two above a longer
    plan)."""
    encoded = self.encode(decisions)
    return _padded(encoded, next_power_of_two(len(encoded[0]), self.plan_length))

  def cost(self, decisions: Sequence[sharding.Decision]) -> simulator.Cost:
    """The cost of a decision list (jitted; see `costs`)."""
    return self.costs([decisions])[0]

  def costs(self, plans: Sequence[Sequence[sharding.Decision]]) -> list[simulator.Cost]:
    """The cost of each of several decision lists, in one vmapped call: all are padded to
    one length (`encode_padded`) and the batch to a power of two (at least 8), so that the
    replicated plan, a searched plan and the expert tactics share one compile (unless a
    plan is longer than `plan_length`: repeated decisions of one class count)."""
    if not plans:
      return []
    encoded = [self.encode(p) for p in plans]
    length = next_power_of_two(max(len(classes) for classes, _ in encoded), self.plan_length)
    rows = [_padded(e, length) for e in encoded]
    rows += [rows[0]] * (next_power_of_two(len(rows), 8) - len(rows))
    classes, axes = (np.stack(column) for column in zip(*rows))
    batch = jax.device_get(bucketed_costs(self.bucketed, classes, axes))
    return [jax.tree.map(lambda x, i=i: x[i], batch) for i in range(len(plans))]

  def cost_terms(self, decisions: Sequence[sharding.Decision]) -> simulator.CostTerms:
    """The named per-op and per-edge terms of a decision list's cost (see
    `simulator.CostTerms`); `simulator.total(self.tables, terms)` is `self.cost(decisions)`."""
    return jax.device_get(self._terms_jit(*self.encode_padded(decisions)))

  def plan_cost(
    self, decisions: Sequence[sharding.Decision], pipeline: Pipeline | None = None
  ) -> simulator.Cost | simulator.PipelineCost:
    """The cost of a plan: `cost(decisions)` without a pipeline or with a trivial one (one
    stage, one microbatch), else `pipelined(pipeline).cost(decisions)`."""
    if pipeline is None or pipeline.trivial:
      return self.cost(decisions)
    return self.pipelined(pipeline).cost(decisions)

  def pipelined(self, pipeline: Pipeline) -> PipelineProblem:
    """The problem with `pipeline`'s stages (built once per pipeline; ValueError: see
    `Pipeline.check`)."""
    if pipeline not in self._pipelined:
      self._pipelined[pipeline] = PipelineProblem.build(self, pipeline)
    return self._pipelined[pipeline]

  @functools.cached_property
  def _pipelined(self) -> dict[Pipeline, PipelineProblem]:
    return {}

  def resolution(self, decisions: Sequence[sharding.Decision]) -> sharding.Resolution:
    """The resolved plan of a decision list (host arrays; jitted)."""
    return self._resolved(*self.encode_padded(decisions))

  def _resolved(self, dec_class: np.ndarray, dec_axis: np.ndarray) -> sharding.Resolution:
    """Encoded decisions resolved on the bucketed tables (jitted), as host arrays of this
    problem's signatures."""
    return self._exact(jax.device_get(_resolve(self.bucketed, dec_class, dec_axis)))

  def partition_specs(self, decisions: Sequence[sharding.Decision], value_ids: Sequence[int]):
    """`PartitionSpec`s of the given values under `decisions`."""
    return self.value_and_op_specs(decisions, value_ids, ())[0]

  def batch_axes(self, decisions: Sequence[sharding.Decision]) -> tuple[str, ...]:
    """The mesh axes `decisions` split the batch dim (dim 0 of the batch inputs) over."""
    inputs = self.program.batch_inputs
    return spec_axes(self.partition_specs(decisions, inputs[:1])[0], 1)[0] if inputs else ()

  def weights_split_over_batch(self, decisions: Sequence[sharding.Decision]) -> bool:
    """Whether `decisions` store a parameter split over an axis they split the batch over
    (ZeRO, FSDP): what `Pipeline.gather_weights_once` can gather once a step."""
    rows = set(self.batch_axes(decisions))
    program = self.program
    params = [v for v in program.inputs if program.values[v].role == ir.Role.PARAMETER]
    return any(
      rows & {a for axes in spec_axes(spec, len(program.values[v].shape)) for a in axes}
      for v, spec in zip(params, self.partition_specs(decisions, params))
    )

  def value_and_op_specs(
    self, decisions: Sequence[sharding.Decision], value_ids: Sequence[int], op_ids: Sequence[int]
  ):
    """`PartitionSpec`s of the given values under `decisions`, and for each of `op_ids` the
    `(operand specs, result specs)` the op computes on (`sharding.op_partition_specs`);
    one resolution for both."""
    dec_class, dec_axis = self.encode_padded(decisions)
    resolution = self._resolved(dec_class, dec_axis)
    use = sharding.class_axis_use(
      self.sigs, resolution, len(self.named.classes), len(self.mesh.axis_names)
    )
    values = [
      sharding.partition_spec(v, self.sigs, resolution, dec_class, dec_axis, self.mesh, use)
      for v in value_ids
    ]
    ops = [
      sharding.op_partition_specs(
        self.program.ops[o], self.sigs, resolution, dec_class, dec_axis, self.mesh, use
      )
      for o in op_ids
    ]
    return values, ops


@dataclasses.dataclass(frozen=True)
class BucketedTables:
  """A problem's owners and cost tables padded to their buckets (`Problem.bucketed`).

  Attributes:
    owners: the slot layout, padded (`sharding.Owners.padded`).
    tables: the cost tables, padded (`simulator.tables.padding.pad_tables`).
    num_classes: the bucket of the class count (static: it sizes resolution's arrays).
  """

  owners: sharding.Owners
  tables: simulator.CostTables
  num_classes: int


jax.tree_util.register_dataclass(
  BucketedTables, data_fields=["owners", "tables"], meta_fields=["num_classes"]
)


@functools.partial(SearchJit, calls="many")  # The ILP agent's descent calls it in a loop.
def bucketed_costs(
  bucketed: BucketedTables, dec_class: jax.Array, dec_axis: jax.Array
) -> simulator.Cost:
  """The cost of each of a batch of encoded plans, int32 [N, K] each, on a problem's
  bucketed tables (`Problem.bucketed`): one compile serves every problem of the bucket."""
  evaluate = functools.partial(
    simulator.evaluate, bucketed.tables, bucketed.owners, bucketed.num_classes
  )
  return jax.vmap(evaluate)(dec_class, dec_axis)


@functools.partial(SearchJit, calls="few")
def _resolve(
  bucketed: BucketedTables, dec_class: jax.Array, dec_axis: jax.Array
) -> sharding.Resolution:
  """Encoded decisions, int32 [K] each, resolved on bucketed owners."""
  return sharding.resolve(bucketed.owners, bucketed.num_classes, dec_class, dec_axis)


_pipeline_cost = SearchJit(
  simulator.pipeline_cost, "few"
)  # Tables as arguments: one compile per table shape.


@functools.lru_cache(maxsize=16)
def _stage_resolver(problem: Problem, axis_sizes: tuple[int, ...]):
  """`problem`'s jitted resolution on a mesh of `axis_sizes` (a stage mesh)."""
  owners = sharding.Owners.from_signatures(problem.sigs, axis_sizes)
  return jax.jit(functools.partial(sharding.resolve, owners, len(problem.named.classes)))


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineProblem:
  """A problem with pipeline stages: the intra-op decisions resolve on the full program
  over the stage mesh, and `simulator.pipeline_cost` prices them stage by stage.

  Attributes:
    problem: the problem without stages.
    pipeline: the pipeline.
    staged: where each op runs (`stages.StagedProgram`).
    tables: the pricing tables.
  """

  problem: Problem
  pipeline: Pipeline
  staged: StagedProgram
  tables: simulator.PipelineTables

  @classmethod
  def build(cls, problem: Problem, pipeline: Pipeline) -> PipelineProblem:
    staged = StagedProgram.build(problem.program, problem.named, problem.mesh, pipeline)
    return cls(
      problem,
      pipeline,
      staged,
      simulator.build_pipeline_tables(staged, problem.named, problem.sigs),
    )

  def _resolved(self, dec_class: np.ndarray, dec_axis: np.ndarray) -> sharding.Resolution:
    """Resolution over the stage mesh (host arrays): the problem's own where the stages take
    the whole stage axis (decisions may not use it, so its size does not matter)."""
    if self.staged.mesh.axis_size(self.pipeline.axis) == 1:
      return self.problem._resolved(dec_class, dec_axis)
    resolve = _stage_resolver(self.problem, self.staged.mesh.axis_sizes)
    return jax.device_get(resolve(dec_class, dec_axis))

  def resolution(self, decisions: Sequence[sharding.Decision]) -> sharding.Resolution:
    """The decisions resolved on the full program over the stage mesh (host arrays).

    Raises:
      ValueError: a decision uses the stage axis the stages take whole, or the plan
        shards a dim over more devices than it has at microbatch (or stage) size.
    """
    self.pipeline.check_decisions(decisions, self.problem.mesh)
    resolution = self._resolved(*self.problem.encode_padded(decisions))
    self._check_divisible(resolution)
    return resolution

  def _check_divisible(self, resolution: sharding.Resolution) -> None:
    """Raises ValueError where a value dim or op factor, at microbatch (stage) size, does
    not divide by the devices the plan shards it over."""
    t, program, mesh = self.tables, self.staged.program, self.staged.mesh
    value = lambda i, dim: (
      f"dim {dim} of {program.values[i].path or 'a value'} {list(program.values[i].shape)}"
    )
    factor = lambda i, dim: (
      f"factor {dim} of {program.ops[i].primitive} {list(program.ops[i].rule.factor_sizes)}"
    )
    for masks, source, sizes, examples, describe in (
      (resolution.value_mask, t.value_source, t.value_size, t.value_example, value),
      (resolution.op_mask, t.op_source, t.op_size, t.op_example, factor),
    ):
      mask = np.asarray(masks)[source].astype(np.int64)
      bad = np.argwhere(sizes % t.tables.mask_group[mask] != 0)
      if len(bad):
        row, dim = bad[0]
        axes = tuple(name for i, name in enumerate(mesh.axis_names) if mask[row, dim] >> i & 1)
        raise ValueError(
          f"with {self.pipeline.microbatches} microbatches and {self.pipeline.stages} stages, "
          f"{describe(examples[row], dim)} (a microbatch's or stage's share) does not divide over "
          f"{axes}, which the plan shards it on; use fewer microbatches or stages, or shard it less"
        )

  def cost(self, decisions: Sequence[sharding.Decision]) -> simulator.PipelineCost:
    """The cost of intra-op decisions inside the stages (see `resolution` for errors)."""
    resolution = self.resolution(decisions)
    cost = jax.device_get(_pipeline_cost(self.tables, resolution.value_mask, resolution.op_mask))
    return simulator.for_stages(cost, self.pipeline.stages)


def _padded(encoded: tuple[np.ndarray, np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
  """Encoded decisions `(classes, axes)` padded with -1 to `length` entries."""
  return tuple(np.pad(x, (0, length - len(x)), constant_values=-1) for x in encoded)
