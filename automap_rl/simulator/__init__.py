"""The cost simulator: compute rooflines, alpha-beta collectives and peak memory per device."""

from automap_rl.simulator.cost import KINDS, Cost, simulate
from automap_rl.simulator.tables import CostTables, build

__all__ = ["KINDS", "Cost", "CostTables", "build", "simulate"]
