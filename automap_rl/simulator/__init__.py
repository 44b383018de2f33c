"""The cost simulator: compute rooflines, alpha-beta collectives and peak memory per device.

`simulate(tables, resolution)` is a plan's `Cost`; `terms(tables, resolution)` its named
per-op and per-edge `CostTerms`, which `total` sums to the same `Cost`; `evaluate` resolves
encoded decisions and simulates them in one call. `pipeline_cost` prices a plan with
pipeline stages (`PipelineCost`, its typed `PipelineTerms`) from the same terms.
"""

from automap_rl.simulator.collectives import COMM_KINDS, KINDS, EdgeTerms, collective_seconds
from automap_rl.simulator.cost import (
  Cost,
  CostTerms,
  evaluate,
  simulate,
  terms,
  total,
)
from automap_rl.simulator.pipeline import (
  PipelineCost,
  PipelineTerms,
  for_stages,
  pipeline_cost,
)
from automap_rl.simulator.pipeline_tables import PipelineTables, build_pipeline_tables
from automap_rl.simulator.tables import CostTables, build_cost_tables

__all__ = [
  "COMM_KINDS",
  "KINDS",
  "Cost",
  "CostTables",
  "CostTerms",
  "EdgeTerms",
  "PipelineCost",
  "PipelineTables",
  "PipelineTerms",
  "build_cost_tables",
  "build_pipeline_tables",
  "collective_seconds",
  "evaluate",
  "for_stages",
  "pipeline_cost",
  "simulate",
  "terms",
  "total",
]
