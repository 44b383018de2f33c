"""Buckets: tables padded to a few sizes price plans as the exact ones do, and problems of one
bucket share every compile."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents import base, gumbel
from automap_rl import buckets, sharding, workloads
from automap_rl import mesh as mesh_lib
from automap_rl import problem as problem_module
from automap_rl.problem import Problem
from automap_rl.workloads.suite import load_cases
from envs import EnvConfig
from envs import bench as env_bench
from experiments import bench_buckets


@functools.cache
def problem(model: str, mesh: str = "data=2,model=4") -> Problem:
  return Problem.build(
    workloads.make_workload(model, abstract=True).trace(), mesh_lib.make_mesh(mesh, "h100")
  )


@given(dim=st.sampled_from(["Uv", "E", "T", "Rv", "Rf", "S", "K"]), size=st.integers(1, 5000))
def test_a_bucket_holds_its_size_and_is_its_own_bucket(dim, size):
  padded = buckets.bucket(dim, size)
  assert padded >= size
  assert buckets.bucket(dim, padded) == padded
  assert buckets.bucket(dim, size + 1) >= padded  # Monotone.
  if dim in buckets.SMALL_DIMS:
    assert padded % buckets.SMALL_STEP == 0 and padded - size < buckets.SMALL_STEP
  else:
    assert padded <= max((1 + 1 / buckets.RUNGS) * size, buckets.LARGE_MINIMUM)


def _random_plans(problem: Problem, count: int, seed: int) -> list[list[sharding.Decision]]:
  rng = np.random.default_rng(seed)
  classes, axes = len(problem.named.classes), problem.mesh.axis_names
  return [
    [
      sharding.Decision(int(c), axes[int(a)])
      for c, a in zip(rng.integers(0, classes, k), rng.integers(0, len(axes), k))
    ]
    for k in rng.integers(1, 3 * classes, count)
  ]


@pytest.mark.parametrize(
  "model,mesh", [("gpt:layers=2", "data=2,model=4"), ("moe", "data=2,fsdp=2,model=2")]
)
def test_bucketed_tables_resolve_and_price_as_the_exact_ones(model, mesh):
  p = problem(model, mesh)
  plans = _random_plans(p, 12, seed=0)
  exact_cost, exact_resolve = jax.jit(p.evaluate), jax.jit(p.resolve)
  for plan, cost in zip(plans, p.costs(plans)):
    encoded = p.encode_padded(plan)
    resolution, want = p.resolution(plan), jax.device_get(exact_resolve(*encoded))
    np.testing.assert_array_equal(resolution.value_mask, want.value_mask)
    np.testing.assert_array_equal(resolution.op_mask, want.op_mask)
    exact = jax.device_get(exact_cost(*encoded))
    np.testing.assert_array_equal(cost.comm_bytes, exact.comm_bytes)
    # Sums of a thousand rows, padded with zeros, may round in another order: within a few
    # ulps a row.
    for field in ("comm_count", "step_time", "compute_time", "comm_time", "peak_memory"):
      np.testing.assert_allclose(getattr(cost, field), getattr(exact, field), rtol=1e-5)


def test_problems_of_one_bucket_share_the_cost_and_environment_compiles():
  # Two models (LSTMs of 2 and 3 layers) on two meshes.
  first, second = (
    problem("lstm:layers=2", "data=2,model=4"),
    problem("lstm:layers=3", "data=4,model=2"),
  )
  config = EnvConfig(action_space="named_dims", max_axes=2, objective="time")
  tables = [base.searcher(p, config).env.tables for p in (first, second)]
  assert buckets.key(tables[0], first.bucketed) == buckets.key(tables[1], second.bucketed)
  assert buckets.key(tables[0]) != buckets.key(base.Env.build(second, config).tables)  # Padded.
  compiled = {
    "costs": problem_module.bucketed_costs.jitted()._cache_size,
    "children": base._children.jitted()._cache_size,
  }
  first.costs(_random_plans(first, 3, seed=1))
  base.searcher(first, config).children(base.searcher(first, config).root, [0, 1])
  before = {name: size() for name, size in compiled.items()}
  second.costs(_random_plans(second, 3, seed=1))
  search = base.searcher(second, config)
  search.children(search.root, [0, 1])
  assert {name: size() for name, size in compiled.items()} == before


def test_the_bucket_bench_checks_its_splits_and_reshapes_meshes():
  with pytest.raises(ValueError, match="unknown split 'dev'"):
    bench_buckets.run(bench_buckets.BucketBenchConfig(splits=("dev",)))
  case = next(c for c in load_cases("external") if c.mesh == "data=4,model=4")
  variants = bench_buckets.reshaped_meshes(case)
  assert variants == ["data=2,model=8", "data=8,model=2"]  # Nearest first; none is its own.
  three = bench_buckets.reshaped_meshes(
    next(c for c in load_cases() if c.mesh == "data=2,fsdp=2,model=8")
  )
  assert len(three) == len(set(three)) > 2


@pytest.mark.parametrize("batch", [None, 4])
def test_random_episodes_on_bucketed_tables_end_where_the_exact_ones_do(batch):
  # The throughput bench's A/B: the k-th legal action is the same move on padded tables
  # (padded targets are never legal, stop stays last), so one key plays one episode.
  p, config = problem("gpt:layers=2"), EnvConfig(reward="shaped")
  exact, padded = (base.Env.build(p, config, bucket=b) for b in (False, True))
  assert padded.num_actions > exact.num_actions
  key = jax.random.key(3)
  objectives = [
    np.asarray(env_bench.random_steps(env, batch, 6, tables_as_argument=b)(key))
    for env, b in ((exact, False), (padded, True))
  ]
  np.testing.assert_allclose(*objectives, rtol=1e-6)
  assert np.all(objectives[0] != 1.0) and len(np.unique(objectives[0])) == (batch or 1)


def test_a_gumbel_search_takes_the_same_moves_on_bucketed_tables():
  # Several episodes in one search: each draws its root noise at its own actions, whatever
  # the padding (a draw over the padded action count would give episodes past the first
  # other noise, and other moves).
  p = problem("gpt:layers=2")
  config = gumbel.GumbelConfig(gumbel=gumbel.GumbelSettings(num_simulations=16))
  exact, padded = (base.Env.build(p, EnvConfig(), bucket=b) for b in (False, True))
  assert padded.tables.num_moves > exact.tables.num_moves
  moves, objectives = [], []
  for env in (exact, padded):
    roots = jax.tree.map(lambda x: np.stack([x] * 4), jax.device_get(env.init(jax.random.key(0))))
    limit = np.int32(config.gumbel.num_simulations)
    action, _, nodes = gumbel._search_step(
      None, None, env.tables, roots, jax.random.key(7), limit, config, env.config
    )
    stop = np.asarray(action) == env.stop_action
    moves.append(np.where(stop, -1, np.asarray(action)))
    objectives.append(np.sort(np.asarray(nodes.objective), axis=1))
  assert len(set(moves[0].tolist())) > 1  # The episodes' noise differs.
  np.testing.assert_array_equal(moves[0], moves[1])
  np.testing.assert_allclose(*objectives, rtol=1e-5)
