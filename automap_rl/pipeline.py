"""`Pipeline`: the inter-operator level of a plan (Alpa's outer level).

A plan may pipeline one stack of repeated layers (`automap_rl.ir.stacks`: a scanned layer
stack or its unrolled repeats) over one mesh axis: S stages of consecutive layers, each on
its own slice of that axis, with the batch split into M microbatches that flow through the
stages in a schedule. The intra-op decisions of the plan then apply inside every stage,
over the mesh less the stages' share of the stage axis (`stage_mesh`): with S equal to
the axis size the decisions may not use the axis at all; with S a proper divisor they
shard over the A / S devices of the axis that each stage keeps.

Schedules (the bubble is the share of the step that stages wait):

* `gpipe`: every microbatch's forward, then every backward; M microbatches in flight.
* `1f1b`: one forward, one backward in the steady state (PipeDream-Flush, Megatron-LM);
  the same bubble as GPipe, (S - 1) / (M + S - 1), and S - s microbatches in flight on
  stage s.
* `interleaved`: each stage holds V chunks of layers (chunk c on stage c mod S, as
  Megatron-LM's interleaved 1F1B and MaxText's circular pipeline do); the bubble shrinks
  to (S - 1) / V stage-times.

With S = 1 and M = 1 a plan is exactly the plan without a pipeline.

Weights stored split over the batch axes (ZeRO, FSDP) are gathered where they are used,
in every microbatch; with `gather_weights_once` the loop instead receives them gathered
over the batch axes once a step and reduces their gradients once after it, as Megatron-LM's
distributed optimizer, MaxText's `pipeline_fsdp_ag_once` and Llama 3's FSDP without
resharding after the forward pass run: the optimizer state stays split, the stage holds
its weights and their gradient sums whole over those axes for the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from automap_rl.ir import NamedDims, Program
from automap_rl.ir.stacks import LayerStack, layer_stacks, what_is_looked_for
from automap_rl.mesh import Mesh
from automap_rl.sharding import Decision

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def batch_size(program: Program) -> int:
  """The batch a pipeline's microbatches split: the greatest common divisor of dim 0 of the
  program's batched inputs (role `input`), 1 when it has none."""
  sizes = [program.values[v].shape[0] for v in program.batch_inputs]
  return math.gcd(*sizes) if sizes else 1


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """S stages of a layer stack over one mesh axis, M microbatches, a schedule.

  Attributes:
    axis: the mesh axis the stages are laid out along.
    stages: S, the axis size or a divisor of it.
    microbatches: M, dividing the batch.
    schedule: one of `SCHEDULES`.
    chunks: V, layer chunks per stage (`interleaved` only; 1 otherwise).
    stack: which of the program's layer stacks (`ir.stacks.layer_stacks`, in their order).
    layers_per_chunk: layers of each of the S * V chunks, in layer order (chunk c runs
      on stage c mod S); None: L / (S * V) each. A scanned stack splits evenly only.
    gather_weights_once: weights split over the batch axes are gathered once a step
      before the microbatch loop and their gradients reduced once after it (module
      docstring), not gathered and reduced in every microbatch.
  """

  axis: str
  stages: int
  microbatches: int = 1
  schedule: str = "1f1b"
  chunks: int = 1
  stack: int = 0
  layers_per_chunk: tuple[int, ...] | None = None
  gather_weights_once: bool = False

  def __post_init__(self):
    if not isinstance(self.gather_weights_once, (bool, np.bool_)):
      raise ValueError(f"pipeline gather_weights_once={self.gather_weights_once!r} must be a bool")
    for name in ("stages", "microbatches", "chunks"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"pipeline {name}={value!r} must be a positive integer")
    if (
      isinstance(self.stack, bool)
      or not isinstance(self.stack, (int, np.integer))
      or self.stack < 0
    ):
      raise ValueError(f"pipeline stack={self.stack!r} must be a stack index (0, 1, ...)")
    if self.schedule not in SCHEDULES:
      raise ValueError(
        f"unknown pipeline schedule {self.schedule!r}; valid schedules: {', '.join(SCHEDULES)}"
      )
    if self.schedule == "interleaved" and self.chunks < 2:
      raise ValueError(
        f"the interleaved schedule needs chunks >= 2 layer chunks per stage, not {self.chunks}"
      )
    if self.schedule != "interleaved" and self.chunks != 1:
      raise ValueError(
        f"chunks={self.chunks} needs the interleaved schedule, not {self.schedule!r}"
      )
    if self.schedule == "interleaved" and self.microbatches % self.stages:
      raise ValueError(
        f"the interleaved schedule needs microbatches ({self.microbatches}) to be a multiple of "
        f"stages ({self.stages}), as Megatron-LM's does"
      )
    if self.layers_per_chunk is not None:
      object.__setattr__(self, "layers_per_chunk", tuple(int(n) for n in self.layers_per_chunk))
      if len(self.layers_per_chunk) != self.stages * self.chunks or min(self.layers_per_chunk) < 1:
        raise ValueError(
          f"layers_per_chunk={list(self.layers_per_chunk)} must give each of the "
          f"{self.stages * self.chunks} chunks (stages x chunks) at least one layer"
        )

  @property
  def trivial(self) -> bool:
    """One stage and one microbatch: the plan without a pipeline."""
    return self.stages == 1 and self.microbatches == 1

  def chunk_layers(self, layers: int) -> tuple[int, ...]:
    """Layers of each chunk (see `layers_per_chunk`)."""
    return self.layers_per_chunk or (layers // (self.stages * self.chunks),) * (
      self.stages * self.chunks
    )

  def layer_stages(self, layers: int) -> np.ndarray:
    """The stage of each of `layers` layers, int [layers]."""
    chunk = np.repeat(np.arange(self.stages * self.chunks), self.chunk_layers(layers))
    return chunk % self.stages

  def ticks(self) -> int:
    """T, the iterations of the lowered schedule's loop (`xla.schedules.tick_table`): each
    stage runs at most one forward or backward of a chunk on a microbatch a tick, the last
    chunk's forward and backward as one. GPipe (and any schedule of one microbatch):
    2 (M V + S - 1) - 1; 1F1B and interleaved, whose backwards start before the last
    forward: 2 (M V + S - 2). One stage: the M iterations of gradient accumulation."""
    m, s, v = self.microbatches, self.stages, self.chunks
    if s == 1:
      return m
    if self.schedule == "gpipe" or m * v == 1:
      return 2 * (m * v + s - 1) - 1
    return 2 * (m * v + s - 2)

  def in_flight(self) -> np.ndarray:
    """Microbatches whose activations a stage holds at once, in units of one microbatch of
    its whole share of the stack, float [S]: under GPipe M (every forward before the first
    backward), but 1 on the last stage, which runs each microbatch's forward, head, loss
    and backward at once (`xla.schedules`); S - s on stage s under 1F1B (its warm-up
    forwards); interleaved, Megatron-LM's warm-up count of
    chunk-microbatches (2 (S - s - 1) + (V - 1) S, plus the one in flight, at most M V),
    each 1 / V of the stage's layers."""
    m, s, v = self.microbatches, self.stages, self.chunks
    stage = np.arange(s)
    if self.schedule == "gpipe":
      return np.where(stage == s - 1, 1.0, float(m))
    if self.schedule == "1f1b":
      return np.minimum(m, s - stage).astype(float)
    return np.minimum(2 * (s - stage - 1) + (v - 1) * s + 1, m * v) / v

  def stage_mesh(self, mesh: Mesh) -> Mesh:
    """The mesh one stage runs on: the stage axis keeps A / S devices."""
    sizes = tuple(
      n // self.stages if name == self.axis else n
      for name, n in zip(mesh.axis_names, mesh.axis_sizes)
    )
    return dataclasses.replace(mesh, axis_sizes=sizes)

  def check(self, program: Program, named: NamedDims, mesh: Mesh) -> LayerStack:
    """Checks the pipeline against a program and mesh; returns the stack it pipelines.

    Raises:
      ValueError: one line naming what is wrong: an unknown axis, stages that do not
        divide the axis or the layers, no layer stack (saying what was looked for), more
        microbatches than the batch or a count that does not divide it.
    """
    if self.axis not in mesh.axis_names:
      raise ValueError(
        f"pipeline axis {self.axis!r} is not a mesh axis; the mesh has {mesh.axis_names}"
      )
    size = mesh.axis_size(self.axis)
    if size % self.stages:
      raise ValueError(
        f"stages={self.stages} does not divide the {size} devices of mesh axis {self.axis!r}"
      )
    stacks = layer_stacks(program, named)
    if not stacks:
      raise ValueError(
        f"the program has no repeated layer stack to pipeline: looked for {what_is_looked_for()}"
      )
    if self.stack >= len(stacks):
      found = "; ".join(f"{i}: {s.describe()}" for i, s in enumerate(stacks))
      raise ValueError(
        f"pipeline stack={self.stack} but the program has {len(stacks)} layer stack(s): {found}"
      )
    stack = stacks[self.stack]
    self._check_layers(stack)
    self._check_batch(program)
    return stack

  def _check_layers(self, stack: LayerStack) -> None:
    parts = self.stages * self.chunks
    if self.layers_per_chunk is None:
      if stack.layers % parts:
        split = f"{self.stages} stages" + (f" x {self.chunks} chunks" if self.chunks > 1 else "")
        raise ValueError(
          f"{split} do not divide the {stack.layers} layers of the {stack.describe()}"
        )
      return
    if sum(self.layers_per_chunk) != stack.layers:
      raise ValueError(
        f"layers_per_chunk={list(self.layers_per_chunk)} sums to {sum(self.layers_per_chunk)}, "
        f"not the {stack.layers} layers of the {stack.describe()}"
      )
    if stack.scanned and len(set(self.layers_per_chunk)) > 1:
      raise ValueError(
        f"a scanned layer stack splits into equal chunks only; layers_per_chunk="
        f"{list(self.layers_per_chunk)} is uneven ({stack.describe()})"
      )

  def _check_batch(self, program: Program) -> None:
    if self.microbatches == 1:
      return
    inputs = [program.values[v] for v in program.batch_inputs]
    if not inputs:
      raise ValueError(
        f"microbatches={self.microbatches} but the program has no batch input (an argument of role "
        "input) to split"
      )
    for value in inputs:
      batch = value.shape[0]
      if self.microbatches > batch:
        raise ValueError(
          f"microbatches={self.microbatches} is more than the batch of {batch} ({value.path} dim 0)"
        )
      if batch % self.microbatches:
        raise ValueError(
          f"microbatches={self.microbatches} does not divide the batch of {batch} ({value.path} "
          "dim 0)"
        )

  def check_decisions(self, decisions: Sequence[Decision], mesh: Mesh) -> None:
    """Raises ValueError when an intra-op decision uses the stage axis that the stages
    take whole (S equal to its size)."""
    if mesh.axis_size(self.axis) != self.stages:
      return
    for decision in decisions:
      if decision.axis == self.axis:
        raise ValueError(
          f"decision {decision} shards over mesh axis {self.axis!r}, which the pipeline's "
          f"{self.stages} stages take whole; intra-op decisions use the other axes"
        )

  def to_json(self) -> dict[str, Any]:
    """The pipeline as JSON (`from_json` reads it back)."""
    out = dataclasses.asdict(self)
    out["layers_per_chunk"] = None if self.layers_per_chunk is None else list(self.layers_per_chunk)
    return out

  @classmethod
  def from_json(cls, entry: dict[str, Any]) -> Pipeline:
    """A pipeline from `to_json`'s dict; ValueError names an unknown key."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(entry) - fields)
    if unknown:
      raise ValueError(f"unknown pipeline key(s) {unknown}; valid keys: {sorted(fields)}")
    return cls(**entry)

  def __str__(self) -> str:
    chunks = f", {self.chunks} chunks" if self.chunks > 1 else ""
    return (
      f"pipeline of stack {self.stack} over {self.axis!r}: {self.stages} stages, "
      f"{self.microbatches} "
      f"microbatches, {self.schedule}{chunks}"
      + (", weights gathered once a step" if self.gather_weights_once else "")
    )
