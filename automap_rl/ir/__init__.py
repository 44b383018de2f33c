"""The partitioning IR: programs traced from jaxprs, sharding rules, named dimensions."""

from automap_rl.ir.dims import Conflict, DimClass, NamedDims, analyze
from automap_rl.ir.program import FactorKind, Op, Program, Role, Rule, Value
from automap_rl.ir.rules import REGISTRY, rule_for
from automap_rl.ir.trace import trace

__all__ = [
    "Conflict", "DimClass", "FactorKind", "NamedDims", "Op", "Program", "REGISTRY", "Role",
    "Rule", "Value", "analyze", "rule_for", "trace",
]
