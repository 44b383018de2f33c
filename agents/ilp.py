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
`Budget.after`) and one ceiling on the process's resident memory (`ILPConfig.max_resident_gib`), checked inside the build's
loops and between the solver's stages (`solver.Limits`). Past either, the agent returns
its best plan so far (the expert's when the solver has none yet) with a warning naming the
limit, and `SearchResult.stopped_by` says which.

Repeated layers are tied (`strategy_graph.tied_classes`): every layer of an unrolled
stack takes the same axes, so a deep model's graph is about one layer's size. Time left
after the solve unties them by local improvement: single class changes, each layer's
classes apart, priced by the simulator in batches, the best improving one kept.

Every solve reports a lower bound (`SearchResult.lower_bound`): no plan of the graph (tied
when tied) costs less, in the graph's cost (the simulator's step time without collective
combining, which is at least the simulator's own).

The result's plan is a decision list over named dimensions, resolved, simulated and
lowered like any other; its cost is the simulator's (equal to the graph's). The graph's
cost of every plan equals the simulator's step time and its peak usage the simulator's
peak memory, so the plan fits in memory whenever some plan of the graph does.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

from agents.base import Budget, Progress, SearchResult, Seconds, TracePoint, env_config, plan_objective, searcher
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
      local improvement while time is left.
    max_axes_per_dim: the most mesh axes the graph gives one named dimension: 2 (single
      axes and ordered pairs) or 1 (single axes only).
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
      raise ValueError(f"ILPConfig.workers must be 0 (search in this process) or more, not {self.workers}")
    if not 0 <= self.reserve < 1:
      raise ValueError(f"ILPConfig.reserve must be in [0, 1), not {self.reserve}")


def search(problem: Problem, config: ILPConfig = ILPConfig(), seed: int = 0, budget: Budget | int | str = Seconds(20),
           progress: Progress | None = None) -> SearchResult:
  """Finds the best expert plan, builds the strategy graph (layers tied unless
  `config.tie_layers` is off), solves it from the expert, unties it while time is left,
  and returns the best of these plans, all within the budget's seconds (else
  `config.seconds`) and `config.max_resident_gib` (see the module docstring).

  A simulation is a complete plan simulated: the experts, the untying candidates and the
  result (the graph's per-site terms, evaluated once in batches, are not counted), so a
  simulations budget does not bound this agent; its time limit does. The seed drives the
  solver's random choices; its stages stop on the wall clock, so two runs agree when the
  whole MIP is solved to optimality (small graphs) and can differ otherwise. The best
  expert plan is returned when no graph plan fits in memory, when the graph is too large
  for the solver (`solver.GraphTooLarge`, with a warning), and when a limit stops the
  search before the solver has a plan (with a warning naming the limit).
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
  run.offer([Decision(int(c), problem.mesh.axis_names[a]) for c, a in zip(dec_class, dec_axis)], expert.cost,
            simulations)
  setup = 0.0
  lower_bound = None
  try:
    order = strategy_graph.order_from(problem, expert.decisions if config.warm_start else (), config.max_axes_per_dim)
    tie = strategy_graph.tied_classes(problem) if config.tie_layers else None
    graph = strategy_graph.build(problem, order, tie, limits, config.max_axes_per_dim)
    warm = graph.assignment_of(list(expert.decisions)) if config.warm_start else None
    setup = run.elapsed()
    with warnings.catch_warnings():
      # JAX warns at every fork that its threads may deadlock the child; the solver's
      # children run numpy and HiGHS only, never JAX.
      warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
      result = solver.solve(graph.graph, timeout_s=max(limits.seconds_left() - reserve, 0.1), seed=seed,
                            warm_start=None if warm is None else graph.choice(warm), limits=limits,
                            workers=config.workers)
    lower_bound = result.lower_bound
    run.stopped(result.stopped_by)
    decisions = graph.decisions(result.choice)
    simulations += 1
    run.offer(decisions, problem.cost(decisions), simulations)
    if graph.tied and result.stopped_by is None:
      simulations = _untie(graph, run, simulations, deadline=limits.deadline - reserve)
  except solver.LimitReached as e:
    run.stopped(e.limit, str(e))
  except solver.GraphTooLarge as e:
    warnings.warn(f"ilp: {e}; returning the best expert plan ({expert.name}) instead.", stacklevel=2)
  except RuntimeError:  # No plan of the graph fits in memory.
    pass
  if run.stopped_by is not None:
    warnings.warn(f"ilp: stopped by its {'time budget' if run.stopped_by == 'seconds' else 'memory ceiling'} "
                  f"({run.message}); returning its best plan so far.", stacklevel=2)
  decisions, cost = run.best
  if progress is not None:
    progress(simulations, float(cost.step_time))
  env = searcher(problem, env_config(problem, config.action_space, config.max_decisions)).env
  target = {t.target: i for i, t in enumerate(env.targets)}
  action_ids = tuple(target[d.target] * env.config.max_axes + problem.mesh.axis_index(d.axis) for d in decisions)
  return SearchResult(decisions=decisions, cost=cost, trace=run.trace, simulations=simulations,
                      seconds=run.elapsed(), actions=[env.action_name(a) for a in action_ids],
                      objective=run.trace[-1].objective, setup_seconds=setup or run.elapsed(),
                      action_ids=action_ids, stopped_by=run.stopped_by, lower_bound=lower_bound)


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


def _untie(graph: strategy_graph.ProgramGraph, run: _Run, simulations: int, deadline: float) -> int:
  """Local improvement of the best plan over untied classes until `deadline` (monotonic)
  or a round without improvement: each round prices, for one class node with tied
  classes, every change of one of its classes to other axes of its domain (in one batch
  of the simulator) and keeps the best that improves. Returns the simulations."""
  problem = run.problem
  tied = [(members, domain) for members, domain in zip(graph.members, graph.domains) if len(members) > 1]
  stale = turn = 0
  while stale < len(tied) and time.monotonic() < deadline:
    run.limits.check("untying the layers")
    members, domain = tied[turn % len(tied)]
    turn += 1
    current = _assignment(graph, run.best[0])
    candidates = [{**current, m: axes} for m in members for axes in domain if axes != current.get(m, ())]
    plans = [graph.decisions_of(plan) for plan in candidates]
    costs = problem.costs(plans)
    simulations += len(plans)
    best = min(range(len(plans)), key=lambda i: plan_objective(problem, costs[i]), default=None)
    stale = 0 if best is not None and run.offer(plans[best], costs[best], simulations) else stale + 1
  return simulations


def _assignment(graph: strategy_graph.ProgramGraph, decisions: Sequence[Decision]) -> dict[int, tuple[int, ...]]:
  """Class -> axes (indices) of class decisions, in the order of their first decisions."""
  assignment: dict[int, tuple[int, ...]] = {}
  for d in decisions:
    axis, cls = graph.problem.mesh.axis_index(d.axis), int(d.target)
    if axis not in assignment.get(cls, ()):
      assignment[cls] = (*assignment.get(cls, ()), axis)
  return assignment
