"""Compile-only validation at published sizes: does the simulator rank plans as XLA's
compiled modules do, and does a search exploit the difference?

For each case (a task-suite case, or the demo model) every applicable expert plan and the
plans a caller's searches find are lowered with abstract arguments (nothing allocated,
nothing run), compiled for the case's mesh on virtual CPU devices, and compared with the
simulator: comm bytes by kind and mesh axes, collective counts, flops, peak memory, and
whether the compiled module shards every value as the plan says (`Lowered.differences`).

The compiled-implied cost prices what XLA compiled with the simulator's own model:
every compiled collective (collective-permutes included) in the alpha-beta model of
`simulator.collective_seconds`, times the loop trip counts around it, plus compute as the
module's flops at the hardware's peak plus its bytes accessed at HBM bandwidth (a sum, so
an upper bound of the per-kernel roofline the simulator charges per op).

Pipelined plans (`check_case(..., pipelines=True)`): the case's pipelined expert plans
(`tactics.applicable_pipelines`), run in GPipe order as `automap_rl.xla.pipeline_lower`
lowers them (and so priced as GPipe), each compiled and set beside the simulator's
pipelined cost, with the case's intra-op expert plans beside them so that the two kinds
are ranked together (`pairwise_agreement`, per case: `agreement_by_case`); besides the
figures above, the stage transfers: the compiled collective-permutes over the stage axis
inside the microbatch loop against the simulator's `PipelineTerms.permute_bytes`.

Two adjustments make the simulator and the CPU compile describe the same program: the
cases compile in float32 (the CPU backend carries bfloat16 collectives in float32, which
would double every compiled byte), and the simulator uses the CPU backend's collectives
(`HARDWARE["cpu"]`: its combiner, and reduce-scatters run as all-reduces) with the case
hardware's links and peaks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from automap_rl import tactics, workloads
from automap_rl.mesh import HARDWARE, Mesh, make_mesh, to_jax_mesh
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from automap_rl.simulator import collective_seconds
from automap_rl.simulator.tables import program_flops
from automap_rl.xla.hlo import CompiledStats
from automap_rl.xla.lower import lower
from automap_rl.xla.pipeline_lower import lower_pipelined
from automap_rl.xla.validate import DONATE_ARGNUMS, compiled_metrics, relative_error, simulated_metrics, trace_problem

__all__ = [
    "FULLSIZE_CASES", "PlanCheck", "Search", "agreement_by_case", "check_case", "check_pipelined_plan", "exploit_gaps",
    "implied_cost", "pairwise_agreement", "plot", "stage_permute_bytes", "summarize", "validation_case", "validation_mesh",
]

# Cases at published sizes on 8 and 64 devices: the demo's model on a 2x4 and an 8x8 mesh,
# then GPT, MoE, U-Net and SSM (a time-step scan inside the layer scan) cases of the task
# suite.
FULLSIZE_CASES = (
    "demo-gpt-2x4-h100", "demo-gpt-8x8-h100",
    "gpt-1.3b-2x4-h100", "moe-380m-2x4-a100-40g", "unet-ddpm-cifar10-4x2-a100-40g", "ssm-130m-4x2-a100-40g",
    "gpt-6.7b-8x8-h100", "moe-27b-8x8-a100-80g", "unet-sd-1.5-8x8-h100", "ssm-2.8b-8x8-h100",
)
_DEMO = {"demo-gpt-2x4-h100": "data=2,model=4", "demo-gpt-8x8-h100": "data=8,model=8"}
DEMO_WORKLOAD = "gpt:layers=8,d_model=1024"

# A search: (problem, seed) -> {plan name: decisions}, e.g. UCT and random at 2000.
Search = Callable[[Problem, int], Mapping[str, Sequence[Decision]]]


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
      pipelined plan, whose intermediates are not pinned).
    seconds: wall time of lowering and compiling.
    pipeline: a pipelined plan's `Pipeline.to_json`, else None.
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


def validation_case(name: str) -> workloads.Case:
  """The case called `name` (`FULLSIZE_CASES`, or any task-suite case) in float32."""
  if name in _DEMO:
    case = workloads.Case(name=name, workload=DEMO_WORKLOAD, family="gpt", size="demo", mesh=_DEMO[name],
                          hardware="h100", split="validate")
  else:
    known = {c.name: c for c in workloads.load_cases()}
    if name not in known:
      raise ValueError(f"Unknown validation case {name!r}; valid: {', '.join(FULLSIZE_CASES)} or a suite case.")
    case = known[name]
  return dataclasses.replace(case, workload=f"{case.workload},dtype=float32")


def validation_mesh(case: workloads.Case) -> Mesh:
  """The case's mesh and hardware, with the CPU backend's collective combiner,
  reduce-scatter (an all-reduce) and dense batch-grouped convolutions."""
  cpu = HARDWARE["cpu"]
  hardware = dataclasses.replace(HARDWARE[case.hardware], combine_threshold=cpu.combine_threshold,
                                 reduce_scatter=cpu.reduce_scatter, dense_batch_group_conv=cpu.dense_batch_group_conv)
  return make_mesh(case.mesh, hardware)


def _axes_mask(mesh: Mesh, axes: Sequence[str] | None) -> int:
  """Bit mask of mesh axes; every axis where XLA's groups match no set of axes."""
  names = mesh.axis_names if axes is None else axes
  return sum(1 << mesh.axis_names.index(a) for a in names)


@functools.cache
def _compute_dtype(problem: Problem) -> str:
  """The result dtype of the op with the most flops (the matmuls' dtype)."""
  program = problem.program
  flops = program_flops(program)
  heaviest = max(program.ops, key=lambda op: op.repeat * flops[op.id])
  return program.values[heaviest.results[0]].dtype if heaviest.results else "float32"


def implied_cost(problem: Problem, stats: CompiledStats) -> dict[str, float]:
  """The compiled module priced with the simulator's model (see the module docstring):
  `step_time = compute_time + comm_time`, seconds per step per device."""
  hardware = problem.mesh.hardware
  comm = sum(c.repeat * collective_seconds(problem.tables, c.kind, c.bytes, _axes_mask(problem.mesh, c.mesh_axes))
             for c in stats.collectives)
  peak = hardware.flops.get(_compute_dtype(problem), hardware.flops["float32"])
  compute = stats.flops / peak + stats.bytes_accessed / hardware.hbm_bandwidth
  return {"step_time": compute + comm, "compute_time": compute, "comm_time": comm}


def check_plan(case: str, problem: Problem, workload: workloads.Workload, plan: str, decisions: Sequence[Decision],
               searched: bool) -> PlanCheck:
  """Lowers and compiles one plan (abstract arguments) and measures both sides."""
  start = time.perf_counter()
  lowered = lower(problem, decisions, workload.step, workload.args, donate_argnums=DONATE_ARGNUMS)
  cost = problem.cost(decisions)
  simulated = {**simulated_metrics(problem, decisions), "step_time": float(cost.step_time), "fits": bool(cost.fits)}
  compiled = {**compiled_metrics(lowered.stats), **implied_cost(problem, lowered.stats)}
  return PlanCheck(case=case, devices=problem.mesh.num_devices, plan=plan, searched=searched,
                   decisions=tuple(map(str, decisions)), simulated=simulated, compiled=compiled,
                   differences=len(lowered.differences), seconds=time.perf_counter() - start)


def stage_permute_bytes(stats: CompiledStats, pipeline: Pipeline) -> float:
  """Per-device bytes of the compiled stage transfers: the collective-permutes over the
  pipeline's axis inside the microbatch loop (`repeat` > 1), times their trip counts."""
  return float(sum(c.repeat * c.bytes for c in stats.collectives
                   if c.kind == "collective-permute" and c.mesh_axes == (pipeline.axis,) and c.repeat > 1))


def check_pipelined_plan(case: str, problem: Problem, workload: workloads.Workload, plan: str,
                         decisions: Sequence[Decision], pipeline: Pipeline) -> PlanCheck:
  """Lowers and compiles one pipelined plan (`pipeline_lower.lower_pipelined`, abstract
  arguments) and measures both sides, the stage transfers included."""
  start = time.perf_counter()
  lowered = lower_pipelined(problem, decisions, pipeline, workload.loss_fn, workload.optimizer, workload.args,
                            to_jax_mesh(problem.mesh), DONATE_ARGNUMS, isolated=True)
  cost = problem.plan_cost(decisions, pipeline)
  simulated = {**simulated_metrics(problem, decisions, pipeline), "step_time": float(cost.step_time),
               "fits": bool(cost.fits), "stage_permute_bytes": float(cost.terms.permute_bytes)}
  compiled = {**compiled_metrics(lowered.stats), **implied_cost(problem, lowered.stats),
              "stage_permute_bytes": stage_permute_bytes(lowered.stats, pipeline)}
  return PlanCheck(case=case, devices=problem.mesh.num_devices, plan=plan, searched=False,
                   decisions=tuple(map(str, decisions)), simulated=simulated, compiled=compiled, differences=0,
                   seconds=time.perf_counter() - start, pipeline=pipeline.to_json())


def check_case(name: str, search: Search | None = None, seed: int = 0,
               report: Callable[[PlanCheck], None] = lambda check: None, pipelines: bool = False) -> list[PlanCheck]:
  """Every applicable expert plan of case `name` and the plans `search` finds; with
  `pipelines`, also every applicable pipelined expert plan, in GPipe order (those of one
  plan and pipeline once)."""
  case = validation_case(name)
  workload = case.make_workload(abstract=True)
  problem = trace_problem(workload, case.mesh, validation_mesh(case).hardware)
  checks = []
  plans = [(plan, decisions, False) for plan, decisions in tactics.applicable(problem).items()]
  if search is not None:
    plans += [(plan, list(decisions), True) for plan, decisions in search(problem, seed).items()]
  for plan, decisions, searched in plans:
    checks.append(check_plan(name, problem, workload, plan, decisions, searched))
    report(checks[-1])
  if pipelines:
    seen = []
    for plan, (decisions, pipeline) in tactics.applicable_pipelines(problem).items():
      pipeline = dataclasses.replace(pipeline, schedule="gpipe")
      if (decisions, pipeline) in seen:
        continue
      seen.append((decisions, pipeline))
      checks.append(check_pipelined_plan(name, problem, workload, plan, decisions, pipeline))
      report(checks[-1])
  return checks


# -- summary ------------------------------------------------------------------------------


def _ordered_pairs(checks: Sequence[PlanCheck]) -> tuple[int, int]:
  """(pairs the simulator orders as the compiled-implied step times do, pairs) over the
  pairs of plans of one case, pipelined and intra-op alike (pairs the compiled side ties
  within 0.1% left out)."""
  agree = total = 0
  for i, a in enumerate(checks):
    for b in checks[i + 1:]:
      if a.case != b.case:
        continue
      compiled = a.compiled["step_time"] - b.compiled["step_time"]
      if abs(compiled) <= 1e-3 * max(a.compiled["step_time"], b.compiled["step_time"]):
        continue
      total += 1
      agree += (a.simulated["step_time"] - b.simulated["step_time"]) * compiled > 0
  return agree, total


def pairwise_agreement(checks: Sequence[PlanCheck]) -> float:
  """Over pairs of plans of one case, the fraction the simulator orders as the
  compiled-implied costs do (`_ordered_pairs`); nan without pairs."""
  agree, total = _ordered_pairs(checks)
  return agree / total if total else math.nan


def agreement_by_case(checks: Sequence[PlanCheck]) -> dict[str, float]:
  """`pairwise_agreement` of each case's plans, by case name."""
  return {name: pairwise_agreement([c for c in checks if c.case == name]) for name in dict.fromkeys(c.case for c in checks)}


def exploit_gaps(checks: Sequence[PlanCheck]) -> list[dict[str, Any]]:
  """Per searched plan: its simulated ratio to the best expert (`tactics.best_expert`
  of the simulator's scores), its compiled-implied ratio to the same expert, and the gap,
  compiled-implied minus simulated ratio: positive where the simulator flatters the
  searched plan (the search exploited the simulator), negative where it undersells it."""
  gaps = []
  for name in dict.fromkeys(c.case for c in checks):
    experts = {c.plan: c for c in checks if c.case == name and not c.searched}
    if not experts:
      continue
    best = experts[tactics.best_expert({n: tactics.Score(c.simulated["step_time"], c.simulated["peak_memory"],
                                                        c.simulated["fits"]) for n, c in experts.items()})]
    for found in (c for c in checks if c.case == name and c.searched):
      simulated = found.simulated["step_time"] / best.simulated["step_time"]
      compiled = found.compiled["step_time"] / best.compiled["step_time"]
      gaps.append({"case": name, "plan": found.plan, "best_expert": best.plan, "simulated_ratio": simulated,
                   "compiled_ratio": compiled, "gap": compiled - simulated})
  return gaps


def summarize(checks: Sequence[PlanCheck]) -> dict[str, float]:
  """The acceptance figures over all plans of all cases."""
  median = lambda xs: float(np.median(xs)) if len(xs) else math.nan
  error = lambda key: median([relative_error(c.simulated[key], c.compiled[key]) for c in checks])
  count_ratio = []
  for c in checks:
    simulated, compiled = sum(c.simulated["comm_count_by_kind"].values()), sum(c.compiled["comm_count_by_kind"].values())
    if simulated or compiled:
      count_ratio.append(max(simulated, compiled) / max(min(simulated, compiled), 1e-9))
  gaps = [g["gap"] for g in exploit_gaps(checks)]
  pipelined = [c for c in checks if c.pipeline is not None]
  return {
      "plans": len(checks),
      "realized_fraction": float(np.mean([c.differences == 0 for c in checks])) if checks else math.nan,
      "comm_bytes_median_rel_error": error("comm_bytes"),
      "collective_counts_within_2x_fraction": float(np.mean([r <= 2.0 for r in count_ratio])) if count_ratio else math.nan,
      "flops_median_rel_error": error("flops"),
      "memory_median_rel_error": error("peak_memory"),
      "stage_permute_bytes_median_rel_error": median([
          relative_error(c.simulated["stage_permute_bytes"], c.compiled["stage_permute_bytes"]) for c in pipelined]),
      "pairwise_rank_agreement": pairwise_agreement(checks),
      "exploit_gap_median": median(gaps),
      "exploit_gap_median_abs": median(np.abs(gaps)),
  }


def plot(checks: Sequence[PlanCheck], path: str) -> None:
  """Four log-log panels of simulated against compiled: comm bytes, flops and peak memory
  per device, and each plan's step time over its case's best expert (the simulator's
  ratio against the compiled-implied one); searched plans drawn as crosses."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  best = {g["case"]: g["best_expert"] for g in exploit_gaps(checks)}
  expert = {(c.case, c.plan): c for c in checks if not c.searched}
  panels = (("comm_bytes", "comm bytes / device"), ("flops", "flops / device"), ("peak_memory", "peak memory / device"),
            ("ratio", "step time / best expert's"))
  fig, axes = plt.subplots(1, len(panels), figsize=(20, 5))
  for ax, (key, title) in zip(axes, panels):
    points = []
    for c in checks:
      if key == "ratio":
        reference = expert.get((c.case, best.get(c.case, "")))
        if reference is None:
          continue
        x = c.compiled["step_time"] / reference.compiled["step_time"]
        y = c.simulated["step_time"] / reference.simulated["step_time"]
      else:
        x, y = c.compiled[key], c.simulated[key]
      if x > 0 and y > 0:
        points.append((x, y, c.searched))
    for searched, marker, label in ((False, "o", "expert plans"), (True, "x", "searched plans")):
      mine = [(x, y) for x, y, s in points if s == searched]
      if mine:
        ax.scatter(*zip(*mine), marker=marker, s=24, label=label)
    values = [v for x, y, _ in points for v in (x, y)] or [1.0, 10.0]
    line = np.geomspace(min(values) / 1.5, max(values) * 1.5, 2)
    ax.plot(line, line, "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="compiled (XLA)", ylabel="simulator", title=title)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
