"""Compiled peak memory and stage transfers of one model's pipelined plans, beside the simulator's.

Compiles (CPU, abstract arguments, nothing allocated) the `megatron_3d` plan of a workload
on a mesh with a `stage` axis, as GPipe, 1F1B or interleaved (2 chunks) with M microbatches, and
prints per schedule the compiled peak memory per device (parameters and optimizer state
donated, as `Plan.jit` donates them) and the stage transfers' collective-permute bytes per
device (`fullsize.stage_permute_bytes`: the loop's permutes over the stage axis, trip counts
included), each beside the simulator's (`Problem.plan_cost`: the largest stage's peak,
`PipelineTerms.permute_bytes`) and their ratio, then the 1F1B / GPipe ratio of the compiled
peaks. The mesh is priced as XLA:CPU compiles it (`fullsize.validation_mesh`'s hardware). Run
it in its own process: it sets XLA's host device count.

  python experiments/pipeline_memory.py --workload gpt:size=6.7b,batch=64,dtype=float32 \
    --mesh stage=4,data=4,model=4 --microbatches 16
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

GIB = 2**30


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", required=True)
  parser.add_argument("--mesh", required=True)
  parser.add_argument("--microbatches", type=int, default=16)
  parser.add_argument("--schedules", default="gpipe,1f1b")
  parser.add_argument("--hardware", default="h100")
  args = parser.parse_args(argv)
  devices = math.prod(int(part.split("=")[1]) for part in args.mesh.split(","))
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  from automap_rl import tactics, workloads
  from automap_rl.hardware import HARDWARE
  from automap_rl.mesh import make_mesh, to_jax_mesh
  from automap_rl.pipeline import Pipeline
  from automap_rl.problem import Problem
  from automap_rl.xla.fullsize import stage_permute_bytes
  from automap_rl.xla.pipeline_lower import lower_pipelined

  w = workloads.make_workload(args.workload, abstract=True)
  hardware = HARDWARE[args.hardware].compiled_by(HARDWARE["cpu"])
  problem = Problem.build(w.trace(), make_mesh(args.mesh, hardware))
  decisions, pipeline = tactics.megatron_3d(problem)
  peaks = {}
  for schedule in args.schedules.split(","):
    chunks = 2 if schedule == "interleaved" else 1
    chosen = Pipeline(pipeline.axis, pipeline.stages, args.microbatches, schedule, chunks)
    cost = problem.plan_cost(decisions, chosen)
    start = time.perf_counter()
    lowered = lower_pipelined(
      problem,
      decisions,
      chosen,
      w.loss_fn,
      w.optimizer,
      w.args,
      to_jax_mesh(problem.mesh),
      problem.program.donate_argnums,
      executable=False,
    )
    peaks[schedule] = peak = lowered.stats.peak_bytes
    permutes = stage_permute_bytes(lowered.stats, chosen)
    simulated_peak, simulated_permutes = float(cost.peak_memory), float(cost.terms.permute_bytes)
    print(
      f"{schedule}: peak {peak / GIB:.2f} GiB/device (simulated {simulated_peak / GIB:.2f}, "
      f"compiled / simulated {peak / simulated_peak:.3f}); stage permutes "
      f"{permutes / GIB:.3f} GiB/device (simulated {simulated_permutes / GIB:.3f}, "
      f"{permutes / simulated_permutes:.3f}); compiled in {time.perf_counter() - start:.0f} s",
      flush=True,
    )
  if "1f1b" in peaks and "gpipe" in peaks:
    print(f"1f1b / gpipe compiled peak: {peaks['1f1b'] / peaks['gpipe']:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
