"""Tests for the solver's exact reductions (dominance included) and its forest moves."""

import itertools

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_solver import brute_force, graph_lists, to_graph

from automap_rl.solver import StrategyGraph, evaluate, is_feasible, plan_cost
from automap_rl.solver.forest import ForestMoves
from automap_rl.solver.graph import peak_usage
from automap_rl.solver.local import Layout
from automap_rl.solver.memory import build_memory
from automap_rl.solver.reduce import reduce_graph


def group_plans(reduced):
  return itertools.product(*(range(k) for k in reduced.counts))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_lists())
def test_the_reduced_problem_keeps_an_optimum(lists):
  """Every plan of the reduced problem is a plan of the graph, and the cheapest within the limit
  costs what the graph's cheapest does: no reduction (dominance included) loses the optimum."""
  graph = to_graph(lists)
  cost, _ = brute_force(graph)
  try:
    reduced = reduce_graph(graph)
  except ValueError:
    assert cost is None
    return
  verdicts = [evaluate(graph, reduced.expand(np.array(p))) for p in group_plans(reduced)]
  feasible = [v.cost for v in verdicts if v.feasible]
  assert min(feasible, default=None) == cost


def test_a_strategy_cheaper_but_heavier_is_kept_and_one_worse_in_both_goes():
  """Node 0 trades cost for memory (0 with usage 10, or 5 with usage 1): both stay. Node 1's
  second strategy costs more and uses more than its first: it goes."""
  graph = StrategyGraph.from_lists(
    [[0, 5], [0, 5]], [[10, 1], [1, 10]], [[0, 1], [0, 1]], [], [], usage_limit=20
  )
  reduced = reduce_graph(graph)
  assert reduced.counts[reduced.node_group].tolist() == [2, 1]
  # Without a limit the usage does not count: node 0's second strategy goes too.
  unlimited = StrategyGraph.from_lists(
    [[0, 5], [0, 5]], [[10, 1], [1, 10]], [[0, 1], [0, 1]], [], [], usage_limit=None
  )
  assert reduce_graph(unlimited).counts.tolist() == [1, 1]


def views(graph: StrategyGraph):
  reduced = reduce_graph(graph)
  return reduced, Layout(reduced, build_memory(graph, reduced))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_lists(forbidden=False), st.data())
def test_a_forest_move_never_costs_more_nor_breaks_the_limit(lists, data):
  """A plan within the limit stays within it; one over it gets no further over."""
  graph = to_graph(lists)
  try:
    reduced, layout = views(graph)
  except ValueError:  # the usage no strategy changes is over the limit already
    assume(False)
  start = np.array([data.draw(st.integers(0, k - 1)) for k in reduced.counts], np.int64)
  moved = ForestMoves(layout).move(start, np.random.default_rng(data.draw(st.integers(0, 9))))
  before, after = reduced.expand(start), reduced.expand(moved)
  assert plan_cost(graph, after) <= plan_cost(graph, before)
  if graph.usage_limit is not None:  # without a limit, usage is free
    assert peak_usage(graph, after) <= max(peak_usage(graph, before), graph.usage_limit)
    assert is_feasible(graph, after) or not is_feasible(graph, before)


def test_a_forest_move_spends_the_slack_under_the_limit():
  """The cheaper strategy of node 0 uses 3 more than the current one and the limit leaves
  exactly 3: the move takes it (a move that never grows a node stays where it is)."""
  graph = StrategyGraph.from_lists(
    [[5, 0], [0, 0]],
    [[1, 4], [2, 2]],
    [[0, 2], [0, 2]],
    [[0, 1]],
    [[0, 1, 0, 1]],
    usage_limit=6,
  )
  reduced, layout = views(graph)
  start = reduced.node_choice_to_group(np.array([0, 0]))
  moved = ForestMoves(layout).move(start, np.random.default_rng(0))
  after = reduced.expand(moved)
  assert plan_cost(graph, after) == brute_force(graph)[0] == 0
  assert peak_usage(graph, after) == 6


@st.composite
def trees(draw):
  """A random tree of 2-7 nodes of 2-3 strategies, random costs, no memory limit."""
  n = draw(st.integers(2, 7))
  ks = draw(st.lists(st.integers(2, 3), min_size=n, max_size=n))
  value = st.integers(0, 50)
  parents = [draw(st.integers(0, i - 1)) for i in range(1, n)]
  edges = [[p, i] for i, p in zip(range(1, n), parents)]
  return StrategyGraph.from_lists(
    [draw(st.lists(value, min_size=k, max_size=k)) for k in ks],
    [[0] * k for k in ks],
    [[0, 1]] * n,
    edges,
    [draw(st.lists(value, min_size=ks[u] * ks[v], max_size=ks[u] * ks[v])) for u, v in edges],
    usage_limit=None,
  )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.data())
def test_on_a_tree_one_forest_move_reaches_the_optimum(graph, data):
  """A tree's groups all join the forest whatever the order, so the move is the exact
  dynamic programme over the whole problem."""
  reduced, layout = views(graph)
  start = np.array([data.draw(st.integers(0, k - 1)) for k in reduced.counts], np.int64)
  moved = ForestMoves(layout).move(start, np.random.default_rng(data.draw(st.integers(0, 9))))
  assert plan_cost(graph, reduced.expand(moved)) == brute_force(graph)[0]
