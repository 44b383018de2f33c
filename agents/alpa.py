"""The Alpa baseline: inter-operator stages over one mesh axis, intra-op experts inside them.

Alpa's two levels, on this project's pipeline model (`automap_rl.pipeline`: S stages of
consecutive layers laid along one mesh axis, each on an equal slice of it):

* outer level: every mesh axis as the stage axis (slowest link first), S among the axis
  size's divisors that split the layer stack (S = 1: no pipeline), M among the batch's
  divisors, the 1F1B schedule and the interleaved one (V = `AlpaConfig.chunks`) where
  it applies. GPipe is left out: it has 1F1B's bubble and more activations in flight.
* inner level: each applicable expert tactic's plan (`tactics.applicable`, and the
  intra-op plans of the pipelined experts, `tactics.applicable_pipelines`, which are also
  candidates as they are) inside the stages, without its decisions on the stage axis
  where the stages take that axis whole (with S a proper divisor of the axis, both with
  and without them); a plan that stores weights split over its batch axes (ZeRO, FSDP)
  both with them gathered in every microbatch and once a step
  (`Pipeline.gather_weights_once`).
* Alpa's stage-slicing dynamic program, for an unrolled stack: the best balanced
  pipelines are priced once more with one layer moved from the last stage to the first,
  which gives each stage's microbatch time and peak memory as a line in its layer count
  (the embedding on the first stage and the head and loss on the last are the lines'
  offsets); the DP then assigns consecutive layers to stages to minimise the slowest
  stage's time (the pace of the step) with every stage within the device's memory, and
  the assignment is priced exactly. A scanned stack splits evenly only.

Every candidate is priced by the simulator (`Problem.plan_cost`); the plan is the fastest
that fits in memory (none fits: the one with the least memory, with a warning). A
simulation is one plan priced; the seconds budget stops between candidates. The search is
deterministic: every seed gives the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from agents.base import Budget, Progress, SearchResult, TracePoint, env_config, searcher
from automap_rl import simulator, tactics
from automap_rl.ir.stacks import LayerStack
from automap_rl.pipeline import Pipeline, batch_size
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from envs.tables import objective as env_objective
from envs.tables import replicated_base


@dataclasses.dataclass(frozen=True)
class AlpaConfig:
  """The Alpa agent.

  Attributes:
    schedules: the pipeline schedules tried (`1f1b`, `interleaved`, `gpipe`).
    chunks: V, layer chunks per stage of the interleaved schedule.
    microbatches: the microbatch counts tried (those that divide the batch); None: every
      divisor of the batch.
    rebalance: how many of the best balanced pipelines (of an unrolled stack, V = 1) the
      layer DP rebalances.
    action_space: the environment action space the result's `action_ids` are encoded in
      (plans are named-dimension decisions).
    max_decisions: that environment's capacity in class decisions.
  """

  schedules: tuple[str, ...] = ("1f1b", "interleaved")
  chunks: int = 2
  microbatches: tuple[int, ...] | None = None
  rebalance: int = 4
  action_space: str = "named_dims"
  max_decisions: int = 256


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A priced plan: intra-op decisions inside a pipeline (None: no pipeline)."""

  decisions: tuple[Decision, ...]
  pipeline: Pipeline | None
  cost: simulator.Cost | simulator.PipelineCost

  @property
  def rank(self) -> tuple[bool, float]:
    """Lower is better: plans that fit first, by step time; the rest by peak memory."""
    fits = bool(self.cost.fits)
    return (not fits, float(self.cost.step_time if fits else self.cost.peak_memory))


class _Search:
  """The budget, the clock, the best candidate and its trace."""

  def __init__(self, problem: Problem, budget: Budget, start: float, progress: Progress | None):
    self.problem, self.budget, self.start, self.progress = problem, budget, start, progress
    self.simulations = 0
    self.stopped_by: str | None = None
    self.best: Candidate | None = None
    self.trace: list[TracePoint] = []
    self.candidates: list[Candidate] = []
    self._config = env_config(problem, "named_dims", 1)
    self._base = replicated_base(self._config, problem)

  def done(self) -> bool:
    """Whether a budget limit is reached; the first check that finds one records it in
    `stopped_by` (`simulations` or `seconds`)."""
    if self.stopped_by is None and self.budget.left(self.simulations) <= 0:
      self.stopped_by = "simulations"
    if (
      self.stopped_by is None
      and self.budget.seconds is not None
      and time.perf_counter() - self.start >= self.budget.seconds
    ):
      self.stopped_by = "seconds"
    return self.stopped_by is not None

  def objective(self, cost: simulator.Cost | simulator.PipelineCost) -> float:
    """The environment's objective of a cost (1.0 is the replicated plan)."""
    return float(env_objective(self._config, cost, self._base, self.problem.tables.hbm_bytes))

  def offer(self, candidate: Candidate) -> None:
    """Counts one simulation and keeps the candidate if it is the best so far."""
    self.simulations += 1
    self.candidates.append(candidate)
    if self.best is None or candidate.rank < self.best.rank:
      self.best = candidate
      self.trace.append(
        TracePoint(
          self.simulations,
          time.perf_counter() - self.start,
          float(candidate.cost.step_time),
          self.objective(candidate.cost),
        )
      )
    if self.progress is not None:
      self.progress(self.simulations, float(self.best.cost.step_time))

  def price(self, decisions: Sequence[Decision], pipeline: Pipeline) -> Candidate | None:
    """Prices a pipelined plan and offers it; None when the pipeline or the plan does not
    apply (`Pipeline.check`, the stage axis taken whole, a microbatch that does not divide)."""
    try:
      cost = self.problem.plan_cost(decisions, pipeline)
    except ValueError:
      return None
    candidate = Candidate(tuple(decisions), pipeline, cost)
    self.offer(candidate)
    return candidate


def search(
  problem: Problem,
  config: AlpaConfig = AlpaConfig(),
  seed: int = 0,
  budget: Budget | int | str = 2000,
  progress: Progress | None = None,
) -> SearchResult:
  """Prices the intra-op experts without a pipeline and the pipelined ones
  (`tactics.applicable_pipelines`), then every pipeline of the outer level with each
  expert's intra-op plan inside, then rebalances the best pipelines' layers (see the
  module docstring); returns the best plan, with its pipeline (None: no pipeline). The
  seed is unused: the search is deterministic."""
  start = time.perf_counter()
  budget = Budget.of(budget)
  experts = _distinct(tactics.applicable(problem).values())
  state = _Search(problem, budget, start, progress)
  setup = time.perf_counter() - start
  unpipelined = experts[: budget.left(0)]
  for plan, cost in zip(unpipelined, problem.costs(unpipelined)):
    state.offer(Candidate(plan, None, cost))
  pipelined = tactics.applicable_pipelines(problem)
  for plan, pipeline in pipelined.values():
    if not state.done():
      state.price(plan, pipeline)
  experts = _distinct([*experts, *(plan for plan, _ in pipelined.values())])
  stacks = problem.layer_stacks
  splits_weights = functools.cache(problem.weights_split_over_batch)  # Once per plan.
  for pipeline in _pipelines(problem, stacks, config):
    for plan in _inside(experts, pipeline, problem):
      for variant in _storage_variants(splits_weights(plan), pipeline):
        if state.done():
          break
        state.price(plan, variant)
    if state.done():
      break
  balanced = sorted(
    (c for c in state.candidates if _rebalanceable(c, stacks)), key=lambda c: c.rank
  )
  for candidate in balanced[: config.rebalance]:
    if state.done():
      break
    _rebalance(state, candidate, stacks[candidate.pipeline.stack].layers)
  return _result(problem, config, state, setup)


def _distinct(plans) -> list[tuple[Decision, ...]]:
  """The plans without repeats, in order."""
  return list(dict.fromkeys(tuple(p) for p in plans))


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _pipelines(
  problem: Problem, stacks: Sequence[LayerStack], config: AlpaConfig
) -> Iterator[Pipeline]:
  """The outer level's pipelines that `Pipeline` accepts: stage axes slowest link first,
  S from the largest, M from the most; with S = 1 (gradient accumulation) only on the
  first axis and stack (which then does not matter)."""
  mesh = problem.mesh
  axes = sorted(mesh.axis_names, key=lambda name: mesh.link(name).bandwidth)
  microbatches = [
    m
    for m in _divisors(batch_size(problem.program))[::-1]
    if config.microbatches is None or m in config.microbatches
  ]
  for index, stack in enumerate(stacks):
    for axis in axes:
      for stages in _divisors(mesh.axis_size(axis))[::-1]:
        if stages > stack.layers or (stages == 1 and (axis, index) != (axes[0], 0)):
          continue
        split = None if stack.layers % stages == 0 else _even_split(stack.layers, stages)
        if split is not None and stack.scanned:
          continue
        for m in microbatches:
          for schedule in config.schedules:
            chunks = config.chunks if schedule == "interleaved" else 1
            try:
              pipeline = Pipeline(
                axis, stages, m, schedule, chunks, index, split if chunks == 1 else None
              )
              if not pipeline.trivial:
                problem.pipelined(pipeline)
            except ValueError:
              continue
            if not pipeline.trivial:
              yield pipeline


def _storage_variants(splits_weights: bool, pipeline: Pipeline) -> tuple[Pipeline, ...]:
  """`pipeline`, and where the plan stores weights split over its batch axes (ZeRO, FSDP:
  `splits_weights`) also with them gathered once a step (`Pipeline.gather_weights_once`)."""
  if not splits_weights:
    return (pipeline,)
  return pipeline, dataclasses.replace(pipeline, gather_weights_once=True)


def _even_split(layers: int, stages: int) -> tuple[int, ...]:
  """`layers` over `stages` as evenly as can be, the earlier stages one more, [S]."""
  return tuple(layers // stages + (s < layers % stages) for s in range(stages))


def _inside(
  experts: Sequence[tuple[Decision, ...]], pipeline: Pipeline, problem: Problem
) -> list[tuple[Decision, ...]]:
  """The intra-op plans tried inside `pipeline`'s stages: each expert without its
  decisions on the stage axis, and, where the stages leave part of that axis (or with
  one stage), as it is."""
  if pipeline.stages == 1:
    return list(experts)
  whole = problem.mesh.axis_size(pipeline.axis) == pipeline.stages
  kept = [] if whole else list(experts)
  return _distinct([tuple(d for d in plan if d.axis != pipeline.axis) for plan in experts] + kept)


def _rebalanceable(candidate: Candidate, stacks: Sequence[LayerStack]) -> bool:
  """A pipeline of an unrolled stack with one chunk per stage and two or more layers on
  some stage: the layer DP may move layers."""
  pipeline = candidate.pipeline
  if (
    pipeline is None
    or pipeline.stages < 2
    or pipeline.chunks != 1
    or stacks[pipeline.stack].scanned
  ):
    return False
  return stacks[pipeline.stack].layers > pipeline.stages


def _rebalance(state: _Search, candidate: Candidate, layers: int) -> None:
  """Alpa's layer DP on a priced pipeline: a probe with one layer moved gives each
  stage's time and memory per layer; `balance` assigns the layers; the assignment is
  priced (two simulations)."""
  pipeline = candidate.pipeline
  split = np.array(pipeline.chunk_layers(layers))
  donor = pipeline.stages - 1 if split[-1] > 1 else int(np.argmax(split))
  receiver = 0 if donor != 0 else pipeline.stages - 1
  moved = split.copy()
  moved[donor] -= 1
  moved[receiver] += 1
  probe = state.price(
    candidate.decisions, dataclasses.replace(pipeline, layers_per_chunk=tuple(moved))
  )
  if probe is None or state.done():
    return
  time_line, memory_line = stage_lines(candidate.cost.terms, probe.cost.terms, split, moved)
  best = balance(layers, *time_line, *memory_line, float(state.problem.tables.hbm_bytes))
  if best is not None and best not in (tuple(split), tuple(moved)):
    state.price(candidate.decisions, dataclasses.replace(pipeline, layers_per_chunk=best))


def stage_lines(
  a: simulator.PipelineTerms, b: simulator.PipelineTerms, layers_a: np.ndarray, layers_b: np.ndarray
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """Each stage's microbatch time and peak memory as lines in its layer count, from the
  terms of two pricings of one plan whose layer splits `layers_a`, `layers_b` (int [S])
  differ on some stages.

  Every layer costs the same time on any stage (the mean slope of the stages that
  changed); its memory is its parameters, state, gathered copies and accumulated
  gradients, plus its residuals times the sets its residual buffer holds
  (`PipelineTerms.residual_sets`).

  Returns:
    `(offset, slope)` of time (seconds, float [S]) and of memory (bytes, float [S]).
  """
  changed = layers_a != layers_b
  delta = (layers_b - layers_a)[changed]
  slope = lambda x, y: float(np.mean((np.asarray(y) - np.asarray(x))[changed] / delta))
  time_a = np.asarray(a.microbatch_compute_s) + np.asarray(a.microbatch_comm_s)
  time_b = np.asarray(b.microbatch_compute_s) + np.asarray(b.microbatch_comm_s)
  time_slope = np.full(len(layers_a), slope(time_a, time_b))
  fixed = sum(
    slope(getattr(a, n), getattr(b, n))
    for n in ("live_bytes", "gathered_bytes", "accumulator_bytes")
  )
  memory_slope = fixed + np.asarray(a.residual_sets) * slope(a.residual_bytes, b.residual_bytes)
  return (
    (time_a - layers_a * time_slope, time_slope),
    (np.asarray(a.peak_memory) - layers_a * memory_slope, memory_slope),
  )


def balance(
  layers: int,
  time_offset: np.ndarray,
  time_slope: np.ndarray,
  memory_offset: np.ndarray,
  memory_slope: np.ndarray,
  memory_limit: float,
) -> tuple[int, ...] | None:
  """Alpa's stage-slicing DP: consecutive layers to S stages, at least one each, so that
  the slowest stage's time `time_offset[s] + n * time_slope[s]` is least, with every
  stage's memory `memory_offset[s] + n * memory_slope[s]` within `memory_limit` (all
  float [S]). O(S L^2).

  Returns:
    Layers per stage, [S], or None when no split fits in memory.
  """
  stages = len(time_offset)
  n = np.arange(layers + 1)
  # pace[s, j]: the least slowest-stage time of stages 0..s holding the first j layers.
  pace = np.full((stages, layers + 1), np.inf)
  take = np.zeros((stages, layers + 1), np.int64)
  fits = memory_offset[:, None] + n[None, :] * memory_slope[:, None] <= memory_limit  # [S, L + 1]
  stage_time = time_offset[:, None] + n[None, :] * time_slope[:, None]
  pace[0, 1:] = np.where(fits[0, 1:], stage_time[0, 1:], np.inf)
  take[0] = n
  for s in range(1, stages):
    for j in range(s + 1, layers + 1):
      own = np.arange(1, j - s + 1)  # Layers on stage s; the earlier stages keep at least one each.
      options = np.where(fits[s, own], np.maximum(pace[s - 1, j - own], stage_time[s, own]), np.inf)
      best = int(np.argmin(options))
      pace[s, j], take[s, j] = options[best], own[best]
  if not np.isfinite(pace[-1, layers]):
    return None
  split, j = [], layers
  for s in range(stages - 1, -1, -1):
    split.append(int(take[s, j]))
    j -= split[-1]
  return tuple(split[::-1])


def _result(problem: Problem, config: AlpaConfig, state: _Search, setup: float) -> SearchResult:
  """The best candidate as a search result: class decisions (as the named-dimension
  environment's actions; a repeat, which an earlier decision overrides, dropped),
  repriced with its pipeline."""
  best = state.best
  if not best.cost.fits:
    warnings.warn(
      f"alpa: no plan fits in memory; returning the one with the least memory "
      f"({float(best.cost.peak_memory) / 2**30:.1f} GiB per device)",
      stacklevel=3,
    )
  dec_class, dec_axis = problem.encode(best.decisions)
  decisions = list(
    dict.fromkeys(Decision(int(c), problem.mesh.axis_names[a]) for c, a in zip(dec_class, dec_axis))
  )
  pipeline = None if best.pipeline is None or best.pipeline.trivial else best.pipeline
  cost = problem.plan_cost(decisions, pipeline)
  seconds = time.perf_counter() - state.start
  trace = [
    *state.trace,
    TracePoint(state.simulations, seconds, float(cost.step_time), state.objective(cost)),
  ]
  env = searcher(problem, env_config(problem, config.action_space, config.max_decisions)).env
  target = {t.target: i for i, t in enumerate(env.targets)}
  action_ids = tuple(
    target[d.target] * env.config.max_axes + problem.mesh.axis_index(d.axis) for d in decisions
  )
  return SearchResult(
    decisions=decisions,
    cost=cost,
    trace=trace,
    simulations=state.simulations,
    seconds=seconds,
    actions=[env.action_name(a) for a in action_ids],
    objective=trace[-1].objective,
    setup_seconds=setup,
    action_ids=action_ids,
    pipeline=pipeline,
    stopped_by=state.stopped_by,
  )
