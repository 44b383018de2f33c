"""Collective-permutes: the bytes the simulator prices against those XLA's partitioner emits
(`automap_rl.simulator.permutes`)."""

import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from automap_rl import tactics
from automap_rl.sharding import Decision, Group
from automap_rl.simulator import permutes
from automap_rl.workloads.spec import make_workload
from automap_rl.xla import fullsize
from automap_rl.xla.lower import lower
from automap_rl.xla.plan_metrics import compiled_metrics, simulated_metrics
from automap_rl.xla.validate import DONATE_ARGNUMS, trace_problem

LSTM = "lstm:layers=1,batch=16,seq=8,cells=64,d_model=32,vocab=256"
# A plan a search found on the full-size LSTM: the sequence split over `data` and `model`
# where the logits keep `data` on the vocabulary, so the loss's reads of the logits move
# `data` onto the sequence by an all-to-all (minor, where the sequence lays it out major)
# and the loss's gradient moves it back: two whole-shard permutes, besides the recurrence's
# split dots sending their shares in every time step.
SPLIT_SEQUENCE = [
  Decision(Group(2), "data"),
  Decision(Group(4), "data"),
  Decision(Group(6), "data"),
  Decision(Group(1), "model"),
  Decision(Group(6), "model"),
  Decision(Group(0), "data"),
  Decision(Group(5), "model"),
]


# A plan a random search found on the full-size LSTM: the gates' columns over `data` and
# `model` (`data` major), split into four gates read with the batch over `data`. XLA moves
# `data` to the batch first, by an all-to-all of the minor half of each device's columns,
# a permute of the whole shard puts it on the right devices, and `model` is gathered last.
SPLIT_GATES = [
  Decision(Group(0), "data"),
  Decision(Group(2), "data"),
  Decision(Group(9), "model"),
  Decision(Group(7), "model"),
  Decision(Group(5), "data"),
  Decision(Group(1), "data"),
  Decision(Group(6), "model"),
  Decision(Group(7), "data"),
  Decision(Group(2), "model"),
  Decision(Group(3), "model"),
]


@pytest.fixture(scope="module")
def lstm():
  workload = make_workload(LSTM, abstract=True)
  return workload, trace_problem(workload, "data=4,model=2", "cpu")


def _permutes(workload, problem, decisions):
  lowered = lower(
    problem,
    decisions,
    workload.step,
    workload.args,
    donate_argnums=DONATE_ARGNUMS,
    isolated=False,
    executable=False,
  )
  assert lowered.differences == ()
  simulated, compiled = simulated_metrics(problem, decisions), compiled_metrics(lowered.stats)
  return (
    (simulated["collective_permute_bytes"], compiled["collective_permute_bytes"]),
    (simulated["collective_permute_count"], compiled["collective_permute_count"]),
  )


def test_the_permutes_of_misordered_reshardings_are_priced_as_xla_emits_them(lstm):
  (simulated, compiled), (simulated_count, compiled_count) = _permutes(*lstm, SPLIT_SEQUENCE)
  assert compiled > 0
  # XLA also permutes three scalars' worth (64 bytes each): two of the loss's reductions
  # and the labels its pick of each label's logit reads, split by rows over the vocabulary.
  assert simulated == pytest.approx(compiled, rel=0.01)
  assert compiled_count - 3 <= simulated_count <= compiled_count


def test_a_major_axis_moved_to_another_dim_above_a_gathered_one_is_permuted(lstm):
  (simulated, compiled), (simulated_count, compiled_count) = _permutes(*lstm, SPLIT_GATES)
  assert compiled > 0
  assert (simulated, simulated_count) == (compiled, compiled_count)


# A plan a random search found on jraph-gcn at ogbn-arxiv size (data=2,model=4): node
# features [169344, 256] with the nodes over `model` and `data` (`model` major), read with
# the features over both, `data` major. One all-to-all moves both axes, in the order they
# had; a permute of the whole shard puts them in the other order (and once more back).
GCN_TRADE_ORDER = [
  Decision(Group(10), "model"),
  Decision(Group(1), "model"),
  Decision(Group(5), "data"),
  Decision(Group(0), "model"),
  Decision(Group(3), "data"),
  Decision(Group(8), "data"),
  Decision(Group(6), "data"),
  Decision(Group(11), "model"),
  Decision(Group(10), "data"),
  Decision(Group(2), "model"),
  Decision(Group(7), "model"),
  Decision(Group(2), "data"),
]


def test_two_axes_one_all_to_all_moves_keep_their_order():
  case = fullsize.validation_case("jraph-gcn-arxiv-2x4-a100-40g")
  workload = case.make_workload(abstract=True)
  problem = trace_problem(workload, case.mesh, fullsize.validation_mesh(case).hardware)
  (simulated, compiled), (simulated_count, compiled_count) = _permutes(
    workload, problem, GCN_TRADE_ORDER
  )
  assert compiled == 2 * 169344 * 256 * 4 / 8
  assert (simulated, simulated_count) == (compiled, compiled_count)


@pytest.mark.parametrize("plan", ["fsdp_megatron_sp", "data_megatron"])
def test_plans_whose_reshardings_keep_shards_in_place_have_no_permutes(lstm, plan):
  workload, problem = lstm
  (simulated, compiled), _ = _permutes(workload, problem, tactics.applicable(problem)[plan])
  assert simulated == compiled == 0.0


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
  num_axes=st.integers(1, 4),
  rank=st.integers(1, 5),
  seed=st.integers(0, 2**31 - 1),
)
def test_traded_axes_are_those_two_dims_swap(num_axes, rank, seed):
  """Each mesh axis on at most one dim of a value, as stored and as required: an axis is
  traded exactly where dims i and j swap axes (one moves from i to j, another from j to i)."""
  rng = np.random.default_rng(seed)
  edges, batch = 7, 5

  def masks():
    dim = rng.integers(-1, rank, size=(num_axes, edges, batch))  # -1: the axis is unused.
    return sum(
      np.where(dim[a][:, None] == np.arange(rank)[None, :, None], 1 << a, 0)
      for a in range(num_axes)
    ).astype(np.int8)

  source, target = masks(), masks()
  expected = np.zeros((edges, batch), np.int8)
  for i in range(rank):
    for j in range(i + 1, rank):
      there, back = source[:, i] & target[:, j], source[:, j] & target[:, i]
      expected |= np.where((there != 0) & (back != 0), there | back, 0).astype(np.int8)
  traded = permutes._traded(jnp.asarray(source), jnp.asarray(target), num_axes)
  np.testing.assert_array_equal(np.asarray(traded), expected)


@pytest.mark.parametrize(
  "source, target, swapped",
  [
    (("model", None), ("data", None), 0b011),  # Rows over `model` read over `data`.
    ((None, "data"), (None, "x"), 0b101),
    (("data", "model"), ("x", "model"), 0b101),  # `model` stays on the columns.
    ((("data", "model"), None), ("x", None), 0),  # Four devices' worth gathered, two sliced.
    (("model", None), (None, "data"), 0),  # Another dim: all-to-all and permute.
  ],
)
def test_a_dim_that_swaps_an_axis_for_one_as_large_is_a_permute(source, target, swapped):
  """Where a dim gathers axes and slices in as many devices' worth of others, XLA's
  partitioner sends each device's shard where it is needed: one collective-permute of the
  shard, no all-gather."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "model", "x"), axis_types=(AxisType.Auto,) * 3)
  sharding = lambda spec: NamedSharding(mesh, PartitionSpec(*spec))

  def reshard(x):
    x = jax.lax.with_sharding_constraint(x, sharding(source)) * 2.0
    return jax.lax.with_sharding_constraint(x, sharding(target)) + 1.0

  text = jax.jit(reshard).lower(jax.ShapeDtypeStruct((64, 256), jnp.float32)).compile().as_text()
  collectives = re.findall(r"= (.+?) (all-gather|all-to-all|collective-permute)(?:-start)?\(", text)
  bits = {"data": 1, "model": 2, "x": 4}
  masks = lambda spec: jnp.array(
    [[[sum(bits[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))] for axes in spec]],
    jnp.int8,
  )  # [1 edge, 2 dims, 1 plan]
  tables = trace_problem(make_workload(LSTM, abstract=True), "data=2,model=2,x=2", "cpu").tables
  assert int(permutes.swapped_axes(tables, masks(source), masks(target))[0, 0]) == swapped
  shard = f"f32[{64 // (2 if source[0] else 1)},{256 // (2 if source[1] else 1)}]"
  if swapped:
    assert [(shape.split("{")[0], kind) for shape, kind in collectives] == [
      (shard, "collective-permute")
    ]
  else:
    assert any(kind != "collective-permute" for _, kind in collectives)
