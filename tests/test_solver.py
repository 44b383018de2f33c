"""Tests for automap_rl.solver: strategy graphs, the IOPDDL format and the solver."""

import gzip
import importlib
import itertools
import json
import time
from pathlib import Path

import highspy
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automap_rl.solver import (
  FORBIDDEN,
  LimitReached,
  Limits,
  StrategyGraph,
  evaluate,
  iopddl,
  is_feasible,
  load_problem,
  peak_usage,
  plan_cost,
  read_solution,
  separable_lower_bound,
  solve,
  tile,
  write_solution,
)
from automap_rl.solver.reduce import GraphTooLarge, reduce_graph

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "iopddl"
needs_data = pytest.mark.skipif(
  not (DATA / "example.json").exists(), reason=f"IOPDDL instances not found in {DATA}"
)


def brute_force(graph: StrategyGraph) -> tuple[int | float | None, list[int] | None]:
  """Cheapest feasible plan by enumeration: (cost, plan), (None, None) if none."""
  best = (None, None)
  for plan in itertools.product(*(range(k) for k in graph.num_strategies)):
    verdict = evaluate(graph, list(plan))
    if verdict.feasible and (best[0] is None or verdict.cost < best[0]):
      best = (verdict.cost, list(plan))
  return best


def reference_cost(lists: dict, plan: list[int]) -> int:
  """Plan cost straight from the nested lists, as the contest defines it."""
  cost = sum(c[s] for c, s in zip(lists["costs"], plan))
  for (u, v), costs in zip(lists["edges"], lists["edge_costs"]):
    cost += costs[plan[u] * len(lists["costs"][v]) + plan[v]]
  return cost


def reference_peak(lists: dict, plan: list[int]) -> int:
  horizon = max((end for _, end in lists["intervals"]), default=0)
  return max(
    (
      sum(u[s] for u, s, (a, b) in zip(lists["usages"], plan, lists["intervals"]) if a <= t < b)
      for t in range(horizon)
    ),
    default=0,
  )


@st.composite
def graph_lists(draw, max_nodes: int = 5, forbidden: bool = True):
  """Nested lists of a small random problem (parallel edges and self-loops included)."""
  n = draw(st.integers(1, max_nodes))
  ks = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
  value = st.integers(0, 70).map(lambda x: FORBIDDEN if forbidden and x > 60 else x)
  costs = [draw(st.lists(value, min_size=k, max_size=k)) for k in ks]
  usages = [draw(st.lists(st.integers(0, 9), min_size=k, max_size=k)) for k in ks]
  intervals = [sorted(draw(st.lists(st.integers(0, 8), min_size=2, max_size=2))) for _ in range(n)]
  edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
  edge_costs = [
    draw(st.lists(value, min_size=ks[u] * ks[v], max_size=ks[u] * ks[v])) for u, v in edges
  ]
  limit = draw(st.none() | st.integers(0, 25))
  return dict(
    costs=costs,
    usages=usages,
    intervals=intervals,
    edges=[list(e) for e in edges],
    edge_costs=edge_costs,
    limit=limit,
  )


def to_graph(lists: dict) -> StrategyGraph:
  return StrategyGraph.from_lists(
    lists["costs"],
    lists["usages"],
    lists["intervals"],
    lists["edges"],
    lists["edge_costs"],
    lists["limit"],
  )


@needs_data
def test_example_optimum_matches_brute_force():
  graph = load_problem(DATA / "example.json")
  cost, plan = brute_force(graph)
  assert cost == 445 and plan == [0, 0, 2, 1, 0]  # the contest's own example answer
  result = solve(graph, timeout_s=5, seed=0)
  assert result.feasible and result.cost == cost
  assert evaluate(graph, result.choice).cost == cost
  assert result.lower_bound is not None and result.lower_bound <= cost


@needs_data
def test_evaluate_rejects_with_the_contest_reason():
  graph = load_problem(DATA / "example.json")
  assert evaluate(graph, [0, 0, 2, 1]).reason == iopddl.REASON_SIZE
  assert evaluate(graph, [0, 0, 3, 1, 0]).reason == iopddl.REASON_INDEX
  assert evaluate(graph, [0, -1, 2, 1, 0]).reason == iopddl.REASON_INDEX
  # Node 2's strategy 1 uses 20: 10 + 25 + 20 = 55 > 50 during [50, 70).
  over = evaluate(graph, [0, 0, 1, 1, 0])
  assert (over.feasible, over.reason, over.peak_usage, over.cost) == (
    False,
    iopddl.REASON_USAGE,
    55,
    415,
  )
  ok = evaluate(graph, [0, 0, 2, 1, 0])
  assert (ok.feasible, ok.reason, ok.cost, ok.peak_usage) == (True, None, 445, 50)


def test_evaluate_rejects_forbidden_strategies_and_pairs():
  graph = StrategyGraph.from_lists(
    [[1, FORBIDDEN], [2, 3]],
    [[0, 0], [0, 0]],
    [[0, 1], [0, 1]],
    [[0, 1]],
    [[0, FORBIDDEN, 5, 6]],
    usage_limit=10,
  )
  assert evaluate(graph, [1, 0]).reason == iopddl.REASON_FORBIDDEN
  bad_pair = evaluate(graph, [0, 1])
  assert bad_pair.reason == iopddl.REASON_FORBIDDEN and bad_pair.cost == 1 + 3 + FORBIDDEN
  assert evaluate(graph, [0, 0]) == iopddl.Evaluation(3, True, 0, None)
  assert not is_feasible(graph, [0, 1]) and is_feasible(graph, [0, 0])


def test_reduction_refuses_a_grouping_beyond_its_entry_limit_before_building_it():
  """Node 1 has one strategy, so a neighbour decides it and it merges into that group:
  the graph's 3 + 4 entries (edges 0-1 and 1-2) become one 3 x 4 matrix between node 0's
  group and node 2's. The limit counts the entries of edges between groups before they
  are allocated. Within it the reduction goes on: the matrix's rows are equal, so node 0's
  group keeps its cheapest strategy alone (dominance) and decides node 2's."""
  graph = StrategyGraph.from_lists(
    [[1, 2, 3], [0], [1, 1, 1, 1]],
    [[0] * 3, [0], [0] * 4],
    [[0, 1]] * 3,
    [[0, 1], [1, 2]],
    [[1, 2, 3], [4, 5, 6, 7]],
    usage_limit=None,
  )
  assert reduce_graph(graph, max_entries=12).num_groups == 1
  with pytest.raises(GraphTooLarge, match="groups into 12 pair-cost entries, more than the 11"):
    reduce_graph(graph, max_entries=11)


def test_plan_cost_sums_forbidden_values_exactly():
  # Two forbidden picks overflow int64; the contest sums them in 128 bits.
  graph = StrategyGraph.from_lists([[FORBIDDEN * 5]] * 3, [[0]] * 3, [[0, 0]] * 3, [], [], None)
  assert plan_cost(graph, [0, 0, 0]) == 15 * FORBIDDEN


@settings(max_examples=60, deadline=None)
@given(graph_lists(), st.data())
def test_plan_cost_and_peak_match_a_direct_reference(lists, data):
  graph = to_graph(lists)
  plan = [data.draw(st.integers(0, len(c) - 1)) for c in lists["costs"]]
  for e, (u, v) in enumerate(lists["edges"]):
    assert graph.edge_matrix(e).shape == (len(lists["costs"][u]), len(lists["costs"][v]))
  assert plan_cost(graph, plan) == reference_cost(lists, plan)
  assert peak_usage(graph, plan) == reference_peak(lists, plan)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_lists())
def test_solve_finds_the_brute_force_optimum(lists):
  graph = to_graph(lists)
  cost, _ = brute_force(graph)
  if cost is None:
    with pytest.raises((RuntimeError, ValueError)):
      solve(graph, timeout_s=2, seed=0)
    return
  result = solve(graph, timeout_s=2, seed=0)
  assert result.cost == cost
  assert evaluate(graph, result.choice).feasible
  assert result.lower_bound is not None and result.lower_bound <= cost + 1e-9 * max(abs(cost), 1)


@given(graph_lists(forbidden=True))
def test_the_separable_lower_bound_bounds_every_allowed_plan(lists):
  """Each node's and edge's cheapest allowed entry, chosen apart, is at most the cost of
  every plan without a forbidden cost (memory ignored), and it is refused where some
  node or edge allows nothing."""
  graph = to_graph({**lists, "limit": None})
  optimum, _ = brute_force(graph)
  try:
    bound = separable_lower_bound(graph)
  except ValueError:
    assert optimum is None
    return
  assert optimum is None or bound <= optimum


def test_the_lower_bound_proves_an_optimum_the_memory_limit_does_not_bind():
  """Without a binding limit the pairwise relaxation of a chain is tight: the bound
  reaches the optimum (and a wrong bound, above some plan's cost, fails here)."""
  rng = np.random.default_rng(0)
  n, k = 12, 3
  costs = rng.integers(0, 100, (n, k)).tolist()
  edge_costs = rng.integers(0, 100, (n - 1, k * k)).tolist()
  graph = StrategyGraph.from_lists(
    costs,
    [[0] * k] * n,
    [[0, 1]] * n,
    [[i, i + 1] for i in range(n - 1)],
    edge_costs,
    usage_limit=None,
  )
  result = solve(graph, timeout_s=3, seed=0)
  assert result.lower_bound == pytest.approx(result.cost)


def test_a_memory_ceiling_stops_the_solver_before_it_has_a_plan():
  graph = to_graph(
    {
      "costs": [[1, 2], [3, 4]],
      "usages": [[1, 1], [1, 1]],
      "intervals": [[0, 1], [0, 1]],
      "edges": [[0, 1]],
      "edge_costs": [[0, 1, 1, 0]],
      "limit": None,
    }
  )
  with pytest.raises(LimitReached, match="resident memory") as raised:
    solve(graph, timeout_s=2, seed=0, limits=Limits(max_resident_bytes=1))
  assert raised.value.limit == "memory"
  with pytest.raises(LimitReached, match="time budget"):
    solve(graph, timeout_s=2, seed=0, limits=Limits(deadline=0.0))


def test_an_allocation_that_would_pass_the_memory_ceiling_stops_before_it_is_made():
  from automap_rl.solver.limits import resident_bytes

  limits = Limits(max_resident_bytes=resident_bytes() + 2**30)
  limits.check("building")
  with pytest.raises(LimitReached, match="and 2.00 GiB to allocate, above the ceiling") as raised:
    limits.check("building", allocating=2**31)
  assert raised.value.limit == "memory"


def test_prices_of_a_segment_no_plan_fits_stay_finite():
  from automap_rl.solver.search import WorkerRole, next_prices

  prices, capacity = np.zeros(3), np.array([10.0, 10.0, 10.0])
  excess = np.array([5.0, -5.0, 0.0])  # Over the limit, well under it, at it.
  for _ in range(5000):  # Far beyond the ~1,750 rounds after which 1.5x a round overflows.
    prices = next_prices(prices, excess, capacity, base=2.0)
  assert np.isfinite(prices).all() and prices[0] == 2.0 * 1e12 and prices[1] == 0.0 == prices[2]
  assert next_prices(np.array([4.0, 4.0, 4.0]), excess, capacity, base=2.0).tolist() == [
    6.0,
    3.2,
    4.0,
  ]
  faster = WorkerRole(price_rise=2.0, price_fall=0.5)
  assert next_prices(
    np.array([4.0, 4.0, 4.0]), excess, capacity, base=2.0, role=faster
  ).tolist() == [8.0, 2.0, 4.0]


def test_solve_handles_float_costs():
  rng = np.random.default_rng(0)
  lists = dict(
    costs=rng.uniform(0, 5, (4, 3)).tolist(),
    usages=rng.uniform(0, 3, (4, 3)).tolist(),
    intervals=[[0, 3], [1, 4], [2, 5], [0, 5]],
    edges=[[0, 1], [1, 2], [2, 3], [3, 0]],
    edge_costs=rng.uniform(0, 5, (4, 9)).tolist(),
    limit=6.0,
  )
  graph = to_graph(lists)
  cost, _ = brute_force(graph)
  result = solve(graph, timeout_s=2, seed=1)
  assert result.cost == pytest.approx(cost)


def test_solve_uses_a_feasible_warm_start():
  lists = dict(
    costs=[[5, 1], [5, 1]],
    usages=[[1, 2], [1, 2]],
    intervals=[[0, 2], [1, 3]],
    edges=[[0, 1]],
    edge_costs=[[0, 9, 9, 0]],
    limit=4,
  )
  graph = to_graph(lists)
  seen = []
  result = solve(graph, timeout_s=2, seed=0, warm_start=[0, 0], progress=lambda *a: seen.append(a))
  assert seen[0][2] == "warm start" and seen[0][1] == 10
  assert result.cost == brute_force(graph)[0] == 2
  with pytest.raises(ValueError, match="warm_start"):
    solve(graph, timeout_s=2, seed=0, warm_start=[0, 2])


def test_solution_files_round_trip(tmp_path):
  path = tmp_path / "plan.txt"
  write_solution(path, np.array([0, 2, 1]))
  assert path.read_text() == "[0, 2, 1]\n"
  path.write_text("# Found solution [0, 0, 0] with cost 9\n[0, 2, 1]\n")
  assert read_solution(path) == [0, 2, 1]
  path.write_text("no plan here\n")
  with pytest.raises(ValueError, match="last line"):
    read_solution(path)


def test_load_problem_names_the_malformed_field(tmp_path):
  problem = {
    "problem": {
      "name": "x",
      "nodes": {"intervals": [[0, 1]], "costs": [[1, 2]], "usages": [[1]]},
      "edges": {"nodes": [], "costs": []},
      "usage_limit": 5,
    }
  }
  path = tmp_path / "bad.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump(problem, f)
  with pytest.raises(ValueError, match=r"bad\.json\.gz: field problem\.nodes\.usages"):
    load_problem(path)
  problem["problem"]["nodes"]["usages"] = [[1, 1]]
  problem["problem"]["edges"] = {"nodes": [[0, 0]], "costs": [[1, 2, 3]]}
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(problem))
  with pytest.raises(ValueError, match=r"field problem\.edges\.costs"):
    load_problem(path)
  del problem["problem"]["edges"]
  path.write_text(json.dumps(problem))
  with pytest.raises(ValueError, match=r"field problem\.edges is missing"):
    load_problem(path)


@needs_data
@pytest.mark.parametrize("name", ["G"])
def test_short_solve_of_a_contest_instance(name):
  graph = load_problem(DATA / f"asplos-2025-iopddl-{name}.json.gz")
  result = solve(graph, timeout_s=8, seed=0)
  verdict = evaluate(graph, result.choice)
  assert verdict.feasible and verdict.cost == result.cost
  best = {
    row.split(",")[0]: int(row.split(",")[1])
    for row in (DATA / "best_known.csv").read_text().split()[1:]
  }
  assert result.cost <= 1.10 * best[name]
  assert result.seconds < 8


def binding_chain(n: int = 40, k: int = 3, seed: int = 0) -> StrategyGraph:
  """A chain whose cheap strategies use more memory than the limit allows everywhere."""
  rng = np.random.default_rng(seed)
  costs = (
    rng.integers(0, 50, (n, k)) + np.arange(k)[::-1] * 40
  ).tolist()  # higher strategies cost less...
  usages = (np.arange(k) * 10 + rng.integers(0, 5, (n, k))).tolist()  # ...and use more memory
  intervals = [[i, i + 6] for i in range(n)]
  return StrategyGraph.from_lists(
    costs,
    usages,
    intervals,
    [[i, i + 1] for i in range(n - 1)],
    rng.integers(0, 30, (n - 1, k * k)).tolist(),
    usage_limit=60,
  )


def test_every_highs_call_gets_a_time_limit_within_the_shared_deadline(monkeypatch):
  """The solve's own timeout is long; a `Limits` deadline 3 s away is the earlier one, and every
  HiGHS call (crossover, whole MIP, neighbourhood) must end by it."""
  search_module = importlib.import_module("automap_rl.solver.search")
  calls = []

  def spying(function):
    def spy(*args, time_limit, **kwargs):
      calls.append(time.monotonic() + time_limit)
      return function(*args, time_limit=time_limit, **kwargs)

    return spy

  for name in ("reoptimize", "recombine"):
    monkeypatch.setattr(search_module, name, spying(getattr(search_module, name)))
  limits = Limits.starting_now(3.0, None)
  result = solve(binding_chain(), timeout_s=600, seed=0, limits=limits)
  assert result.feasible and calls
  assert max(calls) <= limits.deadline


def test_a_highs_call_stops_at_its_time_limit_inside_the_root_node():
  """HiGHS checks its own time limit only at some points (not in the root's cut separation,
  where R's crossovers ran 3-6x past it); the interrupt callbacks stop it at the deadline."""
  from automap_rl.solver.mip import _new_highs

  highs = _new_highs(seed=0, gap=0.0, deadline=time.monotonic() - 1.0)
  lp = highspy.HighsLp()
  lp.num_col_, lp.num_row_ = 2, 1
  lp.col_cost_, lp.col_lower_, lp.col_upper_ = np.array([-1.0, -1.0]), np.zeros(2), np.ones(2)
  lp.row_lower_, lp.row_upper_ = np.array([-np.inf]), np.array([1.5])
  lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
  lp.a_matrix_.start_, lp.a_matrix_.index_ = np.array([0, 2]), np.array([0, 1])
  lp.a_matrix_.value_ = np.array([1.0, 1.0])
  lp.integrality_ = [highspy.HighsVarType.kInteger] * 2
  highs.passModel(lp)
  highs.run()
  assert highs.getModelStatus() == highspy.HighsModelStatus.kInterrupt


def test_a_worker_that_hangs_is_stopped_at_the_timeout_with_its_best_plan(monkeypatch):
  """A stage that never returns (as a HiGHS call past its time limit can) is killed at the
  timeout; the plan and the lower bound the worker reported before it are returned, marked
  as stopped."""
  search_module = importlib.import_module("automap_rl.solver.search")
  monkeypatch.setattr(search_module.Search, "whole_mip", lambda self, time_limit: time.sleep(3600))
  graph = binding_chain()
  result = solve(graph, timeout_s=4, seed=0, workers=1)
  assert result.stopped_by == "seconds" and is_feasible(graph, result.choice)
  assert any("killed at the time limit" in line for line in result.log)
  assert result.lower_bound is not None and result.lower_bound <= result.cost


def test_a_worker_killed_before_its_first_plan_names_the_time_limit(monkeypatch):
  """Killed at the timeout before it found a plan, the search says the time limit
  stopped it (not that no plan is within the usage limit)."""
  search_module = importlib.import_module("automap_rl.solver.search")
  monkeypatch.setattr(search_module.Search, "price", lambda self, **kwargs: time.sleep(3600))
  with pytest.raises(
    LimitReached, match="the time limit came before the solver found a plan"
  ) as error:
    solve(binding_chain(), timeout_s=2, seed=0, workers=1)
  assert error.value.limit == "seconds"


def solver_views(graph: StrategyGraph):
  from automap_rl.solver.local import Layout
  from automap_rl.solver.memory import build_memory

  reduced = reduce_graph(graph)
  memory = build_memory(graph, reduced)
  return reduced, Layout(reduced, memory)


def test_repair_turns_a_plan_over_the_limit_into_one_within_it():
  from automap_rl.solver.local import GroupPlan

  graph = binding_chain()
  reduced, layout = solver_views(graph)
  greedy = np.array(
    [
      int(np.argmin(reduced.unary[reduced.offsets[g] : reduced.offsets[g + 1]]))
      for g in range(reduced.num_groups)
    ]
  )  # the cheapest, heaviest strategies
  plan = GroupPlan(layout, greedy)
  assert np.any(plan.excess() > 0) and not is_feasible(graph, reduced.expand(greedy))
  assert plan.repair(max_switches=200)
  assert np.all(plan.excess() <= 0) and is_feasible(graph, reduced.expand(plan.choice))
  assert np.array_equal(plan.profile, layout.memory.profile(plan.choice))  # kept exactly in step


def test_a_two_group_move_finds_an_improvement_no_single_switch_can():
  """From (0, 0), cost 10: switching either node alone costs 3 + 20 = 23; both together 3 + 3 + 0 =
  6."""
  from automap_rl.solver.local import GroupPlan

  graph = StrategyGraph.from_lists(
    [[0, 3], [0, 3]],
    [[0, 0], [0, 0]],
    [[0, 1], [0, 1]],
    [[0, 1]],
    [[10, 20, 20, 0]],
    usage_limit=None,
  )
  reduced, layout = solver_views(graph)
  plan = GroupPlan(layout, np.zeros(2, np.int64))
  assert plan.descend(np.arange(2)) == 0
  assert plan.descend_pairs() == 1 and plan.choice.tolist() == [1, 1]
  assert plan_cost(graph, reduced.expand(plan.choice)) == 6


def test_a_two_group_move_that_would_break_the_limit_is_not_made():
  from automap_rl.solver.local import GroupPlan

  graph = StrategyGraph.from_lists(
    [[0, 3], [0, 3]], [[1, 5], [1, 5]], [[0, 1], [0, 1]], [[0, 1]], [[10, 20, 20, 0]], usage_limit=9
  )
  _, layout = solver_views(graph)
  plan = GroupPlan(layout, np.zeros(2, np.int64))
  assert plan.descend_pairs() == 0 and plan.choice.tolist() == [0, 0]


def test_the_same_seed_gives_the_same_plan_with_two_workers():
  """Both workers end by proving their plan optimal (the whole MIP), not on the clock."""
  graph = binding_chain(n=16, seed=3)
  first = solve(graph, timeout_s=20, seed=7, workers=2)
  second = solve(graph, timeout_s=20, seed=7, workers=2)
  assert first.stopped_by is None and first.cost == second.cost == first.lower_bound
  assert np.array_equal(first.choice, second.choice)


@needs_data
def test_tiled_copies_cost_and_fit_as_the_original_times_the_copies():
  graph = load_problem(DATA / "example.json")
  tiled = tile(graph, 3)
  assert tiled.num_nodes == 15 and tiled.num_edges == 3 * graph.num_edges
  verdict = evaluate(tiled, [0, 0, 2, 1, 0] * 3)
  assert (
    verdict.feasible and verdict.cost == 3 * 445 and verdict.peak_usage == 50
  )  # copies never overlap in time
  assert not evaluate(tiled, [0, 0, 2, 1, 0] * 2 + [0, 0, 1, 1, 0]).feasible
  with pytest.raises(ValueError, match="copies must be at least 1"):
    tile(graph, 0)


def test_the_shared_best_plan_reaches_the_other_workers_only():
  import multiprocessing

  shared = importlib.import_module("automap_rl.solver.supervise").SharedBest(
    multiprocessing.get_context("fork"), 3
  )
  assert shared.newer(0, worker=1) is None
  shared.publish(np.array([2, 0, 1]), 7.0, worker=0)
  version, plan, cost = shared.newer(0, worker=1)
  assert version == 1 and plan.tolist() == [2, 0, 1] and cost == 7.0
  assert shared.newer(0, worker=0)[1] is None  # its own plan: nothing to adopt
  assert shared.newer(version, worker=1) is None


def test_a_line_meets_the_other_lines_best_plan_at_its_next_crossover():
  """A cheaper plan of another search becomes the line's best and the line's own best is kept
  to merge; a dearer one is kept to merge and the best stays; a line's own plan is neither."""
  import multiprocessing

  from automap_rl.solver.local import GroupPlan
  from automap_rl.solver.mip import group_cost
  from automap_rl.solver.search import Problem, Search
  from automap_rl.solver.supervise import SharedBest

  graph = binding_chain()
  reduced, layout = solver_views(graph)
  plans = []
  for start in (0, 1):
    plan = GroupPlan(layout, np.full(reduced.num_groups, start, dtype=np.int64))
    assert plan.repair(max_switches=200)
    plan.descend(np.arange(reduced.num_groups))
    plans.append(plan.choice)
  costs = [group_cost(reduced, plan) for plan in plans]
  cheap, dear = np.argsort(costs)
  assert costs[cheap] < costs[dear]
  shared = SharedBest(multiprocessing.get_context("fork"), reduced.num_groups)
  problem = Problem(graph, reduced, layout.memory, layout, time.monotonic())
  search = Search(problem, time.monotonic() + 10, 0, Limits(), shared=shared, worker=1)
  assert search.offer(plans[dear], "test")
  shared.publish(plans[cheap], costs[cheap], worker=0)
  search.meet()
  assert search.best_cost == costs[cheap] and np.array_equal(search.best, plans[cheap])
  assert np.array_equal(search.met, plans[dear])
  search.met = None
  search.meet()
  assert search.met is None  # nothing newer
  shared.publish(plans[dear], costs[dear], worker=0)
  search.meet()
  assert search.best_cost == costs[cheap] and np.array_equal(search.met, plans[dear])
  search.met = None
  shared.publish(plans[dear], costs[dear], worker=1)
  search.meet()
  assert search.met is None  # its own plan


def test_bench_reports_why_an_instance_has_no_plan(tmp_path, monkeypatch):
  from automap_rl.solver import bench_iopddl

  problem = {
    "problem": {
      "name": "Z",
      "nodes": {
        "intervals": [[0, 1], [0, 1]],
        "costs": [[1, 2], [3, 4]],
        "usages": [[1, 1], [1, 1]],
      },
      "edges": {"nodes": [[0, 1]], "costs": [[0, 1, 1, 0]]},
      "usage_limit": 5,
    }
  }
  (tmp_path / "asplos-2025-iopddl-Z.json").write_text(json.dumps(problem))
  (tmp_path / "best_known.csv").write_text("instance,best_known_cost\nZ,4\n")
  [row] = bench_iopddl(tmp_path, timeout_s=5, seed=0, workers=0, copies=2)
  assert (row.instance, row.cost, row.best_known, row.feasible, row.failure) == (
    "Z x2",
    8,
    8,
    True,
    None,
  )
  monkeypatch.setattr(importlib.import_module("automap_rl.solver.solve"), "MAX_PAIR_ENTRIES", 3)
  [row] = bench_iopddl(tmp_path, timeout_s=5, seed=0, workers=0)
  assert (
    not row.feasible and row.cost is None and "more than the 3 the solver can set up" in row.failure
  )


def test_the_best_entry_of_each_segment_skips_undefined_gains():
  """A pair whose current entry costs inf has gains inf - inf (NaN): its best entry is still
  one of its own, never past the end of the entries."""
  from automap_rl.solver.local import _segment_argmax

  values = np.array([np.nan, np.nan, 1.0, np.nan, 3.0, 3.0])
  np.testing.assert_array_equal(_segment_argmax(values, np.array([0, 2, 3, 6])), [0, 0, 1])


def test_usage_rows_have_no_power_of_two_scale_to_integers():
  """HiGHS's root mod-k separation works on rows it can scale to integers and checks no
  time limit; on dense usage rows it ran for minutes past a crossover's. The rows the
  crossover adds must have no power-of-two scale that makes them integral."""
  from automap_rl.solver.local import GroupPlan
  from automap_rl.solver.mip import _Model

  graph = binding_chain()
  reduced, layout = solver_views(graph)
  plan = GroupPlan(layout, np.zeros(reduced.num_groups, dtype=np.int64))
  assert plan.repair(max_switches=200)
  model = _Model(reduced, layout.memory, plan.choice, np.ones(reduced.num_groups, dtype=bool), None)
  matrix, upper = model.usage_rows(np.arange(len(layout.memory.capacity)))
  values = np.concatenate([matrix.data, upper])
  assert len(matrix.data) > 0
  assert not any(
    np.all(np.mod(values * 2.0**k, 1.0) == 0) for k in range(-32, 33)
  )  # 2**52 makes any float whole.


def test_a_merge_of_two_plans_takes_the_cheapest_mix_within_the_limit():
  """`recombine` re-chooses each group where the plans differ between their two strategies: on a
  12-group chain it comes within 2% of the cheapest of the 2**12 mixes within the limit (its
  rounding of the LP relaxation is not exact), well below the plan it starts from."""
  from automap_rl.solver.local import GroupPlan
  from automap_rl.solver.mip import group_cost, recombine

  graph = binding_chain(n=12)
  reduced, layout = solver_views(graph)
  cheapest = np.array(
    [int(np.argmin(reduced.unary[reduced.offsets[g] : reduced.offsets[g + 1]])) for g in range(12)]
  )
  plan = GroupPlan(layout, np.zeros(12, dtype=np.int64))
  assert plan.repair(max_switches=200) and np.any(layout.memory.excess(cheapest) > 0)
  best = plan.choice
  mixes = [
    np.where(np.array(bits, bool), cheapest, best) for bits in itertools.product([0, 1], repeat=12)
  ]
  fitting = [m for m in mixes if np.all(layout.memory.excess(m) <= 0)]
  optimum = min(group_cost(reduced, m) for m in fitting)
  result = recombine(reduced, layout.memory, best, [cheapest], time_limit=30.0, seed=0)
  assert optimum <= result.cost <= 1.02 * optimum < 0.75 * group_cost(reduced, best)
  assert result.cost == group_cost(reduced, result.choice)
  assert np.all(layout.memory.excess(result.choice) <= 0)
  assert np.all((result.choice == best) | (result.choice == cheapest))


def test_a_merge_of_three_plans_reaches_mixes_no_merge_of_two_does():
  """`recombine` with two other plans re-chooses each differing group among the three plans'
  strategies: on an 8-group chain its plan is below the cheapest mix within the limit of the
  best plan with either other plan alone (its rounding of the LP relaxation is not exact: it
  does not reach the cheapest of the 3**8 mixes, 7% lower)."""
  from automap_rl.solver.local import GroupPlan
  from automap_rl.solver.mip import group_cost, recombine

  graph = binding_chain(n=8, seed=3)
  reduced, layout = solver_views(graph)
  cheapest = np.array(
    [int(np.argmin(reduced.unary[reduced.offsets[g] : reduced.offsets[g + 1]])) for g in range(8)]
  )
  plan = GroupPlan(layout, np.zeros(8, dtype=np.int64))
  assert plan.repair(max_switches=200)
  best, middle = plan.choice, np.ones(8, dtype=np.int64)
  plans = np.stack([best, cheapest, middle])

  def optimum(rows: list[int]) -> float:
    mixes = (plans[list(picks), np.arange(8)] for picks in itertools.product(rows, repeat=8))
    return min(group_cost(reduced, m) for m in mixes if np.all(layout.memory.excess(m) <= 0))

  result = recombine(reduced, layout.memory, best, [cheapest, middle], time_limit=30.0, seed=0)
  assert optimum([0, 1, 2]) <= result.cost < min(optimum([0, 1]), optimum([0, 2]))
  assert result.cost == group_cost(reduced, result.choice)
  assert np.all(layout.memory.excess(result.choice) <= 0)
  assert np.all(np.any(plans == result.choice, axis=0))
