"""The plans this checkout's searches end at against another checkout's, for one seed.

Runs each side in a process of its own (its checkout first on the path): on every case of
a split, learned+gumbel@64 (the shipped policy), uniform Gumbel@64, UCT and random search
at `--budget` simulations, all with `--seed`. Prints, per case, the methods whose plans
differ, then how many plans are the same and how many objectives are equal to the last
bit, and the largest relative difference of equal plans' objectives. The other checkout
needs `agents.learned.search`, `agents.gumbel.search`, `agents.registry.run_agent` and
`agents.selfplay.case_problem`, as every commit since 2026-11-20 has them.

  git worktree add /tmp/before REV
  python experiments/plans_against.py --other /tmp/before --split external
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SPLITS = ("smoke", "train", "test", "external")


def methods(budget: int) -> tuple[str, ...]:
  return ("learned+gumbel@64", "gumbel@64", f"mcts@{budget}", f"random@{budget}")


def plans(split: str, seed: int, budget: int) -> list[dict]:
  """Each case's plan (its decisions as text) and objective by method, in this process."""
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from agents import gumbel, learned, selfplay
  from agents.learned import LearnedConfig
  from agents.registry import run_agent
  from automap_rl.workloads.suite import load_cases

  policy = LearnedConfig()
  uniform = gumbel.GumbelConfig(gumbel=policy.gumbel)
  searches = dict(
    zip(
      methods(budget),
      (
        lambda p: learned.search(p, policy, seed, 64),
        lambda p: gumbel.search(p, uniform, seed, 64),
        lambda p: run_agent("mcts", p, seed, budget),
        lambda p: run_agent("random", p, seed, budget),
      ),
    )
  )
  rows = []
  cases = load_cases(split)
  for i, case in enumerate(cases):
    problem = selfplay.case_problem(case)
    row = {"case": case.name}
    for name, search in searches.items():
      result = search(problem)
      row[name] = {
        "decisions": [str(d) for d in result.decisions],
        "objective": float(result.objective),
      }
    rows.append(row)
    print(f"  {i + 1}/{len(cases)} {case.name}", file=sys.stderr, flush=True)
  return rows


def run_side(checkout: str, args: argparse.Namespace) -> dict[str, dict]:
  """`plans` in a child process with `checkout` first on its path, by case."""
  print(f"{checkout}:", file=sys.stderr, flush=True)
  env = dict(os.environ, PYTHONPATH=checkout, AUTOMAP_RL_COMPILATION_CACHE="0")
  command = [sys.executable, os.path.abspath(__file__), "--side", "--split", args.split]
  command += ["--seed", str(args.seed), "--budget", str(args.budget)]
  done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, cwd=checkout)
  if done.returncode:
    raise SystemExit(f"the searches in {checkout} failed (exit {done.returncode})")
  return {row["case"]: row for row in json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--other", help="the other checkout's root")
  parser.add_argument("--split", choices=SPLITS, default="external")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--budget", type=int, default=300, help="UCT's and random search's")
  parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.budget < 1:
    print(f"error: --budget {args.budget} must be at least 1", file=sys.stderr)
    return 2
  if args.side:
    print(json.dumps(plans(args.split, args.seed, args.budget)))
    return 0
  if not args.other or not os.path.isdir(os.path.join(args.other, "experiments")):
    print(f"error: --other {args.other!r} is not a checkout of this project", file=sys.stderr)
    return 2
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  this, other = run_side(here, args), run_side(args.other, args)
  same, equal = dict.fromkeys(methods(args.budget), 0), dict.fromkeys(methods(args.budget), 0)
  largest = 0.0  # Relative difference of equal plans' objectives.
  for case, row in this.items():
    differ = []
    for method in same:
      a, b = row[method], other[case][method]
      if a["decisions"] != b["decisions"]:
        differ.append(f"{method} {a['objective']:.6g} (other {b['objective']:.6g})")
        continue
      same[method] += 1
      equal[method] += a["objective"] == b["objective"]
      largest = max(largest, abs(a["objective"] - b["objective"]) / b["objective"])
    print(f"{case}: {'; '.join(differ) if differ else 'same plans'}")
  for method in same:
    print(f"{method}: same plan {same[method]} of {len(this)}, objectives equal {equal[method]}")
  print(f"equal plans' objectives: largest relative difference {largest:.2g}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
