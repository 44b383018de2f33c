"""The ILP agent on the smoke split: never worse than the best expert, and its plan lowers
and computes the same numbers as the unpartitioned step."""

from __future__ import annotations

import pytest

import agents
from agents import ilp
from automap_rl import strategy_graph, workloads


@pytest.mark.slow
@pytest.mark.parametrize("case", workloads.load_cases("smoke"), ids=lambda c: c.name)
def test_ilp_plan_beats_the_best_expert_and_lowers(case):
  w = case.make_workload(abstract=False)
  plan = agents.partition(w.step, *w.args, mesh=case.make_mesh(), agent="ilp", budget=15.0, seed=0,
                          arg_names=w.arg_names, arg_roles=w.arg_roles)
  _, expert, expert_cost = ilp.best_expert(plan.problem)
  graph = strategy_graph.build(plan.problem, strategy_graph.order_from(plan.problem, expert))
  assert graph.assignment_of(expert) is not None  # The warm start is a plan of the graph.
  assert bool(plan.search.cost.fits)
  assert plan.search.step_time <= float(expert_cost.step_time) * (1 + 1e-6)
  assert float(plan.problem.cost(plan.search.decisions).step_time) == pytest.approx(plan.search.step_time)
  assert plan.check_numerics().compiled is not None  # Raises NumericsError on a mismatch.
