"""The ILP baseline: Alpa's intra-op integer program on the program's strategy graph.

The plan space is `automap_rl.strategy_graph`'s: at most one mesh axis per named dimension,
decided in a fixed class order, which this agent takes from the best expert plan (its
classes first) so that the expert is a plan of the graph, the warm start. The graph is
solved by `automap_rl.solver.solve`, the same core that solves the IOPDDL contest problems:
exact reductions, Lagrangian pricing of the memory rows with MIP crossovers, then the whole
problem as one MIP (HiGHS, via highspy) when it is small, else large-neighbourhood MIPs,
all within the time limit and never leaving the memory limit.

Why HiGHS: the problem is a MIP with a linear objective over one-hot strategy choices,
pair terms linearised by marginal constraints and knapsack-like memory rows; HiGHS is an
LP-based branch and bound with good LP duals for exactly this shape, gives proven bounds
(optimality of the whole MIP on small graphs), takes a warm start and a time limit, and
is a pip wheel. CP-SAT would need integer costs (seconds scaled and rounded) and its
strength, clause learning on tight combinatorics, does not help the weak coupling of
these graphs.

The result's plan is a decision list over named dimensions, resolved, simulated and
lowered like any other; its cost is the simulator's (equal to the graph's). The graph's
cost of every plan equals the simulator's step time and its peak usage the simulator's
peak memory, so the plan fits in memory whenever some plan of the graph does.
"""

from __future__ import annotations

import dataclasses
import time
import warnings


from agents.base import Budget, Progress, SearchResult, Seconds, TracePoint, env_config, searcher
from automap_rl import simulator, solver, strategy_graph, tactics
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from envs.tables import objective as env_objective, replicated_base


@dataclasses.dataclass(frozen=True)
class ILPConfig:
  """The ILP agent.

  Attributes:
    seconds: the solver's time limit when the budget gives none.
    warm_start: start from the best expert plan (else from nothing; the class order is
      then by id).
    action_space: the environment action space the result's `action_ids` are encoded in
      (plans are named-dimension decisions).
    max_decisions: that environment's capacity in class decisions.
  """

  seconds: float = 20.0
  warm_start: bool = True
  action_space: str = "named_dims"
  max_decisions: int = 256


def objective(problem: Problem, cost: simulator.Cost) -> float:
  """The environment's objective of a cost (1.0 is the replicated plan)."""
  config = env_config(problem, "named_dims", 1)
  return float(env_objective(config, cost, replicated_base(config, problem), problem.tables.hbm_bytes))


def search(problem: Problem, config: ILPConfig = ILPConfig(), seed: int = 0, budget: Budget | int | str = Seconds(20),
           progress: Progress | None = None) -> SearchResult:
  """Builds the strategy graph (setup, not counted against the limit, as other agents'
  environment builds are not: a slow first compile must not change the plan), solves it
  within the time limit (the budget's seconds,
  else `config.seconds`) from the best expert, and returns the solver's plan.

  A simulation is a complete plan simulated: the experts and the result (the graph's
  per-site terms, evaluated once in batches, are setup), so a simulations budget does not
  bound this agent; its time limit does. The seed drives the solver's random choices; its stages stop on the wall clock, so two
  runs agree when the whole MIP is solved to optimality (small graphs) and can differ
  otherwise. When the graph has no plan within the memory limit (the solver finds none),
  the best expert plan is returned; so it is, with a warning, when the graph is too large
  for the solver (`solver.GraphTooLarge`).
  """
  start = time.perf_counter()
  budget = Budget.of(budget)
  limit = budget.seconds if budget.seconds is not None else config.seconds
  expert = tactics.best_expert_plan(problem)
  expert_name, expert_cost = expert.name, expert.cost
  order = strategy_graph.order_from(problem, expert.decisions if config.warm_start else ())
  graph = strategy_graph.build(problem, order)
  simulations = len(tactics.applicable(problem)) + 1
  warm = graph.assignment_of(list(expert.decisions)) if config.warm_start else None
  setup = time.perf_counter() - start
  trace = [TracePoint(0, setup, float(expert_cost.step_time), objective(problem, expert_cost))]
  try:
    result = solver.solve(graph.graph, timeout_s=limit, seed=seed,
                          warm_start=None if warm is None else graph.choice(warm))
    decisions = graph.decisions(result.choice)
  except solver.GraphTooLarge as e:
    warnings.warn(f"ilp: {e}; returning the best expert plan ({expert_name}) instead.", stacklevel=2)
    decisions = None
  except RuntimeError:  # No plan of the graph fits in memory.
    decisions = None
  cost = None if decisions is None else problem.cost(decisions)
  if cost is None or objective(problem, cost) > objective(problem, expert_cost):
    # The expert, as class decisions: no graph plan fits, or the expert is outside the
    # graph's plans (it gives a named dimension two axes, as FSDP does on a data x fsdp
    # x model mesh) and beats what the solver found.
    dec_class, dec_axis = problem.encode(expert.decisions)
    decisions = [Decision(int(c), problem.mesh.axis_names[a]) for c, a in zip(dec_class, dec_axis)]
    cost = problem.cost(decisions)
  if progress is not None:
    progress(simulations, float(cost.step_time))
  seconds = time.perf_counter() - start
  trace.append(TracePoint(simulations, seconds, float(cost.step_time), objective(problem, cost)))
  env = searcher(problem, env_config(problem, config.action_space, config.max_decisions)).env
  target = {t.target: i for i, t in enumerate(env.targets)}
  action_ids = tuple(target[d.target] * env.config.max_axes + problem.mesh.axis_index(d.axis) for d in decisions)
  return SearchResult(decisions=decisions, cost=cost, trace=trace, simulations=simulations, seconds=seconds,
                      actions=[env.action_name(a) for a in action_ids], objective=trace[-1].objective,
                      setup_seconds=setup, action_ids=action_ids)
