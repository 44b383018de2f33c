"""Search agents: seeded, within budget, consistent with the simulator, and MCTS finds expert
plans."""

import functools

import numpy as np
import pytest
from toy_hardware import H100_WORK_ONLY

import agents
from agents import Budget, Seconds, Simulations
from agents import base as agents_base
from automap_rl import tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem

SMALL = "gpt:layers=2,d_model=256,heads=4,seq=64,vocab=256,batch=16"


@functools.cache
def problem(spec: str = SMALL, mesh: str = "data=2,model=4") -> Problem:
  return Problem.build(
    workloads.make_workload(spec, abstract=True).trace(), make_mesh(mesh, H100_WORK_ONLY)
  )


def best_expert_step_time(p: Problem) -> float:
  return float(tactics.best_expert_plan(p).cost.step_time)


# The ILP's graph build is slow; Alpa's seed and budget have their own test (`test_alpa`).
@pytest.mark.parametrize(
  "name",
  [
    n if n not in ("ilp", "alpa") else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(agents.AGENTS)
  ],
)
def test_same_seed_same_plan_and_budget_respected(name):
  p = problem()
  a = agents.run_agent(name, p, seed=3, budget=150)
  b = agents.run_agent(name, p, seed=3, budget=150)
  assert a.decisions == b.decisions
  assert [(t.simulations, t.step_time) for t in a.trace] == [
    (t.simulations, t.step_time) for t in b.trace
  ]
  assert 0 < a.simulations <= 150
  # The reported cost is the simulator's cost of the returned plan, and the trace is its history.
  assert float(a.cost.step_time) == pytest.approx(a.trace[-1].step_time, rel=1e-4)
  assert float(a.cost.step_time) == pytest.approx(
    float(p.plan_cost(a.decisions, a.pipeline).step_time), rel=1e-4
  )
  times = [t.step_time for t in a.trace]
  assert times == sorted(times, reverse=True)
  assert all(t.simulations <= a.simulations for t in a.trace)
  assert len(a.actions) == len(a.action_ids)
  assert len(a.decisions) == sum(
    n.startswith("shard ") for n in a.actions
  )  # A pipeline action decides no sharding.
  # The encoded action list carries the plan: replayed through the environment it gives the same
  # cost.
  space = getattr(
    agents.AGENTS[name][0](), "action_space", "groups"
  )  # The ILP's plans are named dims.
  search = agents_base.searcher(p, agents_base.env_config(p, space, 256))
  replayed = p.plan_cost(
    search.decisions(a.action_ids), a.pipeline
  )  # Inside the stages of a pipelined plan.
  assert float(replayed.step_time) == pytest.approx(float(a.cost.step_time), rel=1e-6)


def test_seconds_budget_stops_the_search():
  p = problem()
  agents.run_agent("random", p, budget=1)  # Compile first.
  result = agents.run_agent("random", p, seed=0, budget=Budget(seconds=0.5))
  assert result.seconds < 5.0
  assert result.simulations > 0


def test_budget_parsing():
  assert Budget.of(10) == Budget(simulations=10)
  assert Budget.of(np.int64(10)) == Budget(simulations=10) == Simulations(10)
  assert Seconds(2.5) == Budget(seconds=2.5)
  for ambiguous in (2.5, np.float32(500), True):
    with pytest.raises(TypeError, match="no unit"):
      Budget.of(ambiguous)
  assert Budget.of("30s") == Budget(seconds=30.0)
  with pytest.raises(ValueError):
    Budget()


def test_mcts_matches_the_best_expert_and_beats_random_at_equal_budget():
  p = problem()
  mcts = agents.run_agent("mcts", p, seed=0, budget=600)
  assert mcts.step_time <= best_expert_step_time(p) * 1.0001
  random_best = min(agents.run_agent("random", p, seed=s, budget=600).step_time for s in range(2))
  assert mcts.step_time <= random_best * 1.0001


def test_greedy_improves_on_replicated():
  p = problem()
  result = agents.run_agent("greedy", p, budget=1000)
  assert result.step_time < float(p.cost([]).step_time)
  assert result.objective < 1.0


@pytest.mark.slow
def test_agents_on_a_flat_mesh_and_other_action_spaces():
  p = problem("mlp:layers=2,width=512,batch=256", "data=8")
  result = agents.run_agent(
    "mcts", p, budget=100, config=agents.MCTSConfig(action_space="arg_dims")
  )
  assert result.simulations <= 100
  assert float(result.cost.step_time) == pytest.approx(
    float(p.cost(result.decisions).step_time), rel=1e-4
  )
