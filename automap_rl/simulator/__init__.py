"""The cost simulator: compute rooflines, alpha-beta collectives and peak memory per device.

`simulate(tables, resolution)` is a plan's `Cost`; `terms(tables, resolution)` its named
per-op and per-edge `CostTerms`, which `total` sums to the same `Cost`; `evaluate` resolves
encoded decisions and simulates them in one call.
"""

from automap_rl.simulator.cost import (KINDS, Cost, CostTerms, EdgeTerms, collective_seconds, evaluate, simulate,
                                       terms, total)
from automap_rl.simulator.tables import CostTables, build_cost_tables

__all__ = ["KINDS", "Cost", "CostTables", "CostTerms", "EdgeTerms", "build_cost_tables", "collective_seconds", "evaluate", "simulate", "terms", "total"]
