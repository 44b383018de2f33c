"""Compile-only validation at published sizes: does the simulator rank plans as XLA's
compiled modules do, and does a search exploit the difference?

For each case (a task-suite case, or the demo model) every applicable expert plan and the
plans a caller's searches find are lowered with abstract arguments (nothing allocated,
nothing run), compiled for the case's mesh on virtual CPU devices, and compared with the
simulator: comm bytes by kind and mesh axes, collective counts, flops, peak memory, and
whether the compiled module shards every value as the plan says (`Lowered.differences`).

The compiled-implied cost (`xla.implied`) prices what XLA compiled with the simulator's own
model.

Pipelined plans (`check_case(..., pipelines=True)`): the case's pipelined expert plans
(`tactics.applicable_pipelines`), each run as the schedule it is priced with
(`automap_rl.xla.pipeline_lower`), compiled and set beside the simulator's pipelined cost,
with the case's intra-op expert plans beside them so that the two kinds are ranked
together (`pairwise_agreement`, per case: `agreement_by_case`); besides the figures above,
the stage transfers: the compiled collective-permutes over the stage axis inside the
schedule's loop against the simulator's `PipelineTerms.permute_bytes`.

Two adjustments make the simulator and the CPU compile describe the same program: the
cases compile in float32 (the CPU backend carries bfloat16 collectives in float32, which
would double every compiled byte), and the simulator uses the CPU backend's collectives
(`HARDWARE["cpu"]`: its combiner, and reduce-scatters run as all-reduces) with the case
hardware's links and peaks.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from automap_rl import tactics, workloads
from automap_rl.mesh import HARDWARE, Mesh, make_mesh, to_jax_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import ArgDim, Decision, Group
from automap_rl.simulator import COMM_KINDS, CostTerms
from automap_rl.xla.fullsize_summary import (
  agreement_by_case,
  compiled_checks,
  exploit_gaps,
  family_table,
  pairwise_agreement,
  plot,
  summarize,
  term_errors,
  underpriced_term,
)
from automap_rl.xla.hlo import CompiledStats
from automap_rl.xla.implied import implied_cost, with_bubble
from automap_rl.xla.lower import lower
from automap_rl.xla.pipeline_lower import lower_pipelined
from automap_rl.xla.validate import (
  DONATE_ARGNUMS,
  compiled_metrics,
  simulated_metrics,
  trace_problem,
)

__all__ = [
  "FULLSIZE_CASES",
  "SAMPLED_CASES",
  "ZOO_CASES",
  "PlanCheck",
  "Search",
  "agreement_by_case",
  "check_case",
  "check_pipelined_plan",
  "compiled_checks",
  "decision_from_text",
  "exploit_gaps",
  "family_table",
  "pairwise_agreement",
  "plot",
  "recompiled",
  "resimulated",
  "stage_permute_bytes",
  "summarize",
  "term_errors",
  "underpriced_term",
  "validation_case",
  "validation_mesh",
]

# Cases at published sizes on 8 and 64 devices: the demo's model on a 2x4 and an 8x8 mesh,
# then GPT, MoE, U-Net and SSM (a time-step scan inside the layer scan) cases of the task
# suite.
FULLSIZE_CASES = (
  "demo-gpt-2x4-h100",
  "demo-gpt-8x8-h100",
  "gpt-1.3b-2x4-h100",
  "moe-380m-2x4-a100-40g",
  "unet-ddpm-cifar10-4x2-a100-40g",
  "ssm-130m-4x2-a100-40g",
  "gpt-6.7b-8x8-h100",
  "moe-27b-8x8-a100-80g",
  "unet-sd-1.5-8x8-h100",
  "ssm-2.8b-8x8-h100",
)
_DEMO = {"demo-gpt-2x4-h100": "data=2,model=4", "demo-gpt-8x8-h100": "data=8,model=8"}
DEMO_WORKLOAD = "gpt:layers=8,d_model=1024"

# Zoo cases outside the task suite, at sizes of their kind: (workload, mesh, hardware);
# the ResNet is in no split; the MLP, LSTM and DiT train on other meshes. A
# ResNet-18-shaped network (uniform basic blocks, GroupNorm) at ImageNet resolution and a
# wider one; deep and wide MLPs; the LSTM language models of Jozefowicz et al. and GNMT's
# stack; DiT-B/2 and DiT-XL/2 at the paper's batch of 256.
ZOO_CASES = {
  "mlp-8x8192-2x4-h100": ("mlp:size=8x8192,batch=1024", "data=2,model=4", "h100"),
  "mlp-4x16384-4x8-a100-80g": ("mlp:size=4x16384,batch=2048", "data=4,model=8", "a100-80g"),
  "resnet-18-4x2-a100-40g": (
    "resnet:stages=4,blocks=2,width=64,groups=32,image_size=224,classes=1000,batch=256",
    "data=4,model=2",
    "a100-40g",
  ),
  "resnet-4x3x128-8x4-tpu-v5e": (
    "resnet:stages=4,blocks=3,width=128,groups=32,image_size=224,classes=1000,batch=512",
    "data=8,model=4",
    "tpu-v5e",
  ),
  "lstm-8192-1024-4x4-tpu-v5e": ("lstm:size=8192-1024,batch=64", "data=4,model=4", "tpu-v5e"),
  "lstm-gnmt-1024-8x4-h100": ("lstm:size=gnmt-1024,batch=128", "data=8,model=4", "h100"),
  "dit-b-2-4x2-a100-40g": ("dit:size=b-2,batch=256", "data=4,model=2", "a100-40g"),
  "dit-xl-2-8x4-h100": ("dit:size=xl-2,batch=256", "data=8,model=4", "h100"),
}

# The sampled run over every family: two task-suite cases of each suite family that the
# simulator was not developed against (none of `FULLSIZE_CASES`), and `ZOO_CASES`; 8 to 64
# devices, two- and three-axis meshes, A100, H100 and TPU profiles.
SAMPLED_CASES = (
  "gpt-350m-8x2-a100-80g",
  "gpt-2.6b-2x2x8-h100",
  "llama-8b-2x8-h100",
  "llama-70b-8x8-a100-80g-remat",
  "moe-690m-4x4-h100",
  "moe-2.4b-8x4-tpu-v5e",
  "vit-b16-4x2-a100-40g",
  "vit-h14-8x4-a100-80g",
  "wresnet-250m-4x2-a100-40g",
  "wresnet-2b-4x8-a100-80g",
  "gnn-mgn-4x4-tpu-v5e",
  "gnn-graphcast-8x8-h100",
  "t5-base-4x4-tpu-v5e",
  "t5-xl-4x8-a100-80g",
  "unet-ddpm-cifar10-8x2-tpu-v5e",
  "unet-sd-1.5-4x4-a100-80g",
  "ssm-370m-4x4-tpu-v5e",
  "ssm-1.4b-4x8-a100-80g",
  *ZOO_CASES,
)

# A search: (problem, seed) -> {plan name: (decisions, pipeline or None)}, e.g. UCT and
# random at 2000.
Search = Callable[[Problem, int], Mapping[str, tuple[Sequence[Decision], Pipeline | None]]]


@dataclasses.dataclass(frozen=True)
class PlanCheck:
  """One plan of one case, simulated and compiled.

  Attributes:
    case: the case name.
    devices: devices of its mesh.
    plan: an expert tactic name or a search's name.
    searched: whether a search found it.
    decisions: the plan, as text.
    simulated: `validate.simulated_metrics` plus `step_time` (seconds) and `fits`; of
      a pipelined plan also `stage_permute_bytes` (`PipelineTerms.permute_bytes`).
    compiled: `validate.compiled_metrics` plus the compiled-implied `step_time`,
      `compute_time` and `comm_time` (seconds); of a pipelined plan also
      `stage_permute_bytes` (`stage_permute_bytes`).
    differences: values the compiled module shards otherwise than the plan (0 for a
      pipelined plan, whose shardings are pinned but not compared: `lower_pipelined`).
    seconds: wall time of lowering and compiling.
    pipeline: a pipelined plan's `Pipeline.to_json`, else None.
    family: the case's model family.
    error: why the plan could not be lowered or compiled (then `compiled` is empty and the
      plan counts as not realized), else None.
  """

  case: str
  devices: int
  plan: str
  searched: bool
  decisions: tuple[str, ...]
  simulated: dict[str, Any]
  compiled: dict[str, Any]
  differences: int
  seconds: float
  pipeline: dict[str, Any] | None = None
  family: str = ""
  error: str | None = None


def validation_case(name: str) -> workloads.Case:
  """The case called `name` (`FULLSIZE_CASES`, `ZOO_CASES` or any task-suite case),
  computing in float32."""
  if name in _DEMO:
    case = workloads.Case(
      name=name,
      workload=DEMO_WORKLOAD,
      family="gpt",
      size="demo",
      mesh=_DEMO[name],
      hardware="h100",
      split="validate",
    )
  elif name in ZOO_CASES:
    workload, mesh, hardware = ZOO_CASES[name]
    case = workloads.Case(
      name=name,
      workload=workload,
      family=workload.partition(":")[0],
      size="zoo",
      mesh=mesh,
      hardware=hardware,
      split="validate",
    )
  else:
    known = {c.name: c for c in workloads.load_cases()}
    if name not in known:
      raise ValueError(
        f"Unknown validation case {name!r}; valid: {', '.join(FULLSIZE_CASES)}, "
        f"{', '.join(ZOO_CASES)} or a suite case."
      )
    case = known[name]
  if not hasattr(workloads.spec.make_config(case.workload)[1], "dtype"):
    return case  # A family without a dtype key computes in float32.
  return dataclasses.replace(case, workload=f"{case.workload},dtype=float32")


def validation_mesh(case: workloads.Case) -> Mesh:
  """The case's mesh and hardware, compiled by the CPU backend (`Hardware.compiled_by`):
  its collective combiner, reduce-scatter (an all-reduce), dense batch-grouped
  convolutions, fusions of one result each and minor-dim concatenates as kernels of their
  own."""
  return make_mesh(case.mesh, HARDWARE[case.hardware].compiled_by(HARDWARE["cpu"]))


def _simulated(
  problem: Problem, decisions: Sequence[Decision], pipeline: Pipeline | None
) -> dict[str, Any]:
  """The simulator's side of a check: `simulated_metrics`, `step_time` (seconds), `fits`,
  and of a pipelined plan `stage_permute_bytes` (`PipelineTerms.permute_bytes`) and
  `bubble_time` (`PipelineTerms.bubble_s`)."""
  cost = problem.cost(decisions) if pipeline is None else problem.plan_cost(decisions, pipeline)
  simulated = {
    **simulated_metrics(problem, decisions, pipeline),
    "step_time": float(cost.step_time),
    "fits": bool(cost.fits),
  }
  if pipeline is not None:
    simulated["stage_permute_bytes"] = float(cost.terms.permute_bytes)
    simulated["bubble_time"] = float(cost.terms.bubble_s)
  else:
    simulated["compute_time"] = float(cost.compute_time)
    simulated["comm_time_by_kind"] = comm_time_by_kind(problem.cost_terms(decisions))
  return simulated


def comm_time_by_kind(terms: CostTerms) -> dict[str, float]:
  """Seconds of one plan's collectives by kind (`COMM_KINDS`), from its cost terms."""
  kinds = (
    (terms.all_reduce,),
    (terms.gather,),
    (terms.reduce_scatter,),
    (terms.all_to_all,),
    (terms.permute, terms.dot_permute),
  )
  return {
    k: float(sum(np.sum(t.seconds) for t in of_kind)) for k, of_kind in zip(COMM_KINDS, kinds)
  }


def check_plan(
  case: str,
  problem: Problem,
  workload: workloads.Workload,
  plan: str,
  decisions: Sequence[Decision],
  searched: bool,
) -> PlanCheck:
  """Lowers and compiles one plan (abstract arguments) and measures both sides."""
  start = time.perf_counter()
  lowered = lower(
    problem,
    decisions,
    workload.step,
    workload.args,
    donate_argnums=DONATE_ARGNUMS,
    executable=False,
  )
  simulated = _simulated(problem, decisions, None)
  compiled = {**compiled_metrics(lowered.stats), **implied_cost(problem, lowered.stats)}
  return PlanCheck(
    case=case,
    devices=problem.mesh.num_devices,
    plan=plan,
    searched=searched,
    decisions=tuple(map(str, decisions)),
    simulated=simulated,
    compiled=compiled,
    differences=len(lowered.differences),
    seconds=time.perf_counter() - start,
  )


def stage_permute_bytes(stats: CompiledStats, pipeline: Pipeline) -> float:
  """Per-device bytes of the compiled stage transfers: the collective-permutes over the
  pipeline's axis (its `{axis}_stages` part where the stages are fewer than its devices,
  `pipeline_lower.split_stage_axis`) inside the schedule's loop (`repeat` > 1), times
  their trip counts."""
  axes = ((pipeline.axis,), (f"{pipeline.axis}_stages",))
  return float(
    sum(
      c.repeat * c.bytes
      for c in stats.collectives
      if c.kind == "collective-permute" and c.mesh_axes in axes and c.repeat > 1
    )
  )


def check_pipelined_plan(
  case: str,
  problem: Problem,
  workload: workloads.Workload,
  plan: str,
  decisions: Sequence[Decision],
  pipeline: Pipeline,
) -> PlanCheck:
  """Lowers and compiles one pipelined plan (`pipeline_lower.lower_pipelined`, abstract
  arguments) and measures both sides, the stage transfers included."""
  start = time.perf_counter()
  lowered = lower_pipelined(
    problem,
    decisions,
    pipeline,
    workload.loss_fn,
    workload.optimizer,
    workload.args,
    to_jax_mesh(problem.mesh),
    DONATE_ARGNUMS,
    isolated=True,
    executable=False,
  )
  simulated = _simulated(problem, decisions, pipeline)
  compiled = {
    **compiled_metrics(lowered.stats),
    **with_bubble(implied_cost(problem, lowered.stats), simulated),
    "stage_permute_bytes": stage_permute_bytes(lowered.stats, pipeline),
  }
  return PlanCheck(
    case=case,
    devices=problem.mesh.num_devices,
    plan=plan,
    searched=False,
    decisions=tuple(map(str, decisions)),
    simulated=simulated,
    compiled=compiled,
    differences=0,
    seconds=time.perf_counter() - start,
    pipeline=pipeline.to_json(),
  )


def _failed_check(
  case: workloads.Case,
  problem: Problem,
  plan: str,
  decisions: Sequence[Decision],
  pipeline: Pipeline | None,
  searched: bool,
  error: Exception,
  seconds: float,
) -> PlanCheck:
  """A plan that did not lower or compile: the simulator's side and the error."""
  return PlanCheck(
    case=case.name,
    devices=problem.mesh.num_devices,
    plan=plan,
    searched=searched,
    decisions=tuple(map(str, decisions)),
    simulated=_simulated(problem, decisions, pipeline),
    compiled={},
    differences=0,
    seconds=seconds,
    pipeline=None if pipeline is None else pipeline.to_json(),
    family=case.family,
    error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300],
  )


def check_case(
  name: str,
  search: Search | None = None,
  seed: int = 0,
  report: Callable[[PlanCheck], None] = lambda check: None,
  pipelines: bool = False,
  experts: bool = True,
) -> list[PlanCheck]:
  """Every applicable expert plan of case `name` (none without `experts`: a run of the
  searched plans alone, merged later with one of the experts) and the plans `search` finds
  (a searched pipeline run as its schedule); with `pipelines`, also every applicable
  pipelined expert plan (those of one plan and pipeline once). A
  plan that fails to lower or compile is a check with its `error`, and the case goes on."""
  case = validation_case(name)
  workload = case.make_workload(abstract=True)
  problem = trace_problem(workload, case.mesh, validation_mesh(case).hardware)
  plans = [
    (plan, decisions, None, False)
    for plan, decisions in tactics.applicable(problem).items()
    if experts
  ]
  if pipelines and experts:
    plans += [
      (plan, decisions, pipeline, False)
      for plan, (decisions, pipeline) in tactics.applicable_pipelines(problem).items()
    ]
  if search is not None:
    plans += [
      (plan, list(decisions), pipeline, True)
      for plan, (decisions, pipeline) in search(problem, seed).items()
    ]
  return _check_plans(case, problem, workload, plans, report)


def _check_plans(
  case: workloads.Case,
  problem: Problem,
  workload: workloads.Workload,
  plans: Sequence[tuple[str, Sequence[Decision], Pipeline | None, bool]],
  report: Callable[[PlanCheck], None],
) -> list[PlanCheck]:
  """A check of each of `plans`, `(name, decisions, pipeline or None, searched)`, of one
  case (a pipeline run as its schedule; an expert's pipelined plan met before, once)."""
  name = case.name
  checks, seen = [], []
  for plan, decisions, pipeline, searched in plans:
    if pipeline is not None:
      if not searched and (decisions, pipeline) in seen:
        continue
      seen.append((decisions, pipeline))
    start = time.perf_counter()
    try:
      if pipeline is None:
        check = check_plan(name, problem, workload, plan, decisions, searched)
      else:
        check = dataclasses.replace(
          check_pipelined_plan(name, problem, workload, plan, decisions, pipeline),
          searched=searched,
        )
      checks.append(dataclasses.replace(check, family=case.family))
    except Exception as error:  # noqa: BLE001 -- one plan's failure is a finding, not the end of the run.
      checks.append(
        _failed_check(
          case, problem, plan, decisions, pipeline, searched, error, time.perf_counter() - start
        )
      )
    report(checks[-1])
  return checks


# `repr` of a `Decision`: an `ArgDim` (its path a Python string literal), a `Group` or a class id.
_STRING_LITERAL = r"'(?:[^'\\]|\\.)*'" + "|" + r'"(?:[^"\\]|\\.)*"'
_DECISION = re.compile(
  rf"Decision\(target=(?:ArgDim\(path=(?P<path>{_STRING_LITERAL}), dim=(?P<dim>\d+)\)"
  r"|Group\(id=(?P<group>\d+)\)|(?:np\.int\d+\()?(?P<cls>\d+)\)?), axis='(?P<axis>[^']+)'\)"
)


def decision_from_text(text: str) -> Decision:
  """The decision whose `repr` is `text` (`PlanCheck.decisions`)."""
  match = _DECISION.fullmatch(text)
  if match is None:
    raise ValueError(f"Not a decision: {text!r}")
  if match["path"] is not None:
    target = ArgDim(ast.literal_eval(match["path"]), int(match["dim"]))
  else:
    target = Group(int(match["group"])) if match["group"] is not None else int(match["cls"])
  return Decision(target, match["axis"])


def resimulated(
  checks: Sequence[PlanCheck], report: Callable[[str], None] = lambda case: None
) -> list[PlanCheck]:
  """`checks` with their simulated side priced again by this checkout's simulator. Their
  compiled side does not depend on it, so a change of the simulator is re-measured on
  compiled plans in the time it takes to trace their cases; `report` sees each case
  before it is traced."""
  problems: dict[str, Problem] = {}
  out = []
  for check in checks:
    if check.case not in problems:
      report(check.case)
      case = validation_case(check.case)
      problems[check.case] = trace_problem(
        case.make_workload(abstract=True), case.mesh, validation_mesh(case).hardware
      )
    pipeline = None if check.pipeline is None else Pipeline.from_json(check.pipeline)
    decisions = [decision_from_text(d) for d in check.decisions]
    out.append(
      dataclasses.replace(check, simulated=_simulated(problems[check.case], decisions, pipeline))
    )
  return out


def recompiled(
  checks: Sequence[PlanCheck], report: Callable[[PlanCheck], None] = lambda check: None
) -> list[PlanCheck]:
  """`checks` measured again on both sides by this checkout: each plan lowered and
  compiled anew and priced by this simulator (a change of the lowering or of the compiled
  side's measures re-measured on stored plans, without searching for them again), case by
  case in the order met; `report` sees each check."""
  by_case: dict[str, list[PlanCheck]] = {}
  for check in checks:
    by_case.setdefault(check.case, []).append(check)
  out = []
  for name, stored in by_case.items():
    case = validation_case(name)
    workload = case.make_workload(abstract=True)
    problem = trace_problem(workload, case.mesh, validation_mesh(case).hardware)
    plans = [
      (
        c.plan,
        [decision_from_text(d) for d in c.decisions],
        None if c.pipeline is None else Pipeline.from_json(c.pipeline),
        c.searched,
      )
      for c in stored
    ]
    out += _check_plans(case, problem, workload, plans, report)
  return out
