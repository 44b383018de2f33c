"""The ILP baseline: Alpa's intra-op integer program on the program's strategy graph.

The plan space is `automap_rl.strategy_graph`'s: up to `ILPConfig.max_axes_per_dim` mesh
axes per named dimension (one, or an ordered pair: FSDP x TP plans put a batch or a stored
weight over two axes), each decided at a fixed place of a decision order, which this agent
takes from the best expert plan (each class's axes where the expert decides them, then the
other classes) so that the expert is a plan of the graph, the warm start. The graph is
solved by `automap_rl.solver.solve`, the same core that solves the IOPDDL contest problems:
exact reductions, Lagrangian pricing of the memory rows with MIP crossovers, then the whole
problem as one MIP (HiGHS, via highspy) when it is small, else large-neighbourhood MIPs,
all within the time limit (by default in a forked process that the deadline stops: a
HiGHS call can run tens of seconds past its own time limit) and never leaving the memory
limit.

Why HiGHS: the problem is a MIP with a linear objective over one-hot strategy choices,
pair terms linearised by marginal constraints and knapsack-like memory rows; HiGHS is an
LP-based branch and bound with good LP duals for exactly this shape, gives proven bounds
(optimality of the whole MIP on small graphs), takes a warm start and a time limit, and
is a pip wheel. CP-SAT would need integer costs (seconds scaled and rounded) and its
strength, clause learning on tight combinatorics, does not help the weak coupling of
these graphs.

The agent's budget is its budget: the best expert, the graph's build, its reduction and
its solve share one deadline (the budget's seconds from the agent's start; through
`agents.partition`, what tracing and building the problem left of the call's budget,
`Budget.after`) and one ceiling on the process's resident memory (`ILPConfig.max_resident_gib`),
checked inside the build's
loops and between the solver's stages (`solver.Limits`). Past either, the agent returns
its best plan so far (the expert's when the solver has none yet) with a warning naming the
limit, and `SearchResult.stopped_by` says which.

Repeated layers are tied (`strategy_graph.tied_classes`): every layer of an unrolled
stack takes the same axes, so a deep model's graph is about one layer's size. With pairs,
a second solve over the single-axis plans (pairs forbidden: a smaller problem, often
solved to optimality) runs at the same time on a second core.

The graph prices each collective alone where the simulator combines them, so plans the
graph ranks alike can part by tens of percent in step time. The last share of the time
(`ILPConfig.descent_share`) goes to a steepest descent on the simulator's objective from
the solves' plans and the expert's: changes of one class node's axes (its tied layers
together) and of one tied layer alone, priced in batches, until none improves. Where the
graph is too large to solve, the descent still runs from the expert.

Every run that builds the graph reports a lower bound (`SearchResult.lower_bound`): no plan
of the graph (tied when tied) costs less, in the graph's cost (the simulator's step time
without collective combining, which is at least the simulator's own): the solve's proven
bound, or where the graph is too large to solve, each node's and edge's cheapest entry
(`solver.separable_lower_bound`).

The result's plan is a decision list over named dimensions, resolved, simulated and
lowered like any other; its cost is the simulator's (equal to the graph's). The graph's
cost of every plan equals the simulator's step time and its peak usage the simulator's
peak memory, so the plan fits in memory whenever some plan of the graph does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import warnings
from collections.abc import Sequence

import numpy as np

from agents.base import (
  Budget,
  Progress,
  SearchResult,
  Seconds,
  TracePoint,
  env_config,
  plan_objective,
  searcher,
)
from automap_rl import simulator, solver, strategy_graph, tactics
from automap_rl.problem import Problem
from automap_rl.sharding import Decision


@dataclasses.dataclass(frozen=True)
class ILPConfig:
  """The ILP agent.

  Attributes:
    seconds: the time limit when the budget gives none.
    warm_start: start from the best expert plan (else from nothing; the class order is
      then by id).
    tie_layers: tie repeated layers (`strategy_graph.tied_classes`), untied afterwards by
      the descent where that pays.
    max_axes_per_dim: the most mesh axes the graph gives one named dimension: 2 (single
      axes and ordered pairs) or 1 (single axes only).
    single_axes_alongside: with pairs, also solve the single-axis plans (pairs forbidden)
      in a second solver process at the same time: a smaller problem, often solved to
      optimality within the time, where the whole graph's search can end above its best
      plan. It uses a second core.
    descent_share: the share of the time left after the graph's build kept for the
      simulator-priced descent from the solver's plan (`_descend`).
    max_resident_gib: the ceiling on the process's resident memory (GiB).
    workers: the solver's search processes (`solver.solve`): 1 searches in a forked
      process that the deadline stops whatever it is doing (a HiGHS call can run tens of
      seconds past its time limit); 0 searches in this process.
    reserve: the share of the time limit kept for turning the plan into the result (at
      least a second).
    action_space: the environment action space the result's `action_ids` are encoded in
      (plans are named-dimension decisions).
    max_decisions: that environment's capacity in class decisions.
  """

  seconds: float = 20.0
  warm_start: bool = True
  tie_layers: bool = True
  max_axes_per_dim: int = 2
  single_axes_alongside: bool = True
  descent_share: float = 0.2
  max_resident_gib: float = 4.0
  workers: int = 1
  reserve: float = 0.05
  action_space: str = "named_dims"
  max_decisions: int = 256

  def __post_init__(self):
    if self.max_axes_per_dim not in (1, 2):
      raise ValueError(f"ILPConfig.max_axes_per_dim must be 1 or 2, not {self.max_axes_per_dim}")
    if not self.max_resident_gib > 0:
      raise ValueError(f"ILPConfig.max_resident_gib must be positive, not {self.max_resident_gib}")
    if self.workers < 0:
      raise ValueError(
        f"ILPConfig.workers must be 0 (search in this process) or more, not {self.workers}"
      )
    if not 0 <= self.descent_share < 1:
      raise ValueError(f"ILPConfig.descent_share must be in [0, 1), not {self.descent_share}")
    if not 0 <= self.reserve < 1:
      raise ValueError(f"ILPConfig.reserve must be in [0, 1), not {self.reserve}")


def search(
  problem: Problem,
  config: ILPConfig = ILPConfig(),
  seed: int = 0,
  budget: Budget | int | str = Seconds(20),
  progress: Progress | None = None,
) -> SearchResult:
  """Finds the best expert plan, builds the strategy graph (layers tied unless
  `config.tie_layers` is off), solves it from the expert (its single-axis plans beside),
  descends from the solves' plans and the expert's on the simulator's objective, and
  returns the best plan, all within the budget's seconds (else `config.seconds`) and
  `config.max_resident_gib` (see the module docstring).

  A simulation is a complete plan simulated: the experts, the solves' plans and the
  descent's candidates (the graph's per-site terms, evaluated once in batches, are not
  counted). A simulations budget stops the descent (`stopped_by` `simulations`; the
  experts are simulated whatever the budget); the solver is bounded by the seconds. The
  seed drives the solver's random choices; its stages stop on the wall clock, so two runs
  agree when the whole MIP is solved to optimality (small graphs) and can differ
  otherwise. Where the graph is too large for the solver (`solver.GraphTooLarge`) or no
  graph plan fits in memory, the descent starts from the expert alone (with a warning for
  the first); a limit that stops the search before the solver has a plan is named in a
  warning. The result is never worse than the best expert.
  """
  budget = Budget.of(budget)
  seconds = budget.seconds if budget.seconds is not None else config.seconds
  limits = solver.Limits.starting_now(seconds, int(config.max_resident_gib * 2**30))
  reserve = max(config.reserve * seconds, 1.0)
  run = _Run(problem, limits, time.perf_counter())
  expert = tactics.best_expert_plan(problem)
  simulations = len(tactics.applicable(problem)) + 1
  dec_class, dec_axis = problem.encode(expert.decisions)
  # The expert as class decisions: the fallback, and the plan to beat.
  expert_decisions = [
    Decision(int(c), problem.mesh.axis_names[a]) for c, a in zip(dec_class, dec_axis)
  ]
  run.offer(expert_decisions, expert.cost, simulations)
  setup = 0.0
  lower_bound = graph = None
  starts: list[list[Decision]] = []  # Where the simulator-priced descent starts.
  try:
    order = strategy_graph.order_from(
      problem, expert.decisions if config.warm_start else (), config.max_axes_per_dim
    )
    tie = strategy_graph.tied_classes(problem) if config.tie_layers else None
    graph = strategy_graph.build(problem, order, tie, limits, config.max_axes_per_dim)
    warm = graph.assignment_of(list(expert.decisions)) if config.warm_start else None
    warm = None if warm is None else graph.choice(warm)
    setup = run.elapsed()
    lower_bound = solver.separable_lower_bound(graph.graph)
    single = _single_axes(graph) if config.single_axes_alongside else None
    seconds_left = (1 - config.descent_share) * (limits.seconds_left() - reserve)
    with warnings.catch_warnings(), concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
      # JAX warns at every fork that its threads may deadlock the child; the solver's
      # children run numpy and HiGHS only, never JAX.
      warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
      solves = [
        pool.submit(_solve, g, config, seed, warm, limits, seconds_left)
        for g in (graph.graph, single)
        if g is not None
      ]
      concurrent.futures.wait(solves)
    if len(solves) == 2 and solves[1].exception() is None:
      starts.append(graph.decisions(solves[1].result().choice))
    result = solves[0].result()  # Raises the whole graph's solve's error.
    lower_bound = max(lower_bound, result.lower_bound or 0.0)
    run.stopped(result.stopped_by, f"the solver stopped at its {result.stopped_by} limit")
    starts.insert(0, graph.decisions(result.choice))
  except solver.LimitReached as e:
    run.stopped(e.limit, str(e))
  except solver.GraphTooLarge as e:
    warnings.warn(f"ilp: {e}; returning its best plan so far instead.", stacklevel=2)
  except RuntimeError:  # No plan of the graph fits in memory.
    pass
  try:
    # From the solves' plans, then from the best expert's.
    for start in starts + [expert_decisions] if graph is not None else []:
      if run.stopped_by in ("memory", "simulations"):
        break
      if limits.seconds_left() <= reserve:
        run.stopped("seconds", "the time budget ran out before the descent")
        break
      simulations = _descend(
        graph,
        run,
        start,
        simulations,
        deadline=limits.deadline - reserve,
        max_simulations=budget.simulations,
      )
  except solver.LimitReached as e:
    run.stopped(e.limit, str(e))
  if run.stopped_by is not None:
    warnings.warn(
      f"ilp: stopped by its {_LIMIT_NAMES[run.stopped_by]} ({run.message}); returning its best "
      "plan "
      "so far.",
      stacklevel=2,
    )
  decisions, cost = run.best
  if progress is not None:
    progress(simulations, float(cost.step_time))
  env = searcher(problem, env_config(problem, config.action_space, config.max_decisions)).env
  target = {t.target: i for i, t in enumerate(env.targets)}
  action_ids = tuple(
    target[d.target] * env.config.max_axes + problem.mesh.axis_index(d.axis) for d in decisions
  )
  return SearchResult(
    decisions=decisions,
    cost=cost,
    trace=run.trace,
    simulations=simulations,
    seconds=run.elapsed(),
    actions=[env.action_name(a) for a in action_ids],
    objective=run.trace[-1].objective,
    setup_seconds=setup or run.elapsed(),
    action_ids=action_ids,
    stopped_by=run.stopped_by,
    lower_bound=lower_bound,
  )


def _solve(
  graph: solver.StrategyGraph,
  config: ILPConfig,
  seed: int,
  warm: np.ndarray | None,
  limits: solver.Limits,
  seconds: float,
) -> solver.SolveResult:
  """`solver.solve` for `seconds` (at least 0.1) within `limits`, from `warm` when it is a
  plan of `graph` (the whole graph's warm start may take pairs the single-axis one forbids)."""
  warm = warm if warm is not None and solver.is_feasible(graph, warm) else None
  return solver.solve(
    graph,
    timeout_s=max(seconds, 0.1),
    seed=seed,
    warm_start=warm,
    limits=limits,
    workers=config.workers,
  )


def _single_axes(graph: strategy_graph.ProgramGraph) -> solver.StrategyGraph | None:
  """The strategy graph with every class node's pairs of axes forbidden (its plans are the
  one-axis-per-dimension ones), or None when no class node has a pair."""
  offsets = graph.graph.node_offsets
  pairs = [
    offsets[node] + s
    for node, domain in enumerate(graph.domains)
    for s, axes in enumerate(domain)
    if len(axes) > 1
  ]
  if not pairs:
    return None
  costs = graph.graph.node_costs.copy()
  costs[pairs] = solver.FORBIDDEN
  return dataclasses.replace(graph.graph, node_costs=costs)


_LIMIT_NAMES = {
  "seconds": "time budget",
  "memory": "memory ceiling",
  "simulations": "simulations budget",
}

# Plans per simulator call in the descent (every call one batch: one compile).
_DESCENT_BATCH = 256


class _Run:
  """The best plan so far, its trace, and the limit that stopped the search."""

  def __init__(self, problem: Problem, limits: solver.Limits, start: float):
    self.problem, self.limits, self.start = problem, limits, start
    self.best: tuple[list[Decision], simulator.Cost] | None = None
    self.best_objective = float("inf")
    self.trace: list[TracePoint] = []
    self.stopped_by: str | None = None
    self.message = ""

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def offer(self, decisions: list[Decision], cost: simulator.Cost, simulations: int) -> bool:
    """Keeps the plan if its objective is the best so far."""
    value = plan_objective(self.problem, cost)
    if value >= self.best_objective:
      return False
    self.best, self.best_objective = (list(decisions), cost), value
    self.trace.append(TracePoint(simulations, self.elapsed(), float(cost.step_time), value))
    return True

  def stopped(self, limit: str | None, message: str = "") -> None:
    if limit is not None and self.stopped_by is None:
      self.stopped_by, self.message = limit, message or f"past the {limit} limit while solving"


def _descend(
  graph: strategy_graph.ProgramGraph,
  run: _Run,
  start: Sequence[Decision],
  simulations: int,
  deadline: float,
  max_simulations: int | None = None,
) -> int:
  """Steepest descent on the simulator's objective from `start` until `deadline`
  (monotonic), `max_simulations` (None: no limit) or a round without improvement, offering
  each step's plan to `run`. A round prices, in batches of `_DESCENT_BATCH`, every change
  of one class node's axes (its tied classes together) and of one tied class alone
  (untying it), and moves to the best if it improves. The graph prices each collective
  alone, the simulator combines them: plans the graph ranks alike can part by tens of
  percent. Returns the simulations; stops `run` with "seconds" or "simulations" when a
  limit cut the descent short."""
  left = lambda: float("inf") if max_simulations is None else max_simulations - simulations
  problem = run.problem
  if left() < 1:
    run.stopped("simulations", "the simulations budget was spent before the descent")
    return simulations
  current = _assignment(graph, start)
  cost = problem.cost(graph.decisions_of(current))
  current_value = plan_objective(problem, cost)
  simulations += 1
  run.offer(graph.decisions_of(current), cost, simulations)
  while time.monotonic() < deadline:
    run.limits.check("polishing the plan")
    candidates = []
    for members, domain in zip(graph.members, graph.domains):
      for axes in domain:
        if any(current.get(m, ()) != axes for m in members):
          candidates.append({**current, **{m: axes for m in members}})
        if len(members) > 1:
          candidates += [{**current, m: axes} for m in members if current.get(m, ()) != axes]
    best: tuple[float, dict[int, tuple[int, ...]], simulator.Cost] | None = None
    for first in range(0, len(candidates), _DESCENT_BATCH):
      if time.monotonic() >= deadline or left() < 1:
        break
      chunk = candidates[first : first + int(min(_DESCENT_BATCH, left()))]
      plans = [graph.decisions_of(plan) for plan in chunk]
      # Padded to a whole batch: one compile of the simulator's batch, whatever the chunk.
      costs = problem.costs(plans + plans[:1] * (_DESCENT_BATCH - len(plans)))
      simulations += len(chunk)
      for plan, cost in zip(chunk, costs):
        value = plan_objective(problem, cost)
        if value < current_value and (best is None or value < best[0]):
          best = (value, plan, cost)
    if best is not None:
      current_value, current = best[0], best[1]
      run.offer(graph.decisions_of(current), best[2], simulations)
    if left() < 1:
      run.stopped("simulations", "the simulations budget ended the descent")
      return simulations
    if best is None:
      return simulations
  run.stopped("seconds", "the time budget ended the descent")
  return simulations


def _assignment(
  graph: strategy_graph.ProgramGraph, decisions: Sequence[Decision]
) -> dict[int, tuple[int, ...]]:
  """Class -> axes (indices) of class decisions, in the order of their first decisions."""
  assignment: dict[int, tuple[int, ...]] = {}
  for d in decisions:
    axis, cls = graph.problem.mesh.axis_index(d.axis), int(d.target)
    if axis not in assignment.get(cls, ()):
      assignment[cls] = (*assignment.get(cls, ()), axis)
  return assignment
