"""Solvers for intra-op sharding problems posed as strategy graphs.

`StrategyGraph` is the generic problem (one strategy per node, node and edge
costs, a memory limit over live intervals); `iopddl` reads and scores the
ASPLOS/EuroSys 2025 IOPDDL contest format; `solve` finds a low-cost plan
within the limit (and a lower bound) under a deadline and memory ceiling (`Limits`);
`bench_iopddl` runs the solver on the contest instances, or on `tile`d copies of them, and
`contest` scores costs as the contest did.
"""

from automap_rl.solver.bench import (
  RESULTS_FILE,
  BenchRow,
  bench_iopddl,
  find_instances,
  geometric_mean,
  is_instance_file,
  read_results,
)
from automap_rl.solver.contest import CONTEST_TIMEOUTS, PUBLIC, ContestResults, load_results
from automap_rl.solver.graph import (
  FORBIDDEN,
  StrategyGraph,
  is_feasible,
  offsets_from_counts,
  peak_usage,
  plan_cost,
  separable_lower_bound,
  tile,
  usage_profile,
)
from automap_rl.solver.iopddl import (
  Evaluation,
  evaluate,
  load_problem,
  read_solution,
  write_solution,
)
from automap_rl.solver.limits import LimitReached, Limits, resident_bytes
from automap_rl.solver.reduce import GraphTooLarge
from automap_rl.solver.solve import SolveResult, solve

__all__ = [
  "CONTEST_TIMEOUTS",
  "PUBLIC",
  "RESULTS_FILE",
  "BenchRow",
  "ContestResults",
  "find_instances",
  "is_instance_file",
  "load_results",
  "read_results",
  "FORBIDDEN",
  "Evaluation",
  "GraphTooLarge",
  "LimitReached",
  "Limits",
  "SolveResult",
  "StrategyGraph",
  "bench_iopddl",
  "evaluate",
  "geometric_mean",
  "is_feasible",
  "load_problem",
  "offsets_from_counts",
  "peak_usage",
  "plan_cost",
  "read_solution",
  "resident_bytes",
  "separable_lower_bound",
  "solve",
  "tile",
  "usage_profile",
  "write_solution",
]
