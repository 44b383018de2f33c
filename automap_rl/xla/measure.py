"""Measured wall time of a training step on the local accelerator.

`time_step` compiles a step with its state arguments donated, as a training loop runs it,
feeds each step's new state to the next, and times the steps one by one (each blocked on),
after warm-up steps that leave autotuning and allocation out of the figure. The compiled
module's flops, memory traffic and memory come with the time (`CompiledStats`), so that a
measured step time can be read against the simulator's per term.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from automap_rl.xla.hlo.compiled import CompiledStats, inspect_compiled

__all__ = ["StepTiming", "time_step"]


@dataclasses.dataclass(frozen=True)
class StepTiming:
  """Wall seconds of one training step on one device.

  Attributes:
    seconds: median over the timed steps.
    fastest: the fastest timed step.
    slowest: the slowest timed step.
    steps: how many steps were timed.
    device: the device's kind, as jax names it (e.g. "NVIDIA H100 80GB HBM3", "cpu").
    compiled: flops, bytes accessed and memory of the compiled step.
  """

  seconds: float
  fastest: float
  slowest: float
  steps: int
  device: str
  compiled: CompiledStats


def time_step(
  step: Callable[..., Sequence[Any]],
  args: Sequence[Any],
  carried: int,
  *,
  repeats: int = 10,
  warmup: int = 2,
) -> StepTiming:
  """Times `step` on the default device, as a training loop runs it.

  Args:
    step: `step(*args) -> outputs` whose first `carried` outputs are the next step's first
      `carried` arguments (parameters, optimizer state, model state); the other arguments
      (the batch) stay.
    args: the first step's arguments, concrete arrays on the default device; the carried
      ones are donated, so they are consumed.
    carried: how many leading arguments the step replaces.
    repeats: steps timed.
    warmup: steps run before the timed ones.

  Raises:
    ValueError: `repeats` below 1, `warmup` below 0, or `carried` not within the arguments.
  """
  if repeats < 1 or warmup < 0:
    raise ValueError(f"repeats must be at least 1 and warmup at least 0 (got {repeats}, {warmup})")
  if not 0 <= carried <= len(args):
    raise ValueError(f"carried={carried} is not within the step's {len(args)} arguments")
  compiled = jax.jit(step, donate_argnums=tuple(range(carried))).lower(*args).compile()
  stats = inspect_compiled(compiled, (), ())
  state, rest = list(args[:carried]), list(args[carried:])
  seconds = []
  for i in range(warmup + repeats):
    start = time.perf_counter()
    outputs = jax.block_until_ready(compiled(*state, *rest))
    if i >= warmup:
      seconds.append(time.perf_counter() - start)
    state = list(outputs[:carried])
  return StepTiming(
    seconds=statistics.median(seconds),
    fastest=min(seconds),
    slowest=max(seconds),
    steps=repeats,
    device=jax.devices()[0].device_kind,
    compiled=stats,
  )
