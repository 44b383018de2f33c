"""The partitioning IR: programs traced from jaxprs, sharding rules, named dimensions."""

from automap_rl.ir.dims import Conflict, DimClass, NamedDims, analyze
from automap_rl.ir.program import FactorKind, Op, Program, Role, Rule, Value
from automap_rl.ir.roles import (
  InferredRoles,
  donated_argnums,
  infer_roles,
  trace_step,
  updated_arguments,
)
from automap_rl.ir.rules import REGISTRY, rule_for
from automap_rl.ir.trace import trace

__all__ = [
  "Conflict",
  "DimClass",
  "FactorKind",
  "InferredRoles",
  "NamedDims",
  "Op",
  "Program",
  "REGISTRY",
  "Role",
  "Rule",
  "Value",
  "analyze",
  "donated_argnums",
  "infer_roles",
  "rule_for",
  "trace",
  "trace_step",
  "updated_arguments",
]
