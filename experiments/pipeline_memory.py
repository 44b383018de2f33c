"""Compiled peak memory and stage transfers of one model's GPipe and 1F1B plans.

Compiles (CPU, abstract arguments, nothing allocated) the `megatron_3d` plan of a workload
on a mesh with a `stage` axis, as GPipe, 1F1B or interleaved (2 chunks) with M microbatches, and
prints per
schedule the compiled peak memory per device (parameters and optimizer state donated, as
`Plan.jit` donates them) and the collective-permute bytes (loop trip counts included). Run it in its
own process: it sets XLA's host device count.

  python experiments/pipeline_memory.py --workload gpt:size=6.7b,batch=64,dtype=float32 \
    --mesh stage=4,data=4,model=4 --microbatches 16
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", required=True)
  parser.add_argument("--mesh", required=True)
  parser.add_argument("--microbatches", type=int, default=16)
  parser.add_argument("--schedules", default="gpipe,1f1b")
  args = parser.parse_args(argv)
  devices = math.prod(int(part.split("=")[1]) for part in args.mesh.split(","))
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  from automap_rl import tactics, workloads
  from automap_rl.mesh import make_mesh, to_jax_mesh
  from automap_rl.pipeline import Pipeline
  from automap_rl.problem import Problem
  from automap_rl.xla.pipeline_lower import lower_pipelined

  w = workloads.make_workload(args.workload, abstract=True)
  problem = Problem.build(w.trace(), make_mesh(args.mesh, "h100"))
  decisions, pipeline = tactics.megatron_3d(problem)
  for schedule in args.schedules.split(","):
    chunks = 2 if schedule == "interleaved" else 1
    chosen = Pipeline(pipeline.axis, pipeline.stages, args.microbatches, schedule, chunks)
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
    )
    permutes = sum(
      c.repeat * c.bytes for c in lowered.stats.collectives if c.kind == "collective-permute"
    )
    print(
      f"{schedule}: peak {lowered.stats.peak_bytes / 2**30:.2f} GiB/device, "
      f"collective-permute {permutes / 2**30:.3f} GiB/device, "
      f"compiled in {time.perf_counter() - start:.0f} s",
      flush=True,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
