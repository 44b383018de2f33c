"""`automap_rl.batching`: batch-last calls in tiles, and functions run on the needed rows only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automap_rl import batching


def _fn(static, batch):
  """A batch-last function of a table and two arrays: leaves [..., B] in, [B, ...] out."""
  x, y = batch
  calls.append(x.shape[-1])
  return {"sum": (static[:, None] * x).sum(axis=0) + y, "rows": jnp.moveaxis(x * y, -1, 0)}


calls: list[int] = []


@pytest.mark.parametrize("batch,tile", [(10, 4), (8, 4), (3, 4), (1, 1)])
def test_batch_last_in_tiles_is_the_plain_call_per_row(batch, tile):
  static = jnp.arange(1.0, 6.0)
  x = jax.random.normal(jax.random.key(batch), (batch, 5))
  y = jnp.float32(2.5)  # Unbatched: broadcast to every row.
  calls.clear()
  out = jax.vmap(batching.batch_last(_fn, lambda _: tile), in_axes=(None, (0, None)))(
    static, (x, y)
  )
  assert calls[-1] == min(batch, tile), "the vmapped call did not run in tiles of the given size"
  for row in range(batch):
    one = batching.batch_last(_fn)(static, (x[row], y))
    np.testing.assert_allclose(out["sum"][row], one["sum"], rtol=1e-6)
    np.testing.assert_allclose(out["rows"][row], one["rows"], rtol=1e-6)


def test_tile_for_keeps_a_tile_near_the_entry_budget():
  assert batching.tile_for(1734) == 128
  assert batching.tile_for(1) == 1024 and batching.tile_for(10**9) == 16


@given(n=st.integers(0, 1 << 20), smallest=st.sampled_from([1, 8, 16]))
def test_next_power_of_two_is_the_least_power_of_two_that_holds_n(n, smallest):
  padded = batching.next_power_of_two(n, smallest)
  assert padded & (padded - 1) == 0 and padded >= max(n, smallest)
  assert padded == smallest or padded // 2 < n


def _square(static, x):
  return {"value": static * x * x, "count": jnp.int32(1)}


def _fill(static):
  return {"value": -static, "count": jnp.int32(0)}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(needed=st.lists(st.booleans(), min_size=1, max_size=40))
def test_only_where_matches_a_select_and_runs_a_capacity_of_rows(needed):
  x = jnp.arange(len(needed), dtype=jnp.float32) + 1.0
  mask = jnp.array(needed)
  f = batching.only_where(lambda s, v: _square(s, v), _fill)
  out = jax.jit(jax.vmap(f, in_axes=(None, 0, 0)))(jnp.float32(3.0), x, mask)
  want = np.where(needed, 3.0 * np.asarray(x) ** 2, -3.0)
  np.testing.assert_allclose(out["value"], want)
  np.testing.assert_array_equal(out["count"], np.asarray(needed, np.int32))
  plain = [jax.jit(f)(jnp.float32(3.0), x[i], mask[i]) for i in range(min(len(needed), 3))]
  np.testing.assert_allclose([float(p["value"]) for p in plain], want[: len(plain)])


def test_only_where_branches_per_capacity_and_runs_exactly_the_needed_rows():
  x = jnp.arange(64, dtype=jnp.float32)
  f = jax.vmap(batching.only_where(lambda s, v: _square(s, v), _fill), in_axes=(None, 0, 0))
  jaxpr = jax.make_jaxpr(f)(jnp.float32(1.0), x, x < 3)
  branches = [e.params["branches"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
  assert [len(b) for b in branches] == [6], (
    "one branch for none and one per capacity from B/16 to B"
  )
  counts = {}
  for n in (0, 1, 4, 5, 17, 64):
    out = jax.jit(f)(jnp.float32(1.0), x, x < n)
    counts[n] = int(out["count"].sum())
  assert counts == {0: 0, 1: 1, 4: 4, 5: 5, 17: 17, 64: 64}
