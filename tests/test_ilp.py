"""The ILP agent: never worse than the best expert on the smoke split; its plan lowers."""

from __future__ import annotations

import pytest

import agents
from agents import ilp
from agents.registry import AGENTS, run_agent
from automap_rl import strategy_graph, workloads
from automap_rl.problem import Problem

GPT = "gpt:layers=1,d_model=32,heads=4,seq=16,vocab=64,batch=8"


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) for c in workloads.load_cases("smoke")], ids=lambda c: c.name)
def test_ilp_plan_is_at_least_as_good_as_the_best_expert(case):
  problem = Problem.build(case.make_workload().trace(), case.make_mesh())
  _, expert, expert_cost = ilp.best_expert(problem)
  graph = strategy_graph.build(problem, strategy_graph.order_from(problem, expert))
  assert graph.assignment_of(expert) is not None  # The warm start is a plan of the graph.
  result = run_agent("ilp", problem, seed=0, budget=15.0)
  assert bool(result.cost.fits)
  assert result.step_time <= float(expert_cost.step_time) * (1 + 1e-6)
  assert float(problem.cost(result.decisions).step_time) == pytest.approx(result.step_time)
  assert result.objective <= 1.0 + 1e-6


@pytest.mark.slow
def test_ilp_plan_lowers_and_computes_the_same_numbers():
  assert "ilp" in AGENTS
  w = workloads.make_workload(GPT)
  plan = agents.partition(w.step, *w.args, mesh="data=2,model=4", hardware="h100", agent="ilp", budget=10.0,
                          seed=0, arg_names=w.arg_names, arg_roles=w.arg_roles)
  assert plan.search.step_time <= float(ilp.best_expert(plan.problem)[2].step_time) * (1 + 1e-6)
  assert plan.check_numerics().compiled is not None  # Raises NumericsError on a mismatch.
