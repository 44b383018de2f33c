"""One decision rule: any decision sequence played through the environment ends in exactly
the shardings that `sharding.resolve` computes for the same list (property tests)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automap_rl import sharding, workloads
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from envs import Env, EnvConfig

MESHES = ("data=2,model=4", "data=2,fsdp=2,model=2")
SPACES = ("arg_dims", "named_dims", "groups")


@functools.cache
def env_and_calls(model: str, mesh: str, space: str):
  problem = Problem.build(
    workloads.make_workload(model, abstract=True).trace(), make_mesh(mesh, "h100")
  )
  env = Env.build(problem, EnvConfig(action_space=space, max_decisions=48))
  return env, jax.jit(env.step), jax.jit(problem.resolve)


def play(env: Env, step, picks: list[int]):
  """Plays each pick as an index into the legal non-stop actions; the states visited."""
  state = env.init(jax.random.key(0))
  for pick in picks:
    legal = np.flatnonzero(np.asarray(state.legal_action_mask)[:-1])
    if len(legal) == 0:
      break
    state = step(state, jnp.int32(legal[pick % len(legal)]))
  return state


# Every family on a 2- or a 3-axis mesh in turn (GPT on both): each pair compiles an environment.
CASES = [(family, MESHES[i % len(MESHES)]) for i, family in enumerate(workloads.FAMILIES)] + [
  ("gpt", MESHES[0])
]


# `make test`: the dense transformer on both meshes and a scanned SSM; the rest is slow.
QUICK = ("gpt", "ssm")


@pytest.mark.parametrize(
  "model,mesh",
  [c if c[0] in QUICK else pytest.param(*c, marks=pytest.mark.slow) for c in sorted(set(CASES))],
)
@settings(
  max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=12))
def test_environment_steps_end_in_the_resolution_of_their_decisions(model, mesh, picks):
  space = SPACES[(workloads.FAMILIES.index(model) + MESHES.index(mesh)) % len(SPACES)]
  env, step, resolve = env_and_calls(model, mesh, space)
  state = play(env, step, picks)
  # The same list, carried as Decisions and encoded again, resolves to the state's shardings.
  dec_class, dec_axis = env.problem.encode(env.decisions(state), length=env.config.max_decisions)
  resolved = resolve(dec_class, dec_axis)
  np.testing.assert_array_equal(state.value_mask, resolved.value_mask)
  np.testing.assert_array_equal(state.op_mask, resolved.op_mask)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
  divisible=st.integers(0, (1 << 16) - 1),
  mask=st.integers(0, 15),
  used=st.integers(0, 15),
  axis=st.integers(0, 3),
)
def test_a_slot_takes_an_axis_iff_its_owner_leaves_it_free_and_its_size_divides(
  divisible, mask, used, axis
):
  bit = 1 << axis
  takes = bool(
    sharding.takes_axis(
      jnp.int32(divisible), jnp.int32(mask), jnp.int32(used | mask), jnp.int32(bit)
    )
  )
  assert takes == (not (used | mask) & bit and bool(divisible >> (mask | bit) & 1))
