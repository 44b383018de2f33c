"""`automap-rl validate --suite quick|full|fullsize`: the simulator against XLA compiles;
`automap-rl validate --random N`: N random plans per model, numerics checked
(`--pipelines`: pipelined plans, random decisions inside a random pipeline: GPipe, 1F1B,
interleaved or gradient accumulation).

`quick` and `full` lower, run and check the numerics of expert and random plans on small
zoo models; `fullsize` compiles (without running) expert and searched plans of models at
published sizes on 8 and 64 devices and asks whether the simulator ranks plans as the
compiled modules do (`automap_rl.xla.fullsize`)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Literal

from experiments.cli import write_json
from experiments.options import JsonPath, PlotPath


@dataclasses.dataclass(frozen=True)
class ValidateConfig:
  """What to validate.

  Attributes:
    suite: `quick` (small workloads, a few minutes on CPU), `full` (the zoo's defaults)
      or `fullsize` (compile-only at published sizes, 8 and 64 devices; about half a
      minute per plan on 2 CPU cores).
    json: where to write `{cases, summary}`.
    plot: where to draw the simulated-vs-compiled scatter plots (PNG).
    cases: for `fullsize`, the cases to check (default: all of `FULLSIZE_CASES`).
    sampled: for `fullsize`, the sampled run over every model family
      (`fullsize.SAMPLED_CASES`: two suite cases of each suite family and the zoo families
      the suite leaves out) instead of `cases`.
    draw: for `fullsize`, instead of `cases`, this many suite cases no full-size check
      covers, drawn at random one family at a time with `seed` (`fullsize_draw.drawn_cases`;
      the command prints them first).
    agents: for `fullsize`, the search agents whose plans are checked beside the experts,
      each `NAME` or `NAME@BUDGET` (a searched pipeline is checked as its schedule).
    experts: for `fullsize`, check the cases' expert plans; `--no-experts`: the searched
      plans alone (their exploit gaps and rankings come from `--merge` with a run of the
      experts of the same cases).
    budget: for `fullsize`, each search's simulator evaluations (where its agent names none).
    seed: for `fullsize`, the searches' seed (and the draw's, with `draw`); for `random`, the
      seed of the workloads' parameters and of the random plans.
    resume: for `fullsize`, keep the checks of the cases already in `--json` (an earlier run
      of the same command, stopped or finished) and check only the others; the file is
      rewritten after every case, so a stopped run loses at most the case it was on.
    merge: for `fullsize`, no compiles: the report of the checks in these `--json` files
      (pieces of one run made apart); a plan of a case checked in several, the last
      file's check.
    resimulate: with `merge`, the merged plans priced again by this checkout's simulator
      against their stored compiled figures (which do not depend on it): a simulator
      change re-measured by tracing the cases, without compiling.
    recompile: with `merge`, the merged plans (those of `cases`, where given) lowered,
      compiled and simulated again by this checkout, without searching for them again: a
      change of the lowering or of the compiled side's measures re-measured; `--json` is
      rewritten after every case, and `--resume` keeps the cases already there.
    random: instead of a suite, N random plans per model (on `data=8` and
      `data=2,model=4` in turn), each compiled in a child process first (an XLA abort is a
      failed plan, not the end of the command), run and checked against the unpartitioned
      step; 0: run `suite`.
    models: with `random`, the workloads; default every family at small size (with
      `pipelines`: `validate.PIPELINE_MODELS`, small models with layer stacks).
    workers: with `random`, processes running plans side by side (the cases do not
      depend on it; each process holds its own jax and compiling child).
    pipelines: with `fullsize`, the cases' pipelined expert plans too (run as their schedule, no
      searches), ranked with the intra-op ones, their stage transfers (collective-permute
      bytes) set beside the simulator's; with `random`, every plan pipelined: a random
      pipeline (a layer stack over a random mesh axis whose size divides its layers, one
      stage per device of the axis or one stage (gradient accumulation), 4 or 8
      microbatches, a random schedule: GPipe, 1F1B, interleaved with 2 chunks) with random
      decisions inside, on
      `validate.PIPELINE_MESHES`; the pipelined step of the workload's loss function and
      optimizer is compiled, run and checked.
  """

  suite: Literal["quick", "full", "fullsize"] = "quick"
  json: JsonPath = None
  plot: PlotPath = None
  cases: tuple[str, ...] = ()
  sampled: bool = False
  draw: int = 0
  agents: tuple[str, ...] = ("mcts", "random")
  experts: bool = True
  budget: int = 2000
  seed: int = 0
  resume: bool = False
  merge: tuple[str, ...] = ()
  resimulate: bool = False
  recompile: bool = False
  random: int = 0
  models: tuple[str, ...] = ()
  workers: int = 1
  pipelines: bool = False


def _mb(x: float) -> str:
  return f"{x / 1e6:9.3f}"


def _schedule(pipeline: dict) -> str:
  """A pipeline's JSON as a few words: its schedule (or accumulation), axis and counts, and
  whether its weights are gathered once a step."""
  once = ", weights gathered once" if pipeline.get("gather_weights_once") else ""
  if pipeline["stages"] == 1:
    return f"accumulation of {pipeline['microbatches']} microbatches{once}"
  chunks = f", {pipeline['chunks']} chunks" if pipeline.get("chunks", 1) > 1 else ""
  return (
    f"{pipeline['schedule']} over {pipeline['axis']!r}: {pipeline['stages']} stages{chunks}, "
    f"{pipeline['microbatches']} microbatches{once}"
  )


def _row(case) -> str:
  s, c = case.simulated, case.compiled
  pipeline = "" if case.pipeline is None else f"  ({_schedule(case.pipeline)})"
  if case.lowering_error is not None:
    return (
      f"{case.model.split(':')[0]:<7} {case.mesh:<15} {case.plan:<14} LOWERING ERROR "
      f"{case.seconds:6.1f}s"
      f"{pipeline}"
    )
  flag = (
    ("" if case.numerics_ok else "  NUMERICS MISMATCH")
    + (f"  {len(case.differences)} SHARDING DIFFERENCES" if case.differences else "")
    + ("" if case.reference == "float64" else "  (float32 reference)")
  )
  return (
    f"{case.model.split(':')[0]:<7} {case.mesh:<15} {case.plan:<14} {_mb(s['comm_bytes'])} "
    f"{_mb(c['comm_bytes'])} "
    f"{s['flops'] / 1e6:10.2f} {c['flops'] / 1e6:10.2f} {_mb(s['peak_memory'])} "
    f"{_mb(c['peak_memory'])} "
    f"{case.seconds:6.1f}s{flag}{pipeline}"
  )


HEADER = (
  f"{'model':<7} {'mesh':<15} {'plan':<14} {'comm sim':>9} {'comm xla':>9} {'Mflop sim':>10} "
  f"{'Mflop xla':>10} {'mem sim':>9} {'mem xla':>9}   (MB per device)"
)


def _summary_text(summary: dict[str, float]) -> str:
  fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"
  return "\n".join(f"  {k:<30} {fmt(v)}" for k, v in summary.items())


def run(config: ValidateConfig) -> dict[str, Any]:
  if config.suite == "fullsize":
    return run_fullsize(config)
  from automap_rl import workloads  # Imported late: jax must see the CLI's XLA_FLAGS.
  from automap_rl.xla import validate

  if config.suite not in validate.SUITES:
    raise ValueError(f"Unknown suite {config.suite!r}; valid suites: {sorted(validate.SUITES)}.")
  if config.random < 0 or ((config.models or config.pipelines) and not config.random):
    needs = (
      " (--models needs --random)"
      if config.models
      else " (--pipelines needs --random)"
      if config.pipelines
      else ""
    )
    raise ValueError(f"--random {config.random}: give a positive number of plans per model{needs}.")
  for spec in config.models:
    workloads.canonical_spec(spec)  # A bad spec: one line naming it, before any work.
  start = time.perf_counter()
  print(HEADER)
  report = lambda case: print(_row(case), flush=True)
  if config.random:
    random_suite = validate.RandomSuite(
      models=config.models or None,
      plans=config.random,
      seed=config.seed,
      workers=config.workers,
      pipelines=config.pipelines,
    )
    cases = validate.run_random(random_suite, report)
  else:
    cases = validate.run_suite(validate.SUITES[config.suite], report)
  summary = validate.summarize_cases(cases)
  print(f"\n{len(cases)} cases in {time.perf_counter() - start:.0f}s\n{_summary_text(summary)}")
  for case in cases:
    if case.lowering_error is not None:
      print(
        f"LOWERING ERROR {case.model} {case.mesh} {case.plan} ({len(case.decisions)} decisions): "
        f"{case.lowering_error}"
      )
    elif not case.numerics_ok:
      print(
        f"NUMERICS MISMATCH {case.model} {case.mesh} {case.plan} ({len(case.decisions)} decisions, "
        f"{case.reference}): {case.numerics_error}"
      )
    for d in case.differences:
      print(
        f"NOT REALIZED {case.model} {case.mesh} {case.plan}: value {d['value']} ({d['where']}) "
        f"planned {d['expected']}, XLA {d['actual']}"
      )
  document = validate.to_json(cases, summary)
  write_json(config.json, document)
  if config.plot:
    validate.plot(cases, config.plot)
  return document


FULLSIZE_HEADER = (
  f"{'case':<31} {'plan':<18} {'diff':>4} {'comm MB sim':>11} {'xla':>9} {'perm sim':>8} "
  f"{'xla':>7} "
  f"{'count sim':>9} {'xla':>5} {'TFlop sim':>9} {'xla':>7} {'mem GB sim':>10} {'xla':>6} "
  f"{'ms sim':>8} {'implied':>8} {'s':>5}"
)


def _fullsize_row(check) -> str:
  s, c = check.simulated, check.compiled
  if check.error is not None:
    return (
      f"{check.case:<31} {check.plan:<18} FAILED TO COMPILE ({check.seconds:.0f}s): {check.error}"
    )
  count = lambda m: sum(m["comm_count_by_kind"].values())
  permute = (
    "stage_permute_bytes" if check.pipeline else "collective_permute_bytes"
  )  # A pipeline's: its transfers.
  return (
    f"{check.case:<31} {check.plan:<18} {check.differences:>4} {s['comm_bytes'] / 1e6:11.1f} "
    f"{c['comm_bytes'] / 1e6:9.1f} {s[permute] / 1e6:8.1f} {c[permute] / 1e6:7.1f} {count(s):9.0f} "
    f"{count(c):5.0f} "
    f"{s['flops'] / 1e12:9.2f} {c['flops'] / 1e12:7.2f} {s['peak_memory'] / 1e9:10.2f} "
    f"{c['peak_memory'] / 1e9:6.2f} {s['step_time'] * 1e3:8.2f} {c['step_time'] * 1e3:8.2f} "
    f"{check.seconds:5.0f}"
  )


def _underpriced(gap: dict[str, Any]) -> str:
  """A flattered plan's most underpriced term and op (`fullsize.underpriced_term`), or ""."""
  if "term" not in gap:
    return ""
  op = f" at {gap['op']}" if gap["op"] else ""
  return (
    f"\n      underpriced: {gap['term']}{op}: {gap['compiled_s'] * 1e3:.2f} ms compiled, "
    f"{gap['simulated_s'] * 1e3:.2f} ms simulated"
  )


def _search_agents(config: ValidateConfig) -> dict[str, int]:
  """`--agents` as {agent: budget}; an unknown agent or a bad budget fails before any work."""
  from agents.registry import AGENTS

  agents = {}
  for entry in config.agents:
    name, _, budget = entry.partition("@")
    if name not in AGENTS:
      raise ValueError(f"--agents {entry}: unknown agent {name!r}; valid: {', '.join(AGENTS)}.")
    if budget and not (budget.isdigit() and int(budget) > 0):
      raise ValueError(
        f"--agents {entry}: the budget after @ must be a positive number of evaluations."
      )
    agents[name] = int(budget) if budget else config.budget
  return agents


def _read_checks(path: str) -> list:
  """The checks of an earlier `validate --suite fullsize --json` file."""
  import json

  from automap_rl.xla import fullsize

  try:
    with open(path) as f:
      document = json.load(f)
    return [
      fullsize.PlanCheck(**{**c, "decisions": tuple(c["decisions"])}) for c in document["checks"]
    ]
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise ValueError(f"{path}: not a `validate --suite fullsize --json` file ({error}).") from None


def _fullsize_document(checks: list, families: list[dict[str, Any]]) -> dict[str, Any]:
  """The `--json` document of `checks` and their `fullsize.family_table` (infinite errors
  written as null)."""
  from automap_rl.xla import fullsize

  finite = lambda d: {
    k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()
  }
  return {
    "checks": [dataclasses.asdict(c) for c in checks],
    "exploit": fullsize.exploit_gaps(checks),
    "agreement_by_case": fullsize.agreement_by_case(checks),
    "families": [finite(row) for row in families],
    "summary": finite(fullsize.summarize(checks)),
  }


FAMILY_HEADER = (
  f"{'family':<8} {'cases':>5} {'plans':>5} {'realized':>8} {'comm':>6} {'flops':>6} {'memory':>6} "
  f"{'step':>6} {'rank':>5} {'|gap|':>6} {'max gap':>7}  worst plan (step error; largest term "
  "error)"
)


def _family_row(row: dict[str, Any]) -> str:
  fmt = lambda v, spec: (
    "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)
  )
  realized = f"{round(row['realized_fraction'] * row['plans'])}/{row['plans']}"
  term_error = row.get("worst_term_rel_error")
  term = "absent from the simulation" if term_error == math.inf else fmt(term_error, ".1%")
  worst = (
    f"{row['worst_plan']} ({fmt(row['worst_step_time_rel_error'], '.1%')}; {row['worst_term']} "
    f"{term})"
    if "worst_plan" in row
    else "none compiled"
  )
  return (
    f"{row['family']:<8} {row['cases']:>5} {row['plans']:>5} {realized:>8} "
    f"{fmt(row['comm_bytes_median_rel_error'], '6.1%')} "
    f"{fmt(row['flops_median_rel_error'], '6.1%')} "
    f"{fmt(row['memory_median_rel_error'], '6.1%')} "
    f"{fmt(row['step_time_median_rel_error'], '6.1%')} "
    f"{fmt(row['pairwise_rank_agreement'], '5.3f')} {fmt(row['exploit_gap_median_abs'], '6.3f')} "
    f"{fmt(row['exploit_gap_max'], '+7.3f')}  {worst}"
  )


def _case_names(config: ValidateConfig) -> tuple[str, ...]:
  """The cases a `fullsize` run checks: `--cases`, `--sampled` or `--draw` (printed)."""
  from automap_rl.xla import fullsize, fullsize_draw

  if config.draw and (config.cases or config.sampled):
    raise ValueError("--draw picks the cases itself: give no --cases or --sampled with it.")
  if config.draw:
    names = fullsize_draw.drawn_cases(config.draw, config.seed)
    print(f"drawn with seed {config.seed}: {' '.join(names)}", flush=True)
    return names
  return fullsize.SAMPLED_CASES if config.sampled else config.cases or fullsize.FULLSIZE_CASES


def run_fullsize(config: ValidateConfig) -> dict[str, Any]:
  """Compile-only validation at published sizes; see `automap_rl.xla.fullsize`."""
  from agents.registry import run_agent
  from automap_rl.xla import fullsize

  start = time.perf_counter()
  if config.resimulate and not config.merge:
    raise ValueError("--resimulate needs --merge, the checks to price again.")
  if config.recompile and (not config.merge or config.resimulate):
    raise ValueError(
      "--recompile needs --merge, the checks to compile again (and re-simulates them: no "
      "--resimulate)."
    )
  if config.resume and not config.json:
    raise ValueError("--resume needs --json, the file of the run to resume.")
  resumed = lambda: (
    _read_checks(config.json) if config.resume and os.path.exists(config.json) else []
  )
  stored = []  # With --recompile: the merged checks to compile again, case by case below.
  if config.merge:
    # A plan checked again in a later file replaces its earlier check (a case's experts or
    # searches compiled anew after a lowering change).
    checks = list(
      {(c.case, c.plan): c for path in config.merge for c in _read_checks(path)}.values()
    )
    names = list(dict.fromkeys(c.case for c in checks))
    unknown = [name for name in config.cases if name not in names]
    if unknown:
      raise ValueError(
        f"--cases {' '.join(unknown)}: not in the merged checks; they have {', '.join(names)}."
      )
    if config.cases:
      names = list(config.cases)
      checks = [c for c in checks if c.case in config.cases]
    if config.recompile:
      stored, checks = checks, resumed()
    if config.resimulate:
      checks = fullsize.resimulated(
        checks,
        report=lambda case: print(f"{case}: tracing, then pricing its plans again", flush=True),
      )
  else:
    names = _case_names(config)
    for name in names:
      fullsize.validation_case(name)  # Unknown names fail before any work.
    agents = _search_agents(config)
    if not config.experts and not agents:
      raise ValueError("--no-experts needs --agents, the searches whose plans to check.")
    checks = resumed()

  def search(problem, seed):
    plans = {}
    for agent, budget in agents.items():
      print(f"  searching: {agent}@{budget} ...", flush=True)
      result = run_agent(agent, problem, seed=seed, budget=budget)
      plans[f"{agent}@{budget}"] = (result.decisions, result.pipeline)
    return plans

  print(FULLSIZE_HEADER, flush=True)
  done = {c.case for c in checks}
  for check in checks:
    print(_fullsize_row(check), flush=True)
  report = lambda check: print(_fullsize_row(check), flush=True)
  for name in names if not config.merge or config.recompile else []:
    if name in done:
      continue
    print(f"{name}: tracing, then one compile per plan ...", flush=True)
    if config.recompile:
      checks += fullsize.recompiled([c for c in stored if c.case == name], report=report)
    else:
      checks += fullsize.check_case(
        name,
        search if agents else None,
        seed=config.seed,
        report=report,
        pipelines=config.pipelines,
        experts=config.experts,
      )
    write_json(config.json, _fullsize_document(checks, fullsize.family_table(checks)))
  families = fullsize.family_table(checks)
  document = _fullsize_document(checks, families)
  print(f"\n{len(checks)} plans of {len(names)} cases in {time.perf_counter() - start:.0f}s")
  for g in document["exploit"]:
    print(
      f"  exploit {g['case']:<31} {g['plan']:<12} vs {g['best_expert']:<16} simulated "
      f"{g['simulated_ratio']:.3f}"
      f"  compiled-implied {g['compiled_ratio']:.3f}  gap {g['gap']:+.3f}" + _underpriced(g)
    )
  print(_summary_text(document["summary"]))
  for case, agreement in document["agreement_by_case"].items():
    print(f"  pairwise rank agreement {case:<31} {agreement:.3f}")
  print(f"\nby family (median relative errors; rank agreement; exploit gaps)\n{FAMILY_HEADER}")
  for row in families:  # Before JSON's null for an infinite error.
    print(_family_row(row))
  unrealized = [c for c in checks if c.differences]
  if unrealized:
    print(
      "NOT REALIZED AS WRITTEN: "
      f"{', '.join(f'{c.case}/{c.plan} ({c.differences} values)' for c in unrealized)}"
    )
  for c in checks:
    if c.error is not None:
      print(f"FAILED TO COMPILE {c.case}/{c.plan}: {c.error}")
  write_json(config.json, document)
  if config.plot:
    fullsize.plot(checks, config.plot)
  return document
