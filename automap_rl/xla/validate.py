"""Validation of the simulator against XLA: per model, mesh and plan, the simulated and
the compiled comm bytes, collective counts, flops and peak memory, and the numerics.

One trace and one `Problem` per (model, mesh); plans are the expert tactics of
`automap_rl.tactics` plus seeded random decision lists. Each plan is lowered
(`automap_rl.xla.lower`), compiled, run and compared with the unpartitioned step.
Random pipelined plans (`RandomSuite.pipelines`) put random decisions inside a random
pipeline of a layer stack (GPipe, 1F1B, interleaved or gradient accumulation) and lower it
as its schedule with `automap_rl.xla.pipeline_lower`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from automap_rl import ir, tactics, workloads
from automap_rl.mesh import make_mesh, to_jax_mesh
from automap_rl.pipeline import Pipeline, batch_size
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.xla.lower import LoweringError, lower
from automap_rl.xla.numerics import (
  NumericsError,
  Reference,
  compare_outputs,
  compute_dtype,
  reference_outputs,
)
from automap_rl.xla.pipeline_lower import check_lowerable, lower_pipelined
from automap_rl.xla.plan_metrics import (
  compiled_metrics,
  pipelined_flops,
  simulated_flops,
  simulated_metrics,
)
from automap_rl.xla.validation_summary import (
  plot,
  relative_error,
  spearman,
  summarize_cases,
  to_json,
)

__all__ = [
  "PIPELINE_MESHES",
  "PIPELINE_MODELS",
  "SUITES",
  "ValidatedPlan",
  "RandomSuite",
  "ValidationSuite",
  "compiled_metrics",
  "plot",
  "pipelined_flops",
  "plans_for",
  "random_pipeline",
  "random_pipelined_plan",
  "random_plan",
  "relative_error",
  "run_case",
  "run_random",
  "run_suite",
  "simulated_flops",
  "simulated_metrics",
  "spearman",
  "summarize_cases",
  "to_json",
]

DONATE_ARGNUMS = (0, 1)  # params and optimizer state, as `experiments.inspect_cmd` traces them.


@dataclasses.dataclass(frozen=True)
class ValidationSuite:
  """Which cases to run.

  Attributes:
    models: zoo specs.
    meshes: mesh specs, e.g. `data=2,model=4`.
    random_plans: seeded random decision lists per (model, mesh), besides the tactics.
    max_random_decisions: each random plan has 1 to this many decisions.
    seed: seed of the random plans and the model parameters.
    hardware: the simulator's hardware profile (irrelevant to bytes, flops and memory).
    skip: (mesh, plan) pairs not run, e.g. a replicated plan already run on another mesh
      (it compiles to the same program).
    isolated: compile each plan in a child process first (see `lower`).
  """

  models: tuple[str, ...]
  meshes: tuple[str, ...] = ("data=8", "data=2,model=4")
  random_plans: int = 2
  max_random_decisions: int = 4
  seed: int = 0
  hardware: str = "cpu"
  skip: tuple[tuple[str, str], ...] = ()
  isolated: bool = True


SUITES: dict[str, ValidationSuite] = {
  "quick": ValidationSuite(
    models=(
      "mlp:layers=2,width=64,in_dim=32,classes=8,batch=16",
      "gpt:layers=1,d_model=32,heads=4,seq=16,vocab=64,batch=8",
      "moe:layers=1,d_model=32,heads=4,seq=16,vocab=64,batch=8,experts=4",
      "gnn:n_node=8,n_edge=16,node_dim=8,edge_dim=8,latent=32,steps=1,batch=8",
      "resnet:stages=2,width=8,groups=4,image_size=8,classes=8,batch=8",
      "unet:levels=1,base_channels=8,groups=4,image_size=8,batch=8",
    ),
    random_plans=1,
    # 50 cases, every model on both meshes. Skipped: the replicated plan on the 2-D
    # mesh (the same program as on data=8), and on the 1-D mesh the tensor-parallel
    # plans (the 2-D mesh runs them on its model axis).
    skip=(("data=2,model=4", "replicated"), ("data=8", "megatron"), ("data=8", "data_megatron")),
  ),
  "full": ValidationSuite(models=("mlp", "gpt", "moe", "gnn", "resnet", "unet"), random_plans=6),
}


@dataclasses.dataclass(frozen=True)
class ValidatedPlan:
  """One validated plan: metrics are dicts of `comm_bytes` (total), `comm_bytes_by_kind`,
  `comm_count_by_kind`, `flops` and `peak_memory`, per device; `differences` are the
  values XLA shards otherwise than the plan (`Lowered.differences`, as dicts), empty when
  the plan is realized as written; `reference` is what the numerics were compared with
  (`Reference.note`: `float64`, or float32 and why); `lowering_error` is the
  `LoweringError` of a plan XLA could not compile (then `compiled` is empty); `pipeline`
  is a pipelined plan's `Pipeline.to_json`, None for a plan without one."""

  model: str
  mesh: str
  plan: str
  decisions: tuple[str, ...]
  simulated: dict[str, Any]
  compiled: dict[str, Any]
  numerics_ok: bool
  numerics_error: str | None
  seconds: float
  differences: tuple[dict[str, Any], ...] = ()
  reference: str = "float64"
  lowering_error: str | None = None
  pipeline: dict[str, Any] | None = None


# -- plans --------------------------------------------------------------------------------


def random_plan(problem: Problem, rng: np.random.Generator, max_decisions: int) -> list[Decision]:
  """1 to `max_decisions` random (named dimension, mesh axis) pairs; only pairs whose
  class size the axis divides, so that every decision can take effect somewhere."""
  mesh = problem.mesh
  pairs = [
    (c.id, a)
    for c in problem.named.classes
    for a, n in zip(mesh.axis_names, mesh.axis_sizes)
    if c.size % n == 0 and c.size > 1
  ]
  count = int(rng.integers(1, max_decisions + 1))
  chosen = rng.choice(len(pairs), size=min(count, len(pairs)), replace=False)
  return [Decision(pairs[i][0], pairs[i][1]) for i in chosen]


def random_pipeline(problem: Problem, args: Sequence[Any], rng: np.random.Generator) -> Pipeline:
  """A random pipeline that `pipeline_lower` runs for the step's example `args`: a random
  layer stack and mesh axis whose size divides its layers, as many stages as the axis has
  devices (or one: gradient accumulation), 4 or 8 microbatches (those that divide the
  batch), a random schedule (GPipe, 1F1B, interleaved with 2 chunks where they divide), and
  weights split over the batch axes gathered in every microbatch or once a step
  (`Pipeline.gather_weights_once`), at random.

  Raises:
    ValueError: the program and mesh have no such pipeline (one line saying why).
  """
  program, mesh = problem.program, problem.mesh
  batch = batch_size(program)
  counts = [m for m in (4, 8) if batch % m == 0]
  options = []
  for index, stack in enumerate(problem.layer_stacks):
    for axis, size in zip(mesh.axis_names, mesh.axis_sizes):
      if size < 2 or stack.layers % size:
        continue
      for m in counts:
        drawn = [
          Pipeline(axis, stages=size, microbatches=m, schedule=schedule, stack=index)
          for schedule in ("gpipe", "1f1b")
        ] + [Pipeline(axis, stages=1, microbatches=m, stack=index)]  # Accumulation.
        if stack.layers % (2 * size) == 0 and m % size == 0:
          drawn.append(Pipeline(axis, size, m, "interleaved", chunks=2, stack=index))
        for pipeline in drawn:
          try:
            check_lowerable(pipeline, stack, args)
          except NotImplementedError:
            continue
          options.append(pipeline)
  if not options:
    stacks = "; ".join(s.describe() for s in problem.layer_stacks) or "no layer stack"
    raise ValueError(
      f"no lowerable pipeline (a scanned stack whose layers an axis of {mesh.axis_names} "
      f"{mesh.axis_sizes} divides, 4 or 8 microbatches of the batch of {batch}, a step of (params, "
      f"opt_state, batch)); the program has: {stacks}"
    )
  pipeline = options[int(rng.integers(len(options)))]
  return dataclasses.replace(pipeline, gather_weights_once=bool(rng.integers(2)))


def random_pipelined_plan(
  problem: Problem, args: Sequence[Any], rng: np.random.Generator, max_decisions: int
) -> tuple[list[Decision], Pipeline]:
  """`random_pipeline` with up to `max_decisions` random (named dimension, mesh axis)
  decisions inside its stages: pairs off the stage axis whose class size the axis
  divides, each kept only where the plan still divides at microbatch and stage size
  (`PipelineProblem.resolution`)."""
  pipeline = random_pipeline(problem, args, rng)
  pipelined, mesh = problem.pipelined(pipeline), problem.mesh
  pairs = [
    (c.id, a)
    for c in problem.named.classes
    for a, n in zip(mesh.axis_names, mesh.axis_sizes)
    if a != pipeline.axis and c.size % n == 0 and c.size > 1
  ]
  count = int(rng.integers(1, max_decisions + 1))
  decisions: list[Decision] = []
  for i in rng.permutation(len(pairs)):
    if len(decisions) == count:
      break
    candidate = [*decisions, Decision(*pairs[i])]
    try:
      pipelined.resolution(candidate)
    except ValueError:
      continue
    decisions = candidate
  return decisions, pipeline


def plans_for(problem: Problem, suite: ValidationSuite, seed: int) -> dict[str, list[Decision]]:
  """Expert plans then `suite.random_plans` random ones (`random_0`, ...)."""
  plans = tactics.applicable(problem)
  rng = np.random.default_rng(seed)
  for i in range(suite.random_plans):
    plans[f"random_{i}"] = random_plan(problem, rng, suite.max_random_decisions)
  return plans


# -- running ------------------------------------------------------------------------------


def run_case(
  problem: Problem,
  workload: workloads.Workload,
  mesh_spec: str,
  plan: str,
  decisions: Sequence[Decision],
  reference: Reference,
  isolated: bool = True,
  pipeline: Pipeline | None = None,
) -> ValidatedPlan:
  """Lowers (`isolated`: compiling in a child process first, see `lower`), compiles and
  runs one plan; `reference` is `reference_outputs` of the step. A plan XLA cannot compile
  is a failed case with its `lowering_error`. With a `pipeline`, the pipelined step of
  the workload's loss function and optimizer (`pipeline_lower.lower_pipelined`)."""
  start = time.perf_counter()
  common = dict(
    model=workload.name,
    mesh=mesh_spec,
    plan=plan,
    decisions=tuple(map(str, decisions)),
    simulated=simulated_metrics(problem, decisions, pipeline),
    reference=reference.note,
    pipeline=None if pipeline is None else pipeline.to_json(),
  )
  try:
    if pipeline is None:
      lowered = lower(
        problem,
        decisions,
        workload.step,
        workload.args,
        donate_argnums=DONATE_ARGNUMS,
        isolated=isolated,
      )
    else:
      lowered = lower_pipelined(
        problem,
        decisions,
        pipeline,
        workload.loss_fn,
        workload.optimizer,
        workload.args,
        to_jax_mesh(problem.mesh),
        DONATE_ARGNUMS,
        isolated,
      )
  except LoweringError as e:
    return ValidatedPlan(
      **common,
      compiled={},
      numerics_ok=False,
      numerics_error=None,
      seconds=time.perf_counter() - start,
      lowering_error=str(e),
    )
  error = None
  try:
    compare_outputs(reference, lowered.run(workload.args), lowered.depth)
  except NumericsError as e:
    error = str(e)
  return ValidatedPlan(
    **common,
    compiled=compiled_metrics(lowered.stats),
    numerics_ok=error is None,
    numerics_error=error,
    seconds=time.perf_counter() - start,
    differences=tuple(dataclasses.asdict(d) for d in lowered.differences),
  )


def trace_workload(workload: workloads.Workload) -> ir.Program:
  return ir.trace(
    workload.step,
    *workload.args,
    arg_names=workload.arg_names,
    arg_roles=workload.arg_roles,
    donate_argnums=DONATE_ARGNUMS,
  )


def trace_problem(workload: workloads.Workload, mesh_spec: str, hardware: str) -> Problem:
  return Problem.build(trace_workload(workload), make_mesh(mesh_spec, hardware))


def run_suite(
  suite: ValidationSuite, report: Callable[[ValidatedPlan], None] = lambda case: None
) -> list[ValidatedPlan]:
  """Every (model, mesh, plan) of `suite`; `report` sees each case as it finishes."""
  cases = []
  for m, spec in enumerate(suite.models):
    workload = workloads.make_workload(spec, seed=suite.seed)
    program = trace_workload(workload)
    reference = reference_outputs(workload.step, workload.args, compute=compute_dtype(program))
    for mesh_spec in suite.meshes:
      problem = Problem.build(program, make_mesh(mesh_spec, suite.hardware))
      for plan, decisions in plans_for(problem, suite, seed=suite.seed * 1000 + m).items():
        if (mesh_spec, plan) in suite.skip:
          continue
        cases.append(
          run_case(problem, workload, mesh_spec, plan, decisions, reference, suite.isolated)
        )
        report(cases[-1])
  return cases


# `validate --random N --pipelines` by default: small models with a scanned stack of 4
# layers (GPT in linen, Llama in nnx, the Mamba SSM in Equinox), on meshes of 8 devices
# with an axis of 2 and one of 4 to put stages on.
PIPELINE_MODELS = (
  "gpt:layers=4,d_model=32,heads=2,seq=16,vocab=64,batch=8,scan=true",
  "llama:layers=4,d_model=32,heads=2,kv_heads=1,d_ff=64,seq=16,vocab=64,batch=8",
  "ssm:layers=4,d_model=16,seq=16,vocab=64,batch=8",
  "gpt:layers=4,d_model=32,heads=2,seq=16,vocab=64,batch=8",  # Unrolled: 1F1B, interleaved.
)
PIPELINE_MESHES = ("stage=2,data=2,model=2", "stage=4,data=2")


@dataclasses.dataclass(frozen=True)
class RandomSuite:
  """`automap-rl validate --random N`: random plans, numerics first.

  Attributes:
    models: workload specs; None: every family at small size (`workloads.SMALL`), or
      with `pipelines` `PIPELINE_MODELS`.
    plans: random plans per model, on the meshes in turn.
    meshes: the meshes (8 devices each); None: `data=8` and `data=2,model=4`, or with
      `pipelines` `PIPELINE_MESHES`.
    max_random_decisions: decisions per plan, 1 to this many (`random_plan`).
    seed: seeds the workloads and the plans.
    hardware: the simulator's hardware profile.
    workers: processes running plans side by side (each with its own jax and compiling
      child); the cases and their order do not depend on it.
    pipelines: every plan is pipelined: random decisions inside a random pipeline
      (`random_pipelined_plan`).
  """

  models: tuple[str, ...] | None = None
  plans: int = 10
  meshes: tuple[str, ...] | None = None
  max_random_decisions: int = 4
  seed: int = 0
  hardware: str = "cpu"
  workers: int = 1
  pipelines: bool = False

  def __post_init__(self):
    if self.models is None:
      object.__setattr__(
        self, "models", PIPELINE_MODELS if self.pipelines else tuple(workloads.SMALL.values())
      )
    if self.meshes is None:
      object.__setattr__(
        self, "meshes", PIPELINE_MESHES if self.pipelines else ("data=8", "data=2,model=4")
      )


# One random plan: its mesh, decisions and pipeline (None: not pipelined).
RandomPlan = tuple[str, list[Decision], Pipeline | None]


@functools.lru_cache(maxsize=1)
def _random_model(
  suite: RandomSuite, m: int
) -> tuple[workloads.Workload, Reference, dict[str, Problem], list[RandomPlan]]:
  """Model `m` of `suite`: its workload, reference outputs, one problem per mesh (one
  trace) and its `suite.plans` random plans, the same in every process.

  Raises:
    ValueError: with `suite.pipelines`, a model and mesh without a lowerable pipeline.
  """
  workload = workloads.make_workload(suite.models[m], seed=suite.seed)
  program = trace_workload(workload)
  reference = reference_outputs(workload.step, workload.args, compute=compute_dtype(program))
  problems = {
    mesh: Problem.build(program, make_mesh(mesh, suite.hardware)) for mesh in suite.meshes
  }
  rng = np.random.default_rng(suite.seed * 1000 + m)
  plans: list[RandomPlan] = []
  for i in range(suite.plans):
    mesh = suite.meshes[i % len(suite.meshes)]
    if not suite.pipelines:
      plans.append((mesh, random_plan(problems[mesh], rng, suite.max_random_decisions), None))
      continue
    try:
      plans.append(
        (
          mesh,
          *random_pipelined_plan(problems[mesh], workload.args, rng, suite.max_random_decisions),
        )
      )
    except ValueError as e:
      raise ValueError(f"{suite.models[m]} on {mesh}: {e}") from None
  return workload, reference, problems, plans


def _random_cases(suite: RandomSuite, m: int, start: int, stop: int) -> Iterator[ValidatedPlan]:
  """Random plans `start` to `stop` of model `m`, each lowered, run and checked."""
  workload, reference, problems, plans = _random_model(suite, m)
  for i in range(start, stop):
    mesh, decisions, pipeline = plans[i]
    yield run_case(
      problems[mesh], workload, mesh, f"random_{i}", decisions, reference, pipeline=pipeline
    )


def _random_case_list(suite: RandomSuite, m: int, start: int, stop: int) -> list[ValidatedPlan]:
  return list(_random_cases(suite, m, start, stop))


def run_random(
  suite: RandomSuite, report: Callable[[ValidatedPlan], None] = lambda case: None
) -> list[ValidatedPlan]:
  """`suite.plans` random plans per model, each lowered (compiled in a child process first:
  an XLA abort is a failed case, never the end of this process), run and compared with the
  unpartitioned step; one trace per model and process. With `suite.workers` > 1, runs of
  a tenth of a model's plans each go to that many processes (started fresh, `spawn`:
  they read the XLA flags of this process's environment). `report` sees each case as it
  finishes (with workers, each run's cases when it ends); the returned cases are in
  model and plan order either way."""
  if suite.plans < 1:
    raise ValueError(f"--random {suite.plans}: give a positive number of plans per model.")
  if suite.workers < 1:
    raise ValueError(f"--workers {suite.workers}: give at least one process.")
  size = -(-suite.plans // 10)
  runs = [
    (m, start, min(start + size, suite.plans))
    for m in range(len(suite.models))
    for start in range(0, suite.plans, size)
  ]
  if suite.workers == 1:
    cases = []
    for run in runs:
      for case in _random_cases(suite, *run):
        cases.append(case)
        report(case)
    _random_model.cache_clear()  # The last model's arrays.
    return cases
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(suite.workers, mp_context=context) as pool:
    futures = [pool.submit(_random_case_list, suite, *run) for run in runs]
    for future in concurrent.futures.as_completed(futures):
      for case in future.result():
        report(case)
    return [case for future in futures for case in future.result()]
