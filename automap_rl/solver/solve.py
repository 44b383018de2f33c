"""The solver: exact reductions, Lagrangian pricing with MIP crossover, local and MIP polish.

1. `reduce_graph` shrinks the graph exactly (forbidden strategies, determined
   nodes merged into groups, parallel edges summed, dominated strategies
   dropped): the contest instances go from ~30k nodes to 230-27,000 groups.
2. Pricing (`dual.py`): usage is priced per time segment and the priced,
   unconstrained problem is solved by TRW-S message passing, one sweep per
   round. Each round decodes a plan; prices rise where it breaks the limit and
   fall where there is room (adaptive penalties). Decoded plans within the
   limit that beat the best are polished (`local.py`: single switches and
   two-group moves until neither helps); small problems also build a plan
   greedily within a usage budget every few rounds.
3. Crossover (`mip.py`), once a decoded plan has fitted: the best plan and the
   cheapest 2-8 plans decoded since the last crossover (usually over the limit
   somewhere; more while merges end well within their time limit, fewer when
   one runs out) are merged: the groups where any differs are re-chosen among
   the plans' strategies by the LP relaxation of their MIP (HiGHS) with the
   usage rows, rounded, and the few groups it leaves fractional re-chosen
   exactly; the second line polishes the result by forest moves (`forest.py`:
   exact re-choices of a random induced forest of the pair graph, each node
   growing by at most its random share of its segments' slack under the
   limit). This is where most of the improvement comes from. A large
   problem's pricing ends once its crossovers stall (8 in a row and 15% of the
   time without a better plan), and at the latest with a quarter of the time
   left for the neighbourhoods.
4. Polish: small problems (up to 150k pair-cost entries) first try the whole
   MIP from the best plan for 60% of the time left, which proves
   optimality on some; then (large ones for their last quarter, after forest
   moves on the best plan) large-neighbourhood search re-solves ~100 or more groups at a time
   (around a tight time segment, or a ball in the graph around a group drawn
   by its cost in the plan) exactly, each better plan polished by forest moves.

One search's stages are `search.Search`; with `workers` >= 1 the searches run in forked
processes after the reduction (`supervise`), each with its own seed and role (`ROLES`): two
lines of pricing and crossover as above, with different price schedules (their plans differ,
so the two lines explore different plans; once its decoded plans fit, a line's next crossover
merges the other line's newer best plan with its own, keeping the cheaper as the base),
whose final neighbourhoods start from the best plan either has found (the supervisor
publishes each new best).
Until its decoded plans fit, the second line also repairs them (`GroupPlan.repair`):
plans within the limit in seconds where pricing has none yet, kept apart from
its crossovers. The
supervisor kills the workers still running at the timeout, so a HiGHS call
that overruns its time limit cannot overrun the solve, and stops the others
once one proves its plan optimal. With `workers=0` the first role's search
runs in the calling process.

Every stage keeps only plans within the limit, and the result is checked on
the original graph before it is returned. Each result carries a lower bound on
the cost of every plan within the limit: the best Lagrangian bound of the
pricing rounds (`Dual.lower_bound`) or, when higher, the whole MIP's dual bound.
A `Limits` (deadline and memory ceiling) is checked in the reduction's loop and
between stages and rounds, and every HiGHS call's time limit ends by the
earlier of its deadline and the solve's; past either limit the best plan so far
is returned with `stopped_by` naming it. Randomness comes from `seed` only (and
between workers the lower-numbered wins a tie), but stages stop on the wall
clock, so results can differ between runs, the more so on a busy machine; a
search that ends by proving its plan optimal gives the same plan every time.

Measured figures on the seven public contest instances are in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from automap_rl.solver.graph import StrategyGraph, is_feasible, plan_cost
from automap_rl.solver.limits import LimitReached, Limits
from automap_rl.solver.local import Layout
from automap_rl.solver.memory import build_memory
from automap_rl.solver.reduce import Reduced, reduce_graph
from automap_rl.solver.search import Outcome, Problem, Progress, Search
from automap_rl.solver.supervise import supervise

__all__ = ["SolveResult", "solve"]

# Pair-cost entries beyond which the solver's set-up alone (the dual's message schedule,
# the layout) outlasts a time limit of minutes: wresnet-6.8b on a 2x4x8 mesh reduces to
# 186 million entries, whose set-up ran for more than 15 minutes (and whose reduction
# peaked at 24 GB resident). The reduction refuses a grouping beyond this many entries
# before allocating it (`reduce_graph`'s `max_entries`), so the reduced problem never
# holds more.
MAX_PAIR_ENTRIES = 20_000_000


@dataclasses.dataclass(frozen=True)
class SolveResult:
  """A plan and how it was found.

  Attributes:
    choice: [N] int64 strategy per node.
    cost: Its exact cost (an int for integer graphs).
    feasible: Whether it is within the usage limit with no forbidden cost
      (always True for a returned result).
    seconds: Wall time spent in `solve`.
    lower_bound: A proven lower bound on the cost of every plan within the
      limit (at most `cost`): the best Lagrangian bound of the pricing rounds or
      the whole MIP's dual bound (within a relative 1e-7 of `cost` when that
      MIP finished); None when no pricing round ran.
    log: One line per stage: what it did and the best cost after it.
    stopped_by: The limit of `Limits` that stopped the search ("seconds" or
      "memory"), or None.
  """

  choice: np.ndarray
  cost: int | float
  feasible: bool
  seconds: float
  lower_bound: float | None
  log: tuple[str, ...]
  stopped_by: str | None = None


def solve(
  graph: StrategyGraph,
  *,
  timeout_s: float,
  seed: int,
  warm_start: Sequence[int] | np.ndarray | None = None,
  progress: Progress | None = None,
  limits: Limits = Limits(),
  workers: int = 0,
) -> SolveResult:
  """Finds a low-cost plan within the usage limit in about `timeout_s` seconds.

  Args:
    graph: The problem.
    timeout_s: Wall-clock budget; the solver stops a little before it.
    seed: Seed of every random choice.
    warm_start: An [N] plan to start from (used if it is feasible).
    progress: Called as progress(seconds, cost, stage) whenever the best
      plan improves (cost of the reduced problem, equal to the plan's cost).
    limits: A deadline and memory ceiling, checked in the reduction and between
      stages and rounds: past either, the best plan so far is returned.
    workers: 0 searches in the calling process (each HiGHS call gets a time
      limit from the deadline, which HiGHS checks only at some points); n >= 1
      runs n searches in forked processes, differently seeded and sharing their
      best plans, and stops them at `timeout_s` whatever they are doing.

  Raises:
    ValueError: if `warm_start` is not one strategy index per node, or `workers` < 0.
    GraphTooLarge: if the exact reduction (which runs first, outside the time limit)
      groups the problem into more than `MAX_PAIR_ENTRIES` pair-cost entries.
    RuntimeError: if no plan within the usage limit was found.
    LimitReached: past `limits`, or with the searches killed at `timeout_s`, before any
      plan within the usage limit was found.
  """
  started = time.monotonic()
  warm_start = _checked_warm_start(graph, warm_start, workers)
  deadline = min(
    started + 0.93 * timeout_s - 0.5, np.inf if limits.deadline is None else limits.deadline
  )
  reduced = reduce_graph(graph, max_entries=MAX_PAIR_ENTRIES, limits=limits)
  memory = build_memory(graph, reduced)
  limits.check("setting up the solver")
  layout = Layout(reduced, memory)
  limits.check("setting up the solver")
  problem = Problem(graph, reduced, memory, layout, started)
  warm = None if warm_start is None else reduced.node_choice_to_group(warm_start.astype(np.int64))
  setup = (
    f"{time.monotonic() - started:6.2f}s reduce: {graph.num_nodes} nodes, {graph.num_edges} edges "
    "-> "
    f"{reduced.num_groups} groups, {len(reduced.pairs)} pairs, {memory.num_segments} time segments"
  )
  if workers == 0:
    search = Search(problem, deadline, seed, limits, progress=progress)
    search.run_guarded(warm)
    outcome = search.outcome()
  else:
    outcome = supervise(
      problem,
      warm,
      deadline,
      limits,
      [_worker_seed(seed, i) for i in range(workers)],
      hard_deadline=deadline + 0.05 * timeout_s + 0.3,
      progress=progress,
    )
  return _result(graph, reduced, outcome, setup, started)


def _checked_warm_start(
  graph: StrategyGraph, warm_start: Sequence[int] | np.ndarray | None, workers: int
) -> np.ndarray | None:
  """`warm_start` as an [N] array (None stays None); ValueError on a bad one or `workers` < 0."""
  if warm_start is not None:
    warm_start = np.asarray(warm_start)
    if (
      warm_start.shape != (graph.num_nodes,)
      or warm_start.dtype.kind not in "iu"
      or np.any((warm_start < 0) | (warm_start >= graph.num_strategies))
    ):
      raise ValueError("solve: warm_start must hold one valid strategy index per node")
  if workers < 0:
    raise ValueError("solve: workers must be 0 (in this process) or a number of processes")
  return warm_start


def _result(
  graph: StrategyGraph, reduced: Reduced, outcome: Outcome, setup: str, started: float
) -> SolveResult:
  """The searches' `outcome` as a plan of the original graph, checked there; raises the
  error that explains a missing plan."""
  if outcome.best is None:
    if outcome.limit_error is not None:
      raise outcome.limit_error
    if outcome.stopped_by == "seconds":
      raise LimitReached(
        "seconds",
        f"the time limit came before the solver found a plan for {graph.name or 'the graph'}",
      )
    raise RuntimeError(
      f"solver: no plan within the usage limit found for {graph.name or 'the graph'}"
    )
  choice = reduced.expand(outcome.best)
  if not is_feasible(graph, choice):
    raise RuntimeError(
      f"solver: the plan found for {graph.name or 'the graph'} fails the original graph's check"
    )
  lower_bound = outcome.lower_bound
  if lower_bound is not None and graph.node_costs.dtype.kind == graph.edge_costs.dtype.kind == "i":
    # Integer costs: every plan costs a whole number, so the bound rounds up, once the float
    # error of HiGHS's bound (1089.9999999999998 for a proven 1090) is taken off.
    lower_bound = math.ceil(lower_bound - 1e-9 * max(abs(lower_bound), 1.0))
  lower_bound = None if lower_bound is None else min(lower_bound, outcome.best_cost)
  return SolveResult(
    choice=choice,
    cost=plan_cost(graph, choice),
    feasible=True,
    seconds=time.monotonic() - started,
    lower_bound=lower_bound,
    log=(setup,) + outcome.log,
    stopped_by=outcome.stopped_by,
  )


def _worker_seed(seed: int, worker: int) -> int:
  """Worker 0 searches with `seed` itself (as the in-process search does); the others with seeds
  derived from it."""
  return seed if worker == 0 else int(np.random.SeedSequence([seed, worker]).generate_state(1)[0])
