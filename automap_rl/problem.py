"""A partitioning problem: one program on one mesh, with everything static precomputed."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from automap_rl import ir, sharding, simulator
from automap_rl.batching import next_power_of_two
from automap_rl.mesh import Mesh


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
    return simulator.evaluate(self.tables, self.owners, len(self.named.classes), dec_class, dec_axis)

  @functools.cached_property
  def plan_length(self) -> int:
    """The length encoded plans are padded to (a longer plan: the power of two above it):
    the power of two at or above the classes times the mesh axes (each class decided once
    on each axis), so that the jitted resolution and cost compile once per problem."""
    return next_power_of_two(len(self.named.classes) * len(self.mesh.axis_sizes), 16)

  @functools.cached_property
  def _evaluate_many_jit(self):
    return jax.jit(jax.vmap(self.evaluate))

  @functools.cached_property
  def _resolve_jit(self):
    return jax.jit(self.resolve)

  @functools.cached_property
  def _terms_jit(self):
    return jax.jit(lambda dec_class, dec_axis: simulator.terms(self.tables, self.resolve(dec_class, dec_axis)))

  def encode_padded(self, decisions: Sequence[sharding.Decision]) -> tuple[np.ndarray, np.ndarray]:
    """`encode` padded with -1 to `plan_length` entries (or the power of two above a longer plan)."""
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
    batch = jax.device_get(self._evaluate_many_jit(classes, axes))
    return [jax.tree.map(lambda x, i=i: x[i], batch) for i in range(len(plans))]

  def cost_terms(self, decisions: Sequence[sharding.Decision]) -> simulator.CostTerms:
    """The named per-op and per-edge terms of a decision list's cost (see
    `simulator.CostTerms`); `simulator.total(self.tables, terms)` is `self.cost(decisions)`."""
    return jax.device_get(self._terms_jit(*self.encode_padded(decisions)))

  def resolution(self, decisions: Sequence[sharding.Decision]) -> sharding.Resolution:
    """The resolved plan of a decision list (host arrays; jitted)."""
    return jax.device_get(self._resolve_jit(*self.encode_padded(decisions)))

  def partition_specs(self, decisions: Sequence[sharding.Decision], value_ids: Sequence[int]):
    """`PartitionSpec`s of the given values under `decisions`."""
    return self.value_and_op_specs(decisions, value_ids, ())[0]

  def value_and_op_specs(self, decisions: Sequence[sharding.Decision], value_ids: Sequence[int],
                         op_ids: Sequence[int]):
    """`PartitionSpec`s of the given values under `decisions`, and for each of `op_ids` the
    `(operand specs, result specs)` the op computes on (`sharding.op_partition_specs`);
    one resolution for both."""
    dec_class, dec_axis = self.encode_padded(decisions)
    resolution = jax.device_get(self._resolve_jit(dec_class, dec_axis))
    values = [sharding.partition_spec(v, self.sigs, resolution, dec_class, dec_axis, self.mesh) for v in value_ids]
    ops = [sharding.op_partition_specs(self.program.ops[o], self.sigs, resolution, dec_class, dec_axis, self.mesh)
           for o in op_ids]
    return values, ops


def _padded(encoded: tuple[np.ndarray, np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
  """Encoded decisions `(classes, axes)` padded with -1 to `length` entries."""
  return tuple(np.pad(x, (0, length - len(x)), constant_values=-1) for x in encoded)
