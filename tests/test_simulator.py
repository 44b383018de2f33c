"""Decisions, resolution and the simulator on cases with an answer by hand."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automap_rl import ir, simulator, tactics, workloads
from automap_rl.mesh import get_hardware, make_mesh
from automap_rl.problem import Problem
from automap_rl.sharding import ArgDim, Decision, Group
from automap_rl.simulator import COMM_KINDS, KINDS
from automap_rl.simulator.fusion import dead_ops, kernel_launches, memory_traffic
from automap_rl.simulator.fusion.traffic import transposed_convolution_operands
from experiments.bench_cmd import random_plans

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = (KINDS.index(k) for k in KINDS)


@functools.cache
def zoo_problem(spec: str, mesh: str) -> Problem:
  workload = workloads.make_workload(spec, abstract=True)
  return Problem.build(workload.trace(), make_mesh(mesh, "h100"))


def test_contracting_dim_sharded_costs_one_all_reduce_of_the_output():
  program = ir.trace(lambda x, w: x @ w, jnp.ones((64, 128)), jnp.ones((128, 32)))
  problem = Problem.build(program, make_mesh("model=4", "h100"))
  cost = problem.cost([Decision(ArgDim("arg0", 1), "model")])
  assert cost.comm_count.tolist() == [1, 0, 0, 0, 0]
  assert cost.comm_bytes[ALL_REDUCE] == 64 * 32 * 4
  replicated = problem.cost([])
  assert cost.compute_time < replicated.compute_time


@pytest.mark.parametrize(
  "hardware, matmul_rate", [("h100", 494.5e12), ("a100-80g", 156e12), ("tpu-v4", 275e12 / 6)]
)
def test_float32_matmuls_are_priced_at_the_rate_xla_runs_them(hardware, matmul_rate):
  """XLA:GPU runs float32 dots on TF32 tensor cores by default (a float32 GPT step on an
  H100 reached 80 TFLOP/s, above the 67 of its float32 units), at the share of that peak
  that a matmul reaches on the device (`matmul_efficiency`); other ops keep the float32
  rate, and a profile without a matmul rate prices dots like the rest."""
  n = 1024
  tables = Problem.build(
    ir.trace(lambda x, w: x @ w, jnp.ones((n, n)), jnp.ones((n, n))), make_mesh("data=2", hardware)
  ).tables
  hw = make_mesh("data=2", hardware).hardware
  assert float(tables.op_compute_s.sum() + tables.value_compute_s.sum()) == pytest.approx(
    2 * n**3 / (matmul_rate * hw.matmul_efficiency), rel=1e-5
  )
  assert hw.achievable_flops("tanh", "float32") == hw.flops["float32"]
  assert hw.peak_flops("tanh", "float32") == hw.flops["float32"]
  assert hw.peak_flops("dot_general", "bfloat16") == hw.flops["bfloat16"]


@pytest.mark.parametrize("kind", ["all-gather", "collective-permute"])
def test_collective_seconds_are_linear_in_buffers_of_gibibytes(kind):
  """Compiled collectives of 2 GiB and more (a stacked scan buffer) are priced, not overflowed."""
  program = ir.trace(lambda x, w: x @ w, jnp.ones((64, 128)), jnp.ones((128, 32)))
  tables = Problem.build(program, make_mesh("data=2,model=4", "h100")).tables
  small, large = (simulator.collective_seconds(tables, kind, n, 1) for n in (2**30, 3 * 2**30))
  assert large > small > 0
  assert large - small == pytest.approx(
    2 * (small - simulator.collective_seconds(tables, kind, 0, 1))
  )


@pytest.mark.parametrize("kind", ["all-gather", "all-to-all", "all-reduce"])
def test_a_collective_over_devices_no_axes_group_is_a_ring_of_its_group(kind):
  """XLA's groups of 4 of the 8 devices of data=4,model=2 that match no set of axes (a
  merged dim's minor tiles) ring over 4 devices, not 8: on one node's NVLink, the price
  of a ring over `data`, the axis of 4."""
  program = ir.trace(lambda x, w: x @ w, jnp.ones((64, 128)), jnp.ones((128, 32)))
  tables = Problem.build(program, make_mesh("data=4,model=2", "h100")).tables
  every_axis, data = 0b11, 0b01
  four = simulator.collective_seconds(tables, kind, 2**20, every_axis, group=4)
  assert four == pytest.approx(simulator.collective_seconds(tables, kind, 2**20, data))
  assert four < simulator.collective_seconds(tables, kind, 2**20, every_axis)


def test_data_parallel_mlp_all_reduces_exactly_the_gradient_bytes():
  problem = zoo_problem("mlp", "data=8")
  workload = workloads.make_workload("mlp", abstract=True)
  grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(workload.params))
  cost = problem.cost(tactics.data_parallel(problem))
  loss_bytes = 4  # The mean loss is a partial sum too.
  assert cost.comm_bytes[ALL_REDUCE] == grad_bytes + loss_bytes
  # The gradients and the loss depend on no other reduction: XLA's all-reduce combiner
  # merges them into one collective (they are under the GPU's 30 MiB threshold).
  assert grad_bytes < problem.mesh.hardware.combine_threshold["all-reduce"]
  assert cost.comm_count.tolist() == pytest.approx([1, 0, 0, 0, 0])


def test_combined_gradient_all_reduces_pay_latency_per_combined_collective():
  """Data-parallel GPT gradients: one combined all-reduce per `combine_threshold` bytes,
  so the latency term is that many link latencies, not one per gradient; a threshold
  with no limit (XLA on CPU) combines all of them into one."""
  import dataclasses

  workload = workloads.make_workload("gpt:layers=2", abstract=True)
  program = workload.trace()
  grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(workload.params))
  counts = {}
  for threshold in (grad_bytes / 3.5, float("inf")):
    h100 = make_mesh("data=8", "h100").hardware
    hardware = dataclasses.replace(h100, combine_threshold={"all-reduce": threshold})
    problem = Problem.build(program, make_mesh("data=8", hardware))
    terms = problem.cost_terms(tactics.data_parallel(problem))
    reduce = terms.all_reduce
    counts[threshold] = float(reduce.count.sum())
    # Latency: (n - 1) hops of 2 rounds per combined collective (ring all-reduce, n = 8).
    bandwidth_s = float((reduce.seconds - reduce.count * 2 * 7 * h100.intra_node.latency).sum())
    assert bandwidth_s == pytest.approx(
      float(reduce.bytes.sum()) * 2 * 7 / 8 / h100.intra_node.bandwidth, rel=1e-4
    )
  assert counts == pytest.approx({grad_bytes / 3.5: 4, float("inf"): 1})


def test_megatron_gpt_all_reduces_twice_per_layer_forward_and_twice_backward():
  """Forward: after the attention output and the second MLP matmul. Backward: the input
  gradients of the first MLP matmul, and of the query, key and value projections (three
  partial sums that XLA reduces in one combined all-reduce of three activations). Once a
  step, the vocabulary-parallel embedding's lookup (one activation) and head: the loss's
  maximum and sum over the vocabulary (a [batch, seq] statistic each) and its input
  gradient (one activation)."""
  counts = []
  for layers in (2, 3):
    problem = zoo_problem(f"gpt:layers={layers}", "data=2,model=4")
    cost = problem.cost(tactics.megatron(problem))
    counts.append(cost.comm_count)
    activation = 16 * 64 * 128 * 4  # [batch, seq, d_model] f32
    statistic = 16 * 64 * 4  # [batch, seq] f32
    embedding, head = activation, activation + 2 * statistic
    assert cost.comm_bytes[ALL_REDUCE] == (2 + 1 + 3) * layers * activation + embedding + head
  assert (counts[1] - counts[0]).tolist() == [4, 0, 0, 0, 0]


def test_fsdp_stores_optimizer_state_over_the_axis_size():
  problem = zoo_problem("gpt", "data=8")
  decisions = tactics.fsdp(problem)
  opt_values = [
    v for v in problem.program.inputs if problem.program.values[v].role == ir.Role.OPTIMIZER_STATE
  ]
  specs = problem.partition_specs(decisions, opt_values)
  total = per_device = 0
  for value_id, spec in zip(opt_values, specs):
    value = problem.program.values[value_id]
    sharded = any(axis is not None for axis in spec)
    total += value.nbytes
    per_device += value.nbytes / (8 if sharded else 1)
    if len(value.shape) >= 1 and max(value.shape) % 8 == 0:
      assert sharded, value.path
  assert per_device <= total / 8 * 1.001 + 64  # Only scalars (the step count) stay whole.
  fsdp, dp = problem.cost(decisions), problem.cost(tactics.data_parallel(problem))
  assert fsdp.comm_bytes[REDUCE_SCATTER] > 0 and fsdp.comm_bytes[ALL_GATHER] > 0
  assert fsdp.peak_memory < dp.peak_memory


def test_dimension_that_does_not_divide_stays_unsharded():
  program = ir.trace(lambda x: jnp.tanh(x) * 2.0, jnp.ones((6, 16)))
  problem = Problem.build(program, make_mesh("data=4", "h100"))
  (spec,) = problem.partition_specs([Decision(ArgDim("arg0", 0), "data")], [program.inputs[0]])
  assert tuple(spec) == (None, None)
  (spec,) = problem.partition_specs([Decision(ArgDim("arg0", 1), "data")], [program.inputs[0]])
  assert tuple(spec) == (None, "data")


def test_earlier_decision_wins_the_axis():
  program = ir.trace(lambda x: x * 2.0, jnp.ones((8, 16)))
  problem = Problem.build(program, make_mesh("data=4", "h100"))
  decisions = [Decision(ArgDim("arg0", 1), "data"), Decision(ArgDim("arg0", 0), "data")]
  (spec,) = problem.partition_specs(decisions, [program.inputs[0]])
  assert tuple(spec) == (None, "data")


def test_bad_targets_raise_errors_that_name_them():
  problem = zoo_problem("mlp", "data=8")
  with pytest.raises(ValueError, match="params/mlp/~/linear_9/w"):
    problem.cost([Decision(ArgDim("params/mlp/~/linear_9/w", 0), "data")])
  with pytest.raises(ValueError, match="dimension 5"):
    problem.cost([Decision(ArgDim("batch/inputs", 5), "data")])
  with pytest.raises(ValueError, match="model"):
    problem.cost([Decision(ArgDim("batch/inputs", 0), "model")])
  with pytest.raises(ValueError, match="group"):
    problem.cost([Decision(Group(10_000), "data")])


def test_expected_order_of_expert_tactics_on_gpt():
  # Wide enough that the model-parallel plans' compute savings outweigh their all-reduces
  # with float32 dots on the H100's TF32 tensor cores. Data parallelism's gradient
  # all-reduce hides behind the backward pass; Megatron's activation all-reduces do not.
  problem = zoo_problem("gpt:layers=4,d_model=1024,batch=32", "data=2,model=4")
  times = {
    name: float(problem.cost(plan).step_time) for name, plan in tactics.applicable(problem).items()
  }
  assert times["data_megatron"] < times["data_parallel"] < times["megatron"] < times["replicated"]


def test_a_kernel_launches_where_a_value_is_written_and_once_per_loop_iteration():
  """A dot writes its result (one kernel); the tanh fuses into the sum that reads it, which
  writes the scalar (one kernel); a loop body's kernels launch once per iteration."""
  x, w = jnp.ones((64, 128)), jnp.ones((128, 32))
  program = ir.trace(lambda x, w: jnp.tanh(x @ w).sum(), x, w)
  traffic = memory_traffic(program)
  dead = dead_ops(program)
  launched = kernel_launches(program, traffic, dead)
  assert {op.primitive: launched[op.id] for op in program.ops if launched[op.id]} == {
    "dot_general": 1,
    "reduce_sum": 1,
  }

  def looped(x, w):
    return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w[:, :128]), None), x, None, length=5)[0]

  program = ir.trace(looped, x, jnp.ones((128, 128)))
  traffic = memory_traffic(program)
  launched = kernel_launches(program, traffic, dead_ops(program))
  dots = [op.id for op in program.ops if op.primitive == "dot_general"]
  assert [launched[d] for d in dots] == [5]


def test_xla_cpu_transposes_the_operands_of_a_convolution_out_of_its_layout():
  """The gradient of an NHWC / HWIO convolution: the forward convolution is in XLA:CPU's
  canonical layout, the kernel gradient's input and output cotangent are not (it contracts
  the batch), nor is the input gradient's kernel (features swapped). XLA:CPU transposes
  exactly those three, and the traffic prices a read and a write of each."""

  def loss(x, w):
    dn = ("NHWC", "HWIO", "NHWC")
    return jnp.sum(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn) ** 2)

  step = jax.value_and_grad(loss, argnums=(0, 1))
  x, w = jnp.ones((8, 16, 16, 4)), jnp.ones((3, 3, 4, 6))
  program = ir.trace(step, x, w)
  convs = [op for op in program.ops if op.primitive == "conv_general_dilated"]
  assert [transposed_convolution_operands(op) for op in convs] == [
    (False, False),
    (True, True),
    (False, True),
  ]
  text = jax.jit(step).lower(x, w).compile().as_text()
  transposes = re.findall(r"= f32\[([\d,]+)\]\S* transpose\(", text)
  compiled = sum(2 * 4 * np.prod([int(d) for d in shape.split(",")]) for shape in transposes)
  plain, canonical = (
    memory_traffic(program, False, False, canonical_convolutions=c) for c in (False, True)
  )
  added = sum(sum(c[0]) - sum(p[0]) for p, c in zip(plain, canonical))
  assert len(transposes) == 3
  assert added == compiled


_RESHARDS = [
  # (from, to, whether XLA replicates the value): a logits tensor's vocabulary over both
  # axes read with the batch and the sequence over one each, and the moves XLA makes
  # with all-to-alls and collective-permutes.
  ((None, None, ("data", "model")), ("model", "data", None), True),
  ((None, None, ("data", "model")), ("data", "model", None), True),
  ((("data", "model"), None, None), (None, "data", "model"), True),
  (("data", "model", None), (None, None, ("data", "model")), True),
  ((None, None, ("data", "model")), (("data", "model"), None, None), False),
  ((None, None, ("data", "model")), ("data", None, "model"), False),
  (("data", "model", None), ("model", "data", None), False),
  (("data", None, "model"), (None, "model", "data"), False),
  ((None, "data", "model"), ("model", "data", None), False),
]


@pytest.mark.parametrize("source, target, replicated", _RESHARDS)
def test_a_resharding_xla_cannot_make_dim_by_dim_replicates_the_value(source, target, replicated):
  """XLA's SPMD partitioner moves axes between dims one source and one target dim at a
  time; where one dim's axes go to several dims, or several dims' axes to one, it
  all-gathers the whole value and slices it. The simulator tells the two apart as XLA
  compiles them."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = lambda spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

  def reshard(x):
    x = jax.lax.with_sharding_constraint(x, sharding(source)) * 2.0
    return jax.lax.with_sharding_constraint(x, sharding(target)) + 1.0

  x = jax.ShapeDtypeStruct((64, 256, 128), jnp.float32)
  text = jax.jit(reshard).lower(x).compile().as_text()
  assert bool(re.search(r"= f32\[64,256,128\]\S* all-gather", text)) == replicated
  bits = {"data": 1, "model": 2}
  masks = lambda spec: jnp.array(
    [[[sum(bits[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))] for axes in spec]],
    jnp.int8,
  )  # [1 edge, 3 dims, 1 plan]
  assert bool(simulator.cost.replicated_reshards(masks(source), masks(target))[0, 0]) == replicated


def _traffic_bytes(program: ir.Program, canonical_convolutions: bool = False) -> float:
  """Bytes the program moves as XLA:CPU fuses it (one output a fusion, minor concatenates
  as kernels)."""
  traffic = memory_traffic(program, False, False, canonical_convolutions=canonical_convolutions)
  return sum(sum(reads) + sum(writes) for reads, writes in traffic)


def _residual_dots(x, ws, scale):
  for w in ws:
    x = jnp.maximum((x @ w) * scale + x, 0.0)
  return x


def test_xla_cpu_computes_a_residual_stream_again_in_every_fusion_that_reads_it():
  """`relu(f(x) + x)` over a stack of blocks: each block's result is written for its dot,
  and XLA:CPU clones it into the next block's fusion (cheap, and the add fuses into its
  one reader), which so computes the whole stream again from every block's dot: the
  fusion of block k reads k + 2 inputs. The traffic is the compiled module's bytes."""
  x, scale = jnp.ones((1024, 256)), jnp.ones((256,))
  ws = [jnp.ones((256, 256))] * 4
  compiled = jax.jit(_residual_dots).lower(x, ws, scale).compile()
  fusion_inputs = [
    len(re.findall(r"%\w[\w.]*", line.split("fusion(")[1].split(")")[0]))
    for line in compiled.as_text().splitlines()
    if "kind=kLoop" in line and " fusion(" in line
  ]
  assert sorted(fusion_inputs) == [3, 4, 5, 6]
  program = ir.trace(_residual_dots, x, ws, scale)
  assert _traffic_bytes(program) == compiled.cost_analysis()["bytes accessed"]


def _residual_convolutions(x, ws, scales):
  dn = ("NHWC", "HWIO", "NHWC")
  for w, s in zip(ws, scales):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
    x = jax.nn.relu((y - y.mean((0, 1, 2))) * s + x)
  return jnp.sum(x**2)


def test_a_deeper_residual_network_adds_the_bytes_xla_cpu_adds():
  """A ResNet-like stack trained: the kernel gradient reads each block's input transposed,
  and XLA:CPU's transpose computes it again from the stream's inputs like any fusion
  that reads it. Four more blocks add the bytes they add to the compiled module."""
  step = jax.value_and_grad(_residual_convolutions, argnums=(1, 2))
  x = jnp.ones((8, 16, 16, 32))
  moved = {}
  for depth in (2, 6):
    args = (x, [jnp.ones((3, 3, 32, 32))] * depth, [jnp.ones((32,))] * depth)
    compiled = jax.jit(step).lower(*args).compile().cost_analysis()["bytes accessed"]
    moved[depth] = (_traffic_bytes(ir.trace(step, *args), canonical_convolutions=True), compiled)
  (shallow, shallow_compiled), (deep, deep_compiled) = moved[2], moved[6]
  assert deep - shallow == pytest.approx(deep_compiled - shallow_compiled, rel=1e-3)
  assert deep == pytest.approx(deep_compiled, rel=0.02)


@pytest.mark.parametrize("plan", ["replicated", "data_parallel", "fsdp", "megatron"])
def test_every_device_pays_the_kernel_overhead_whole(plan):
  """The kernel overhead adds kernels x `kernel_overhead_s` to the compute of any plan:
  splitting an op divides its work, not the kernels a device launches."""
  program = zoo_problem("gpt:layers=2,d_model=256,batch=8", "data=2,model=4").program
  h100 = get_hardware("h100")
  costs = []
  for hardware in (h100, dataclasses.replace(h100, kernel_overhead_s=0.0)):
    problem = Problem.build(program, make_mesh("data=2,model=4", hardware))
    costs.append(problem.cost(getattr(tactics, plan)(problem)))
  traffic = memory_traffic(program)
  kernels = kernel_launches(program, traffic, dead_ops(program)).sum()
  assert kernels > 100
  added = float(costs[0].compute_time) - float(costs[1].compute_time)
  assert added == pytest.approx(kernels * h100.kernel_overhead_s, rel=1e-3)
  np.testing.assert_array_equal(costs[0].comm_bytes, costs[1].comm_bytes)


@pytest.mark.parametrize("plan", ["data_parallel", "fsdp", "megatron"])
def test_async_collectives_hide_weight_collectives_behind_compute_and_nothing_else(plan):
  program = zoo_problem("gpt:layers=4,d_model=1024,batch=32", "data=2,model=4").program
  h100 = get_hardware("h100")
  synchronous = dataclasses.replace(h100, async_collectives=False)
  costs = []
  for hardware in (h100, synchronous):
    problem = Problem.build(program, make_mesh("data=2,model=4", hardware))
    costs.append(problem.cost(getattr(tactics, plan)(problem)))
  hidden, exposed = costs
  np.testing.assert_array_equal(hidden.comm_bytes, exposed.comm_bytes)
  np.testing.assert_allclose(hidden.compute_time, exposed.compute_time, rtol=1e-6)
  if plan == "megatron":  # Activation all-reduces: on the path of the ops that read them
    # (the embedding lookup's may run behind the ops beside it).
    assert 0.95 * float(exposed.comm_time) < float(hidden.comm_time) <= float(exposed.comm_time)
  else:  # Gradient reductions (and FSDP's weight gathers) run behind the compute.
    assert 0.0 < float(hidden.comm_time) < 0.5 * float(exposed.comm_time)
    assert float(exposed.comm_time) < float(exposed.compute_time)


def test_row_sums_split_into_groups_a_gpu_can_tile_give_the_same_sums(monkeypatch):
  from automap_rl.simulator import collectives

  terms = tuple(jax.random.normal(jax.random.key(i), (297, 128)) for i in range(30))
  whole = collectives.sum_rows(*terms)
  monkeypatch.setattr(collectives.jax, "default_backend", lambda: "gpu")
  reductions = [
    e
    for e in jax.make_jaxpr(collectives.sum_rows)(*terms).eqns
    if e.primitive.name.startswith("reduce")
  ]
  assert [len(e.invars) // 2 for e in reductions] == [16, 14]
  for grouped, one_pass in zip(collectives.sum_rows(*terms), whole, strict=True):
    np.testing.assert_array_equal(grouped, one_pass)


def test_jit_and_vmap_agree_with_unbatched_evaluation():
  problem = zoo_problem("gpt", "data=2,model=4")
  classes, axes = random_plans(problem, jax.random.key(3), 8, 6)
  batched = jax.jit(jax.vmap(problem.evaluate))(classes, axes)
  evaluate_one = jax.jit(problem.evaluate)  # One plan per call, no batch axis.
  for i in range(8):
    single = evaluate_one(classes[i], axes[i])
    for field in ("step_time", "peak_memory", "comm_bytes", "comm_count"):
      np.testing.assert_allclose(getattr(batched, field)[i], getattr(single, field), rtol=1e-5)


@settings(
  max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
  seed=st.integers(0, 2**16),
  length=st.sampled_from([4, 16, 40]),
  case=st.sampled_from([("gpt:layers=2", "data=2,model=4"), ("moe", "data=2,fsdp=2,model=2")]),
)
def test_edges_summed_by_class_cost_what_the_edges_cost_one_by_one(seed, length, case):
  """`evaluate` sums the collective terms of each class of edges that resolve alike
  (`CostTables.edge_unique`) once; `terms` keeps every edge: random plans cost the same
  up to float32 reassociation, field by field."""
  problem = zoo_problem(*case)
  classes, axes = random_plans(problem, jax.random.key(seed), 8, length)
  classes = jnp.where(
    jax.random.uniform(jax.random.key(seed + 1), classes.shape) < 0.1, -1, classes
  )  # Padding.
  summed = jax.jit(jax.vmap(problem.evaluate))(classes, axes)
  per_edge = jax.jit(
    jax.vmap(
      lambda c, a: simulator.total(
        problem.tables, simulator.terms(problem.tables, problem.resolve(c, a))
      )
    )
  )(classes, axes)
  assert problem.tables.unique_edge.shape < problem.tables.edge_op.shape
  for field in (
    "step_time",
    "compute_time",
    "comm_time",
    "peak_memory",
    "comm_bytes",
    "comm_count",
    "fits",
  ):
    np.testing.assert_allclose(
      getattr(summed, field), getattr(per_edge, field), rtol=1e-5, err_msg=field
    )


def _resolve_by_the_book(
  classes: np.ndarray, sizes: np.ndarray, axis_sizes, dec_class, dec_axis
) -> np.ndarray:
  """DESIGN.md's resolution, one owner and one decision at a time: the first slot of the
  decision's class whose owner does not use the axis yet and whose size divides takes it."""
  masks = np.zeros(classes.shape, np.int64)
  for cls, axis in zip(dec_class.tolist(), dec_axis.tolist()):
    for row in range(classes.shape[0]):
      if cls < 0 or np.bitwise_or.reduce(masks[row]) >> axis & 1:
        continue
      for slot in np.flatnonzero(classes[row] == cls):
        mask = masks[row, slot] | 1 << axis
        if sizes[row, slot] % np.prod([n for a, n in enumerate(axis_sizes) if mask >> a & 1]) == 0:
          masks[row, slot] = mask
          break
  return masks


@pytest.mark.parametrize(
  "spec, mesh, length",
  [
    ("gpt:layers=2", "data=2,model=4", 12),  # Attention scores: two seq dims in one owner.
    ("unet", "a=2,b=2,c=2,d=2", 12),  # Convolutions: 9 factors of 4 bits, two packed words.
    ("moe", "data=2,model=4", 130),  # Decision times past int8.
  ],
)
def test_resolution_follows_the_decision_semantics(spec, mesh, length):
  problem = zoo_problem(spec, mesh)
  sigs = problem.sigs
  classes, axes = random_plans(problem, jax.random.key(0), 16, length)
  classes = classes.at[:, -2:].set(-1)  # Padding.
  resolved = jax.jit(jax.vmap(problem.resolve))(classes, axes)
  for i in range(classes.shape[0]):
    plan = (problem.mesh.axis_sizes, np.asarray(classes[i]), np.asarray(axes[i]))
    np.testing.assert_array_equal(
      resolved.value_mask[i], _resolve_by_the_book(sigs.value_class, sigs.value_size, *plan)
    )
    np.testing.assert_array_equal(
      resolved.op_mask[i], _resolve_by_the_book(sigs.op_class, sigs.op_size, *plan)
    )


@pytest.mark.parametrize(
  "spec,mesh",
  [
    ("gpt:layers=2", "data=2,model=4"),
    ("moe", "data=2,fsdp=2,model=2"),
    pytest.param("unet", "data=8", marks=pytest.mark.slow),
    pytest.param("gnn", "data=2,model=4", marks=pytest.mark.slow),
  ],
)
def test_the_cost_is_the_sum_of_its_named_terms(spec, mesh):
  problem = zoo_problem(spec, mesh)
  for name, plan in tactics.applicable(problem).items():
    cost, terms = problem.cost(plan), problem.cost_terms(plan)
    # The simulator sums the edges of a class (`CostTables.edge_unique`) in one term, the
    # terms are per edge: the same sums up to float32 reassociation.
    np.testing.assert_allclose(
      jax.device_get(simulator.total(problem.tables, terms)).step_time, cost.step_time, rtol=1e-6
    )
    compute = terms.op_compute_s.sum(dtype=np.float64) + terms.value_compute_s.sum(dtype=np.float64)
    kinds = {
      "all-reduce": (terms.all_reduce,),
      "all-gather": (terms.gather,),
      "reduce-scatter": (terms.reduce_scatter,),
      "all-to-all": (terms.all_to_all,),
      "collective-permute": (terms.permute, terms.dot_permute),
    }
    total = lambda field, edges: sum(getattr(e, field).sum(dtype=np.float64) for e in edges)
    comm = sum(total("seconds", edges) for edges in kinds.values())
    # The weight reshards and weight-gradient reductions an H100 runs behind the compute add
    # what exceeds it, and at least one run of the longest.
    t = problem.tables
    reshard = np.where(
      t.edge_hideable,
      terms.gather.seconds + terms.all_to_all.seconds + terms.permute.seconds,
      0.0,
    )
    reduce = np.where(
      t.reduction_hideable,
      terms.all_reduce.seconds + terms.reduce_scatter.seconds + terms.dot_permute.seconds,
      0.0,
    )
    one_run = max(
      (reshard / np.maximum(t.edge_weight, 1.0)).max(initial=0.0),
      (reduce / np.maximum(t.reduction_weight, 1.0)).max(initial=0.0),
    )
    hideable = reshard.sum() + reduce.sum()
    unhidden = max(one_run, hideable - compute)
    np.testing.assert_allclose(compute, cost.compute_time, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(
      compute + comm - hideable + unhidden, cost.step_time, rtol=1e-5, err_msg=name
    )
    for kind, edges in kinds.items():
      i = COMM_KINDS.index(kind)
      np.testing.assert_allclose(total("bytes", edges), cost.comm_bytes[i], rtol=1e-5, atol=1)
      np.testing.assert_allclose(total("count", edges), cost.comm_count[i], rtol=1e-5, atol=1e-6)
    # One term per edge and op signature, so a report can name what each op costs.
    assert terms.gather.seconds.shape == problem.tables.edge_op.shape
    assert terms.all_reduce.seconds.shape == problem.tables.reduction_edge.shape
    assert terms.op_compute_s.shape == (len(problem.sigs.op_keys),)
