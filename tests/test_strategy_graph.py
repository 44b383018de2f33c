"""The strategy graph of a program: its cost of a plan is the simulator's, on every zoo family,
for plans that put a named dimension on one mesh axis or on two."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from automap_rl import solver, strategy_graph, tactics, workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from automap_rl.sharding import Decision

MESHES = {
  "llama": "data=2,fsdp=2,model=2",
  "moe": "data=2,fsdp=2,model=2",
}  # Others: data=2,model=2.


def _random_assignments(graph: strategy_graph.ProgramGraph, rng: np.random.Generator, count: int):
  for density in np.linspace(0.2, 0.8, count):
    yield {
      c: d[int(rng.integers(1, len(d)))]
      for c, d in zip(graph.classes, graph.domains)
      if len(d) > 1 and rng.random() < density
    }


# `make test` checks one dense transformer; `make test-all` every family.
QUICK = ("gpt",)


def _graph_peak(problem: Problem, decisions) -> float:
  """The simulator's peak memory of a plan as the strategy graph counts it: every operand
  copy gathered for one read alone at the peak, where the simulator holds the largest."""
  transient = np.asarray(problem.cost_terms(decisions).transient_bytes, np.float64)
  return float(problem.cost(decisions).peak_memory) + transient.sum() - transient.max(initial=0.0)


@pytest.mark.parametrize(
  "family",
  [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in workloads.FAMILIES],
)
def test_graph_cost_of_a_plan_is_the_simulator_cost(family):
  problem = Problem.build(
    workloads.make_workload(family, abstract=True).trace(),
    make_mesh(MESHES.get(family, "data=2,model=2"), "h100"),
  )
  experts = tactics.applicable(problem)
  graph = strategy_graph.build(problem, strategy_graph.order_from(problem, experts["fsdp"]))
  assignments = list(_random_assignments(graph, np.random.default_rng(0), 4))
  assert any(len(axes) == 2 for a in assignments for axes in a.values())  # Some dims on two axes.
  assignments += [
    a for a in (graph.assignment_of(plan) for plan in experts.values()) if a is not None
  ]
  assert graph.assignment_of(experts["fsdp"]) is not None  # The order keeps FSDP's.
  local = strategy_graph.local_costs(problem)
  static_shares = Problem(
    problem.program,
    problem.named,
    problem.mesh,
    problem.sigs,
    dataclasses.replace(
      problem.tables, shared_slot_runs=np.zeros_like(problem.tables.shared_slot_runs)
    ),
  )
  for assignment in assignments:
    choice = graph.choice(assignment)
    decisions = graph.decisions(choice)
    assert graph.assignment(choice) == assignment
    cost = local.cost(decisions)
    assert solver.plan_cost(graph.graph, choice) == pytest.approx(float(cost.step_time), rel=1e-5)
    # Combining merges latencies: the simulator's own cost, its shared reads at their
    # static shares, is at most the graph's; reads that resolve apart only add to it.
    assert float(static_shares.cost(decisions).step_time) <= float(cost.step_time) * (1 + 1e-6)
    assert float(problem.cost(decisions).step_time) >= float(
      static_shares.cost(decisions).step_time
    ) * (1 - 1e-6)
    assert solver.peak_usage(graph.graph, choice) == pytest.approx(
      _graph_peak(local, decisions), rel=1e-5
    )
    assert not solver.is_feasible(graph.graph, choice) or bool(cost.fits)


def test_an_expert_plan_maps_to_the_graph_plan_that_resolves_like_it():
  problem = Problem.build(
    workloads.make_workload(
      "gpt:layers=2,d_model=64,heads=4,seq=32,vocab=128,batch=8", abstract=True
    ).trace(),
    make_mesh("data=2,model=4", "h100"),
  )
  plan = tactics.data_megatron(problem)
  graph = strategy_graph.build(problem, strategy_graph.order_from(problem, plan))
  choice = graph.choice(graph.assignment_of(plan))
  local = strategy_graph.local_costs(problem)
  assert solver.plan_cost(graph.graph, choice) == pytest.approx(
    float(local.cost(plan).step_time), rel=1e-5
  )
  # A class decided on two axes takes the pair, in its order.
  cls = next(c for c, d in zip(graph.classes, graph.domains) if (0, 1) in d and (1, 0) in d)
  assert graph.assignment_of([Decision(cls, "data"), Decision(cls, "model")]) == {cls: (0, 1)}
  assert graph.assignment_of([Decision(cls, "model"), Decision(cls, "data")]) == {cls: (1, 0)}
  # Two classes of one op on one axis, out of the graph's order, resolve otherwise: no assignment.
  rank = {c: i for i, c in enumerate(graph.order)}
  earlier, later = next(
    sorted(pair, key=rank.__getitem__) for pair in _shared_pairs(problem, "model")
  )
  assert graph.assignment_of([Decision(earlier, "model"), Decision(later, "model")]) == {
    earlier: (1,),
    later: (1,),
  }
  assert graph.assignment_of([Decision(later, "model"), Decision(earlier, "model")]) is None


def _shared_pairs(problem: Problem, axis: str):
  """Pairs of classes on two factors of one op signature that both divide by `axis`."""
  size = problem.mesh.axis_sizes[problem.mesh.axis_index(axis)]
  for classes, sizes in zip(problem.sigs.op_class, problem.sigs.op_size):
    able = sorted({int(c) for c, n in zip(classes, sizes) if c >= 0 and n % size == 0})
    yield from ((a, b) for i, a in enumerate(able) for b in able[i + 1 :])


def test_one_axis_per_dimension_is_the_old_space_and_misses_fsdp_megatron():
  problem = Problem.build(
    workloads.make_workload(
      "gpt:layers=2,d_model=64,heads=4,seq=32,vocab=128,batch=8", abstract=True
    ).trace(),
    make_mesh("data=2,model=4", "h100"),
  )
  plan = tactics.fsdp_megatron(problem)  # Stored weights over data besides Megatron's model axis.
  single = strategy_graph.build(
    problem, strategy_graph.order_from(problem, plan, max_axes=1), max_axes=1
  )
  assert all(len(axes) <= 1 for d in single.domains for axes in d)
  assert single.assignment_of(plan) is None
  order = strategy_graph.order_from(problem, plan)
  paired = strategy_graph.build(problem, order)
  assignment = paired.assignment_of(plan)
  assert assignment is not None and any(len(axes) == 2 for axes in assignment.values())
  local = strategy_graph.local_costs(problem)
  assert solver.plan_cost(paired.graph, paired.choice(assignment)) == pytest.approx(
    float(local.cost(plan).step_time), rel=1e-5
  )
  with pytest.raises(ValueError, match="max_axes must be 1 or 2"):
    strategy_graph.build(problem, order, max_axes=3)


def test_every_graph_plan_without_forbidden_entries_is_an_assignment():
  problem = Problem.build(
    workloads.make_workload("mlp", abstract=True).trace(), make_mesh("data=2,model=2", "h100")
  )
  graph = strategy_graph.build(problem)
  # A site strategy that disagrees with a class choice is forbidden on their edge.
  choice = graph.choice({})
  site = next(i for i, s in enumerate(graph.sites) if s.num_strategies > 1)
  choice[len(graph.classes) + site] = 1
  assert not solver.is_feasible(graph.graph, choice)


def test_live_pieces_sum_to_the_profile():
  profile = np.array([0.0, 3.0, 5.0, 2.0, 2.0, 7.0, 0.0, 1.0])
  total = np.zeros_like(profile)
  for start, end, amount in strategy_graph.live_pieces(profile):
    assert amount > 0
    total[start:end] += amount
  np.testing.assert_allclose(total, profile)


def test_tied_layers_share_nodes_and_the_graph_cost_is_still_the_simulator_cost():
  problem = Problem.build(
    workloads.make_workload(
      "gpt:layers=6,d_model=64,heads=4,seq=32,vocab=128,batch=8", abstract=True
    ).trace(),
    make_mesh("data=2,model=4", "h100"),
  )
  tie = strategy_graph.tied_classes(problem)
  assert len(set(tie.tolist())) < len(tie)  # The six layers' per-layer classes tie.
  untied = strategy_graph.build(problem)
  tied = strategy_graph.build(problem, tie=tie)
  assert tied.tied and not untied.tied
  assert (
    tied.graph.num_nodes < untied.graph.num_nodes / 2
    and tied.graph.num_edges < untied.graph.num_edges / 2
  )
  local = strategy_graph.local_costs(problem)
  rng = np.random.default_rng(1)
  for _ in range(4):
    assignment = {
      m: axes
      for members, domain in zip(tied.members, tied.domains)
      if len(domain) > 1 and rng.random() < 0.5
      for axes in [domain[int(rng.integers(1, len(domain)))]]
      for m in members
    }
    choice = tied.choice(assignment)
    assert tied.assignment(choice) == assignment
    cost = local.cost(tied.decisions(choice))
    assert solver.plan_cost(tied.graph, choice) == pytest.approx(float(cost.step_time), rel=1e-5)
    assert solver.peak_usage(tied.graph, choice) == pytest.approx(
      _graph_peak(local, tied.decisions(choice)), rel=1e-5
    )
  # An assignment that splits tied classes is no plan of the tied graph.
  members = next(m for m in tied.members if len(m) > 1)
  axes = next(d[1] for m, d in zip(tied.members, tied.domains) if m == members)
  with pytest.raises(ValueError, match="tied"):
    tied.choice({members[0]: axes})
  assert tied.assignment_of([Decision(members[0], problem.mesh.axis_names[axes[0]])]) is None
