"""The `alpa` agent on one task-suite case: its pipeline, step time and search seconds beside
the best expert's and the pipelined experts'; `python -m experiments.bench_alpa [CASE]`
(default gpt-39b-4x2x8-h100-remat)."""

from __future__ import annotations

import sys
import time

from agents import alpa
from agents.selfplay import case_problem
from automap_rl import tactics
from automap_rl.workloads.suite import load_cases


def main(name: str = "gpt-39b-4x2x8-h100-remat") -> None:
  case = {c.name: c for c in load_cases()}[name]
  start = time.perf_counter()
  problem = case_problem(case)
  built = time.perf_counter()
  result = alpa.search(problem)
  searched = time.perf_counter()
  expert = tactics.best_expert_plan(problem)
  pipeline = result.pipeline
  print(f"{name}: problem built in {built - start:.1f}s; alpa searched {result.simulations} plans in "
        f"{searched - built:.1f}s (stopped by: {result.stopped_by or 'nothing, the whole space'})")
  if pipeline is None:
    print("alpa: no pipeline")
  else:
    layers = pipeline.layers_per_chunk or "even"
    print(f"alpa: stage axis {pipeline.axis!r}, S={pipeline.stages}, M={pipeline.microbatches}, {pipeline.schedule}"
          + (f" V={pipeline.chunks}" if pipeline.chunks > 1 else "") + f", layers per chunk {layers}")
  print(f"alpa: {len(result.decisions)} decisions inside the stages: {', '.join(map(str, result.decisions))}")
  print(f"alpa step time {result.step_time:.4f}s (fits: {bool(result.cost.fits)}); best expert {expert.name} "
        f"{float(expert.cost.step_time):.4f}s (fits: {expert.fits}); ratio {result.step_time / float(expert.cost.step_time):.3f}")
  for tactic, (decisions, pipeline) in tactics.applicable_pipelines(problem).items():
    cost = problem.plan_cost(decisions, pipeline)
    print(f"{tactic} ({pipeline}): {float(cost.step_time):.4f}s (fits: {bool(cost.fits)})")


if __name__ == "__main__":
  main(*sys.argv[1:])
