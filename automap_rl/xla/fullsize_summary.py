"""The full-size validation's figures from its plan checks
(`automap_rl.xla.fullsize.PlanCheck`s): how often the simulator orders plans as XLA's
compiles do, the exploit gaps of searched plans, the headline summary, per-term errors,
a per-family table and the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from automap_rl import tactics
from automap_rl.simulator import KINDS
from automap_rl.xla.validate import relative_error

if TYPE_CHECKING:
  from automap_rl.xla.fullsize import PlanCheck


def compiled_checks(checks: Sequence[PlanCheck]) -> list[PlanCheck]:
  """The checks whose plan compiled (no `error`)."""
  return [c for c in checks if c.error is None]


def _ordered_pairs(checks: Sequence[PlanCheck]) -> tuple[int, int]:
  """(pairs the simulator orders as the compiled-implied step times do, pairs) over the
  pairs of compiled plans of one case, pipelined and intra-op alike (pairs the compiled
  side ties within 0.1% left out)."""
  checks = compiled_checks(checks)
  agree = total = 0
  for i, a in enumerate(checks):
    for b in checks[i + 1 :]:
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
  return {
    name: pairwise_agreement([c for c in checks if c.case == name])
    for name in dict.fromkeys(c.case for c in checks)
  }


def exploit_gaps(checks: Sequence[PlanCheck]) -> list[dict[str, Any]]:
  """Per searched plan: its simulated ratio to the best expert (`tactics.best_expert`
  of the simulator's scores), its compiled-implied ratio to the same expert, and the gap,
  compiled-implied minus simulated ratio: positive where the simulator flatters the
  searched plan (the search exploited the simulator), negative where it undersells it.
  Searched plans that did not compile, and cases whose best expert did not, have none."""
  gaps = []
  for name in dict.fromkeys(c.case for c in checks):
    experts = {c.plan: c for c in checks if c.case == name and not c.searched}
    if not experts:
      continue
    best = experts[
      tactics.best_expert(
        {
          n: tactics.Score(
            c.simulated["step_time"], c.simulated["peak_memory"], c.simulated["fits"]
          )
          for n, c in experts.items()
        }
      )
    ]
    if best.error is not None:
      continue
    for found in (c for c in compiled_checks(checks) if c.case == name and c.searched):
      simulated = found.simulated["step_time"] / best.simulated["step_time"]
      compiled = found.compiled["step_time"] / best.compiled["step_time"]
      gaps.append(
        {
          "case": name,
          "plan": found.plan,
          "best_expert": best.plan,
          "simulated_ratio": simulated,
          "compiled_ratio": compiled,
          "gap": compiled - simulated,
          **(underpriced_term(found) if compiled > simulated else {}),
        }
      )
  return gaps


def underpriced_term(check: PlanCheck) -> dict[str, Any]:
  """The term the simulator underprices most in a compiled plan: `term` (`compute` or a
  collective kind), `op` (for a kind, the jax op whose compiled collectives of that kind
  take the most time), `compiled_s` and `simulated_s`; empty where the check has no
  per-term times (a pipelined plan, or one checked before they were recorded)."""
  s, c = check.simulated, check.compiled
  if "comm_time_by_kind" not in s or "comm_time_by_kind" not in c:
    return {}
  times = {
    "compute": (c["compute_time"], s["compute_time"]),
    **{k: (c["comm_time_by_kind"][k], s["comm_time_by_kind"][k]) for k in s["comm_time_by_kind"]},
  }
  term = max(times, key=lambda k: times[k][0] - times[k][1])
  return {
    "term": term,
    "op": c.get("op_by_kind", {}).get(term, ""),
    "compiled_s": times[term][0],
    "simulated_s": times[term][1],
  }


def summarize(checks: Sequence[PlanCheck]) -> dict[str, float]:
  """The acceptance figures over all plans of all cases (a plan that did not compile is
  not realized and has no errors)."""
  everything, checks = checks, compiled_checks(checks)
  median = lambda xs: float(np.median(xs)) if len(xs) else math.nan
  error = lambda key: median([relative_error(c.simulated[key], c.compiled[key]) for c in checks])
  count_ratio = []
  for c in checks:
    simulated, compiled = (
      sum(c.simulated["comm_count_by_kind"].values()),
      sum(c.compiled["comm_count_by_kind"].values()),
    )
    if simulated or compiled:
      count_ratio.append(max(simulated, compiled) / max(min(simulated, compiled), 1e-9))
  gaps = [g["gap"] for g in exploit_gaps(checks)]
  pipelined = [c for c in checks if c.pipeline is not None]
  return {
    "plans": len(everything),
    "failed_to_compile": len(everything) - len(checks),
    "realized_fraction": float(
      np.mean([c.error is None and c.differences == 0 for c in everything])
    )
    if everything
    else math.nan,
    "comm_bytes_median_rel_error": error("comm_bytes"),
    "collective_counts_within_2x_fraction": float(np.mean([r <= 2.0 for r in count_ratio]))
    if count_ratio
    else math.nan,
    "flops_median_rel_error": error("flops"),
    "memory_median_rel_error": error("peak_memory"),
    "stage_permute_bytes_median_rel_error": median(
      [
        relative_error(c.simulated["stage_permute_bytes"], c.compiled["stage_permute_bytes"])
        for c in pipelined
      ]
    ),
    "step_time_median_rel_error": median(
      [relative_error(c.simulated["step_time"], c.compiled["step_time"]) for c in checks]
    ),
    "pairwise_rank_agreement": pairwise_agreement(checks),
    "exploit_gap_median": median(gaps),
    "exploit_gap_median_abs": median(np.abs(gaps)),
    "exploit_gap_max": max(gaps, default=math.nan),
  }


# A collective kind's bytes count as a term of a plan where they carry at least this
# fraction of its comm bytes (simulated or compiled).
TERM_SHARE = 0.05


def term_errors(check: PlanCheck) -> dict[str, float]:
  """The relative error of each term of a compiled plan: `flops` (compute), `peak_memory`,
  the bytes of each collective kind carrying at least `TERM_SHARE` of its comm bytes on
  either side (keyed by kind), and `collective-permute` bytes likewise."""
  s, c = check.simulated, check.compiled
  errors = {
    "flops": relative_error(s["flops"], c["flops"]),
    "peak_memory": relative_error(s["peak_memory"], c["peak_memory"]),
  }
  permute = "stage_permute_bytes" if check.pipeline else "collective_permute_bytes"
  moved = {
    **{k: (s["comm_bytes_by_kind"][k], c["comm_bytes_by_kind"][k]) for k in KINDS},
    "collective-permute": (s[permute], c[permute]),
  }
  totals = [sum(side) for side in zip(*moved.values())]
  for kind, (simulated, xla) in moved.items():
    if any(b >= TERM_SHARE * t > 0 for b, t in zip((simulated, xla), totals)):
      errors[kind] = relative_error(simulated, xla)
  return errors


def family_table(checks: Sequence[PlanCheck]) -> list[dict[str, Any]]:
  """Per model family: the `summarize` figures of its plans, its rank agreement, and its
  worst plan (the largest relative error of the simulated against the compiled-implied
  step time) with that plan's largest `term_errors` term."""
  rows = []
  for family in dict.fromkeys(c.family for c in checks):
    mine = [c for c in checks if c.family == family]
    ok = compiled_checks(mine)
    worst = max(
      ok,
      key=lambda c: relative_error(c.simulated["step_time"], c.compiled["step_time"]),
      default=None,
    )
    row = {"family": family, "cases": len({c.case for c in mine}), **summarize(mine)}
    if worst is not None:
      term, error = max(term_errors(worst).items(), key=lambda item: item[1])
      row |= {
        "worst_plan": f"{worst.case}/{worst.plan}",
        "worst_step_time_rel_error": relative_error(
          worst.simulated["step_time"], worst.compiled["step_time"]
        ),
        "worst_term": term,
        "worst_term_rel_error": error,
      }
    rows.append(row)
  return rows


def plot(checks: Sequence[PlanCheck], path: str) -> None:
  """Four log-log panels of simulated against compiled: comm bytes, flops and peak memory
  per device, and each plan's step time over its case's best expert (the simulator's
  ratio against the compiled-implied one); searched plans drawn as crosses."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  checks = compiled_checks(checks)
  best = {g["case"]: g["best_expert"] for g in exploit_gaps(checks)}
  expert = {(c.case, c.plan): c for c in checks if not c.searched}
  panels = (
    ("comm_bytes", "comm bytes / device"),
    ("flops", "flops / device"),
    ("peak_memory", "peak memory / device"),
    ("ratio", "step time / best expert's"),
  )
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
