"""The validation suite's headline figures, JSON document and plots from its cases
(`automap_rl.xla.validate.ValidatedPlan`s)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from automap_rl.xla.validate import ValidatedPlan


def relative_error(simulated: float, compiled: float) -> float:
  """`|sim - xla| / |xla|`; 0 when both are 0, inf when only XLA's is."""
  if compiled == 0:
    return 0.0 if simulated == 0 else math.inf
  return abs(simulated - compiled) / abs(compiled)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
  """Spearman's rank correlation; nan with fewer than 3 points or a constant side."""
  from scipy.stats import spearmanr  # Local: scipy is slow to import.

  if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
    return math.nan
  return float(spearmanr(a, b).statistic)


def _median_error(cases: Sequence[ValidatedPlan], key: str) -> float:
  errors = [relative_error(c.simulated[key], c.compiled[key]) for c in cases]
  return float(np.median(errors)) if errors else math.nan


def summarize_cases(cases: Sequence[ValidatedPlan]) -> dict[str, float]:
  """The headline figures: numerics over all cases (a plan that does not compile fails),
  the simulator's errors over the compiled ones; `xla_aborts` counts plans XLA aborted on
  (in the child process), `pipelined_cases` the pipelined plans."""
  everything, cases = cases, [c for c in cases if c.lowering_error is None]
  column = lambda side, key: [getattr(c, side)[key] for c in cases]
  return {
    "num_cases": len(everything),
    "lowering_errors": len(everything) - len(cases),
    "xla_aborts": sum("(aborted:" in (c.lowering_error or "") for c in everything),
    "pipelined_cases": sum(c.pipeline is not None for c in everything),
    "comm_bytes_median_rel_error": _median_error(cases, "comm_bytes"),
    "comm_bytes_spearman": spearman(
      column("simulated", "comm_bytes"), column("compiled", "comm_bytes")
    ),
    "flops_median_rel_error": _median_error(cases, "flops"),
    "memory_median_rel_error": _median_error(cases, "peak_memory"),
    "memory_spearman": spearman(
      column("simulated", "peak_memory"), column("compiled", "peak_memory")
    ),
    "numerics_ok_fraction": float(np.mean([c.numerics_ok for c in everything]))
    if everything
    else math.nan,
    "realized_fraction": float(np.mean([not c.differences for c in cases])) if cases else math.nan,
  }


def to_json(cases: Sequence[ValidatedPlan], summary: dict[str, float]) -> dict[str, Any]:
  """The JSON document: `cases` and `summary` (nan and inf become null)."""
  clean = lambda x: None if isinstance(x, float) and not math.isfinite(x) else x
  return {
    "cases": [dataclasses.asdict(c) for c in cases],
    "summary": {k: clean(v) for k, v in summary.items()},
  }


def plot(cases: Sequence[ValidatedPlan], path: str) -> None:
  """Scatter plots, log-log, of simulated vs compiled comm bytes, flops and peak memory
  per device, one colour per model, with the line of agreement and a ±15% band. Cases
  where both figures are zero (no communication) cannot sit on a log axis: each panel's
  title counts them instead."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = (
    ("comm_bytes", "communication / device", "bytes"),
    ("flops", "flops / device", "flops"),
    ("peak_memory", "peak memory / device", "bytes"),
  )
  fig, axes = plt.subplots(1, len(panels), figsize=(16, 5))
  models = list(dict.fromkeys(c.model.split(":")[0] for c in cases))
  for ax, (key, title, unit) in zip(axes, panels):
    shown = [c for c in cases if c.compiled.get(key, 0) > 0 and c.simulated[key] > 0]
    for model in models:
      mine = [c for c in shown if c.model.split(":")[0] == model]
      ax.scatter(
        [c.compiled[key] for c in mine],
        [c.simulated[key] for c in mine],
        label=model,
        s=18,
        alpha=0.8,
      )
    values = [v for c in shown for v in (c.compiled[key], c.simulated[key])] or [1.0, 10.0]
    line = np.geomspace(min(values) / 1.5, max(values) * 1.5, 2)
    ax.plot(line, line, "k--", lw=0.8)
    ax.fill_between(line, line / 1.15, line * 1.15, color="k", alpha=0.06, lw=0)
    hidden = len(cases) - len(shown)
    ax.set(
      xscale="log",
      yscale="log",
      xlabel=f"XLA (compiled), {unit}",
      ylabel=f"simulator, {unit}",
      title=title + (f" (not shown: {hidden} cases with none)" if hidden else ""),
    )
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
