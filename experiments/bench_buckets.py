"""`automap-rl bench buckets`: how the task suite's problems share compiles, and first calls.

Every jitted function of a search takes its problem's tables as arguments, padded to
buckets (`automap_rl.buckets`): problems whose padded tables have one shape share each
compile. For each split this counts the buckets of the learned agent's tables
(`agents.learned.searched_env`, `Problem.bucketed`) and the padding waste (padded over
real entries, per case).

With `--first-calls SPLIT`, each of that split's cases is timed twice, learned+gumbel@N:
with nothing compiled in the process (`agents.base.release`; the persistent compilation
cache as configured, so run with `--compilation-cache off` for an empty one), and after
one call on another problem of its bucket (a case of the suite with another workload, or
else its own workload on a mesh of other axis sizes, `reshaped_meshes`): the first call on a new
model once its bucket is compiled.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from agents import base, learned
from agents.learned import LearnedConfig
from automap_rl import buckets, compilation_cache
from automap_rl.problem import Problem
from automap_rl.workloads.suite import SPLITS, Case, load_cases
from envs import Env
from experiments.cli import write_json
from experiments.options import JsonPath


@dataclasses.dataclass(frozen=True)
class BucketBenchConfig:
  """Buckets of the task suite and first calls of the learned search.

  Attributes:
    splits: the splits whose buckets are counted (and where partners are found).
    first_calls: the splits whose cases' first calls are timed (none: buckets only).
    cases: only these cases' first calls (none: every case of `first_calls`).
    budget: the learned search's simulations.
    seed: the search's seed.
    json: where to write the figures.
  """

  splits: tuple[str, ...] = SPLITS
  first_calls: tuple[str, ...] = ()
  cases: tuple[str, ...] = ()
  budget: int = 64
  seed: int = 0
  json: JsonPath = None


def _check(config: BucketBenchConfig) -> None:
  for split in (*config.splits, *config.first_calls):
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
  unknown = set(config.cases) - {c.name for split in config.first_calls for c in load_cases(split)}
  if unknown:
    raise ValueError(f"--cases not in the --first-calls splits: {', '.join(sorted(unknown))}")
  if config.budget < 1:
    raise ValueError(f"--budget must be at least 1, got {config.budget}")


def reshaped_meshes(case: Case) -> list[str]:
  """The case's mesh spec with other axis sizes of the same product (powers of two, at
  least 2 each; the names kept in order), nearest first: its axis sizes permuted, then
  with a factor of 2 moved between two axes, and so on."""
  names, sizes = zip(*((n, int(s)) for n, s in (item.split("=") for item in case.mesh.split(","))))
  total = math.prod(sizes)
  choices = [2**k for k in range(1, total.bit_length())]
  out = {
    shape
    for shape in itertools.product(choices, repeat=len(names))
    if math.prod(shape) == total and shape != sizes
  }
  distance = lambda shape: (
    sorted(shape) != sorted(sizes),
    sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(shape, sizes)),
    shape,
  )
  return [",".join(f"{n}={s}" for n, s in zip(names, shape)) for shape in sorted(out, key=distance)]


def _problem(case: Case) -> Problem:
  """The case's problem, built anew (not the suite's cached one: nothing of it is kept)."""
  return Problem.build(case.make_workload(abstract=True).trace(), case.make_mesh())


def _key(problem: Problem) -> tuple:
  return buckets.key(learned.searched_env(problem).tables, problem.bucketed)


def _waste(problem: Problem) -> float:
  env = learned.searched_env(problem)
  exact = Env.build(problem, env.config).tables
  return buckets.waste((exact, problem.owners, problem.tables), (env.tables, problem.bucketed))


def _timed(problem: Problem, config: BucketBenchConfig) -> tuple[float, float]:
  start = time.perf_counter()
  result = learned.search(problem, LearnedConfig(), config.seed, config.budget)
  return time.perf_counter() - start, float(result.objective)


def run(config: BucketBenchConfig) -> dict[str, Any]:
  _check(config)
  cases = [c for split in config.splits for c in load_cases(split)]
  keys: dict[str, tuple] = {}
  rows: dict[str, dict[str, Any]] = {}
  for case in tqdm(cases, desc="bucketing the suite's cases", leave=False):
    problem = _problem(case)
    keys[case.name] = _key(problem)
    rows[case.name] = {"split": case.split, "waste": _waste(problem)}
    base.release()
  ids = {k: i for i, k in enumerate(dict.fromkeys(keys.values()))}
  for name in rows:
    rows[name]["bucket"] = ids[keys[name]]
  summary = {
    split: {
      "cases": len(members),
      "buckets": len({rows[n]["bucket"] for n in members}),
      "waste_median": float(np.median([rows[n]["waste"] for n in members])),
      "waste_max": float(max(rows[n]["waste"] for n in members)),
    }
    for split in config.splits
    for members in [[n for n in rows if rows[n]["split"] == split]]
  }
  for split, s in summary.items():
    print(
      f"{split}: {s['cases']} cases in {s['buckets']} buckets; padding waste median "
      f"{s['waste_median']:.2f}, largest {s['waste_max']:.2f}"
    )
  by_name = {c.name: c for c in load_cases()}
  firsts = [
    c
    for split in config.first_calls
    for c in load_cases(split)
    if not config.cases or c.name in config.cases
  ]
  cache = compilation_cache.directory()
  if firsts:
    print(f"first calls, learned+gumbel@{config.budget}; persistent cache: {cache or 'off'}")
  for case in tqdm(firsts, desc="first calls", leave=False):
    rows.setdefault(case.name, {"split": case.split})
    rows[case.name].update(_first_calls(case, keys, by_name, config))
    row = rows[case.name]
    print(
      f"  {case.name}: nothing compiled {row['cold_s']:.2f} s; after {row['partner']}: "
      + (f"{row['warm_s']:.2f} s" if row["warm_s"] is not None else "no partner in its bucket")
    )
  out: dict[str, Any] = {"summary": summary, "cases": rows, "cache": cache}
  if firsts:
    cold = [rows[c.name]["cold_s"] for c in firsts]
    warm = [rows[c.name]["warm_s"] for c in firsts if rows[c.name]["warm_s"] is not None]
    out["first_calls"] = {
      "cold_median_s": float(np.median(cold)),
      "warm_median_s": float(np.median(warm)) if warm else None,
      "with_partner": len(warm),
      "cases": len(firsts),
    }
    print(
      f"median: nothing compiled {np.median(cold):.2f} s; after a problem of its bucket "
      + (f"{np.median(warm):.2f} s ({len(warm)} of {len(firsts)} cases)" if warm else "none")
    )
  write_json(config.json, out)
  return out


def _partner(
  case: Case, keys: dict[str, tuple], cases: dict[str, Case]
) -> tuple[str, Problem] | None:
  """Another problem of the case's bucket: a suite case with another workload, else the
  case's workload on a reshaped mesh (`reshaped_meshes`)."""
  own = keys.get(case.name)
  for name, key in keys.items():
    other = cases.get(name)
    if key == own and other is not None and other.workload != case.workload:
      return name, _problem(other)
  for mesh in reshaped_meshes(case):
    variant = dataclasses.replace(case, name=f"{case.workload}@{mesh}", mesh=mesh)
    problem = _problem(variant)
    if own is None or _key(problem) == own:
      return variant.name, problem
  return None


def _first_calls(
  case: Case, keys: dict[str, tuple], cases: dict[str, Case], config: BucketBenchConfig
) -> dict[str, Any]:
  problem = _problem(case)
  base.release()
  cold_s, objective = _timed(problem, config)
  base.release()
  partner = _partner(case, keys, cases)
  warm_s = None
  if partner is not None:
    _timed(partner[1], config)
    fresh = _problem(case)  # Not yet seen: nothing of it cached.
    warm_s, warm_objective = _timed(fresh, config)
    if warm_objective != objective:
      print(f"  {case.name}: the plan differs after the partner ({warm_objective} vs {objective})")
  base.release()
  return {
    "cold_s": cold_s,
    "warm_s": warm_s,
    "partner": partner[0] if partner else None,
    "objective": objective,
  }
