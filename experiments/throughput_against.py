"""Batched simulator and environment throughput of this checkout against another one's.

Runs, alternating, one process per side and pair: this checkout on bucketed tables (padded,
passed as arguments: how its searches run them) and the other checkout on exact tables
(compiled in as constants: how each problem compiled before buckets). Each process builds
the problem, compiles, and measures batched simulator evaluations and environment steps
(terminal, then shaped rewards) per second; the machine's slow and fast spells fall on both
sides of a pair alike. Prints each pair and the median ratios, this over other. The other
checkout needs `experiments.bench_cmd` (`build_problem`, `random_plans`,
`calls_per_second`) and `envs.bench.bench_env`, as every commit since 2026-11-27 has them.

  git worktree add /tmp/before REV
  python experiments/throughput_against.py --other /tmp/before --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SIDES = ("bucketed", "exact")  # This checkout, the other one.
FIGURES = ("simulator", "env_terminal", "env_shaped")


def measure(side: str, workload: str, mesh: str, batch: int, seconds: float) -> dict[str, float]:
  """Evaluations and steps per second on one side, in this process (its `sys.path` picks the
  checkout)."""
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax

  from envs.config import EnvConfig
  from experiments import bench_cmd

  problem = bench_cmd.build_problem(workload, mesh, "h100")
  rates = {}
  if side == "bucketed":
    from envs.bench import batched_rate

    config = bench_cmd.SimulatorBenchConfig(workload=workload, mesh=mesh, batch=batch)
    rates["simulator"] = bench_cmd.batched_simulator(problem, config, True)(seconds)
    for reward in ("terminal", "shaped"):
      rates[f"env_{reward}"] = batched_rate(problem, batch, EnvConfig(reward=reward), True)(seconds)
  else:
    from envs.bench import bench_env

    classes, axes = bench_cmd.random_plans(problem, jax.random.key(0), batch, 16)
    batched = jax.jit(jax.vmap(problem.evaluate))
    calls = bench_cmd.calls_per_second(lambda: batched(classes, axes), seconds)
    rates["simulator"] = batch * calls
    for reward in ("terminal", "shaped"):
      env = bench_env(problem, batch, seconds, EnvConfig(reward=reward), single=False)
      rates[f"env_{reward}"] = env["steps_per_second_batched"]
  return rates


def run_side(checkout: str, side: str, args: argparse.Namespace) -> dict[str, float]:
  """`measure` in a child process with `checkout` first on its path."""
  env = dict(os.environ, PYTHONPATH=checkout, AUTOMAP_RL_COMPILATION_CACHE="0")
  command = [sys.executable, os.path.abspath(__file__), "--side", side]
  command += ["--workload", args.workload, "--mesh", args.mesh]
  command += ["--batch", str(args.batch), "--seconds", str(args.seconds)]
  done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=checkout)
  if done.returncode:
    last = done.stderr.strip().splitlines()[-1:]
    raise SystemExit(f"the {side} side in {checkout} failed: {' '.join(last)}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--other", help="the other checkout's root")
  parser.add_argument("--pairs", type=int, default=3)
  parser.add_argument("--workload", default="gpt:layers=12")
  parser.add_argument("--mesh", default="data=2,model=4")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--seconds", type=float, default=3.0)
  parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.side:
    print(json.dumps(measure(args.side, args.workload, args.mesh, args.batch, args.seconds)))
    return 0
  if not args.other or not os.path.isdir(os.path.join(args.other, "experiments")):
    print(f"error: --other {args.other!r} is not a checkout of this project", file=sys.stderr)
    return 2
  if args.pairs < 1:
    print(f"error: --pairs {args.pairs} must be at least 1", file=sys.stderr)
    return 2
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ratios = {figure: [] for figure in FIGURES}
  for pair in range(args.pairs):
    this, other = run_side(here, "bucketed", args), run_side(args.other, "exact", args)
    for figure in FIGURES:
      ratios[figure].append(this[figure] / other[figure])
    cells = ", ".join(f"{f} {this[f]:,.0f} / {other[f]:,.0f}" for f in FIGURES)
    print(f"pair {pair + 1}/{args.pairs}: {cells}", flush=True)
  for figure, values in ratios.items():
    low, high = min(values), max(values)
    print(f"{figure}: this / other {statistics.median(values):.3f} ({low:.3f}-{high:.3f})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
