"""`automap-rl validate --suite quick|full`: the simulator against XLA compiles;
`automap-rl validate --random N`: N random plans per model, numerics checked."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Literal

from experiments.cli import write_json
from experiments.options import JsonPath, PlotPath


@dataclasses.dataclass(frozen=True)
class ValidateConfig:
  """What to validate.

  Attributes:
    suite: `quick` (small workloads, a few minutes on CPU) or `full` (the zoo's defaults).
    json: where to write `{cases, summary}`.
    plot: where to draw the simulated-vs-compiled scatter plots (PNG).
    random: instead of a suite, N random plans per model (on `data=8` and
      `data=2,model=4` in turn), each compiled in a child process first (an XLA abort is a
      failed plan, not the end of the command), run and checked against the unpartitioned
      step; 0: run `suite`.
    models: with `random`, the workloads; default every family at small size.
  """

  suite: Literal["quick", "full"] = "quick"
  json: JsonPath = None
  plot: PlotPath = None
  random: int = 0
  models: tuple[str, ...] = ()


def _mb(x: float) -> str:
  return f"{x / 1e6:9.3f}"


def _row(case) -> str:
  s, c = case.simulated, case.compiled
  if case.lowering_error is not None:
    return f"{case.model.split(':')[0]:<7} {case.mesh:<15} {case.plan:<14} LOWERING ERROR {case.seconds:6.1f}s"
  flag = ("" if case.numerics_ok else "  NUMERICS MISMATCH") + (
      f"  {len(case.differences)} SHARDING DIFFERENCES" if case.differences else "") + (
      "" if case.reference == "float64" else "  (float32 reference)")
  return (f"{case.model.split(':')[0]:<7} {case.mesh:<15} {case.plan:<14} {_mb(s['comm_bytes'])} {_mb(c['comm_bytes'])} "
          f"{s['flops'] / 1e6:10.2f} {c['flops'] / 1e6:10.2f} {_mb(s['peak_memory'])} {_mb(c['peak_memory'])} "
          f"{case.seconds:6.1f}s{flag}")


HEADER = (f"{'model':<7} {'mesh':<15} {'plan':<14} {'comm sim':>9} {'comm xla':>9} {'Mflop sim':>10} "
          f"{'Mflop xla':>10} {'mem sim':>9} {'mem xla':>9}   (MB per device)")


def _summary_text(summary: dict[str, float]) -> str:
  fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"
  return "\n".join(f"  {k:<30} {fmt(v)}" for k, v in summary.items())


def run(config: ValidateConfig) -> dict[str, Any]:
  from automap_rl import workloads  # Imported late: jax must see the CLI's XLA_FLAGS.
  from automap_rl.xla import validate

  if config.suite not in validate.SUITES:
    raise ValueError(f"Unknown suite {config.suite!r}; valid suites: {sorted(validate.SUITES)}.")
  if config.random < 0 or (config.models and not config.random):
    raise ValueError(f"--random {config.random}: give a positive number of plans per model"
                     + (" (--models needs --random)" if config.models else "") + ".")
  for spec in config.models:
    workloads.canonical_spec(spec)  # A bad spec: one line naming it, before any work.
  start = time.perf_counter()
  print(HEADER)
  report = lambda case: print(_row(case), flush=True)
  if config.random:
    random_suite = validate.RandomSuite(**({"models": config.models} if config.models else {}), plans=config.random)
    cases = validate.run_random(random_suite, report)
  else:
    cases = validate.run_suite(validate.SUITES[config.suite], report)
  summary = validate.summarize_cases(cases)
  print(f"\n{len(cases)} cases in {time.perf_counter() - start:.0f}s\n{_summary_text(summary)}")
  for case in cases:
    if case.lowering_error is not None:
      print(f"LOWERING ERROR {case.model} {case.mesh} {case.plan} ({len(case.decisions)} decisions): "
            f"{case.lowering_error}")
    elif not case.numerics_ok:
      print(f"NUMERICS MISMATCH {case.model} {case.mesh} {case.plan} ({len(case.decisions)} decisions, "
            f"{case.reference}): {case.numerics_error}")
    for d in case.differences:
      print(f"NOT REALIZED {case.model} {case.mesh} {case.plan}: value {d['value']} ({d['where']}) "
            f"planned {d['expected']}, XLA {d['actual']}")
  document = validate.to_json(cases, summary)
  write_json(config.json, document)
  if config.plot:
    validate.plot(cases, config.plot)
  return document
