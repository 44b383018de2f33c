"""The ILP agent on the smoke split: never worse than the best expert, and its plan lowers
and computes the same numbers as the unpartitioned step."""

from __future__ import annotations

import pytest

import agents
from agents import Seconds, ilp
from automap_rl import strategy_graph, tactics, workloads


@pytest.mark.slow
@pytest.mark.parametrize("case", workloads.load_cases("smoke"), ids=lambda c: c.name)
def test_ilp_plan_beats_the_best_expert_and_lowers(case):
  w = case.make_workload(abstract=False)
  plan = agents.partition(w.step, *w.args, mesh=case.make_mesh(), agent="ilp", budget=Seconds(15), seed=0,
                          arg_names=w.arg_names, arg_roles=w.arg_roles)
  expert = tactics.best_expert_plan(plan.problem)
  graph = strategy_graph.build(plan.problem, strategy_graph.order_from(plan.problem, expert.decisions))
  if graph.assignment_of(expert.decisions) is None:  # Outside the graph (a class on two axes).
    assert expert.name.startswith("fsdp")
  assert bool(plan.search.cost.fits)
  assert plan.search.step_time <= float(expert.cost.step_time) * (1 + 1e-6)
  assert float(plan.problem.cost(plan.search.decisions).step_time) == pytest.approx(plan.search.step_time)
  assert plan.check().compiled is not None  # Raises NumericsError on a mismatch.


def test_a_graph_too_large_for_the_solver_returns_the_best_expert_with_a_warning(monkeypatch):
  """A strategy graph whose reduction leaves more pair-cost entries than the solver can set
  up within a time limit (wresnet-6.8b on 2x4x8: 186 million) is not solved for minutes
  past the limit: the agent warns and returns the best expert plan."""
  import importlib
  from automap_rl.mesh import make_mesh
  from automap_rl.problem import Problem
  monkeypatch.setattr(importlib.import_module("automap_rl.solver.solve"), "MAX_PAIR_ENTRIES", 0)
  workload = workloads.make_workload("mlp", abstract=True)
  problem = Problem.build(workload.trace(), make_mesh("data=2,model=4", "h100"))
  expert_cost = tactics.best_expert_plan(problem).cost
  with pytest.warns(UserWarning, match="pair-cost entries"):
    result = ilp.search(problem, budget=Seconds(5))
  assert result.cost.step_time == pytest.approx(float(expert_cost.step_time))
