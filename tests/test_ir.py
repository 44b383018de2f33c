"""The IR: rules in factor form, tracing with inlining and loops, named dimensions."""

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automap_rl import ir, workloads
from automap_rl.ir import FactorKind, rules
from automap_rl.ir.trace import scan_counts
from automap_rl.simulator.fusion import fusion_copies, memory_traffic
from experiments.inspect_cmd import summarize

ZOO = ("mlp", "gpt", "gpt:scan=true", "moe", "gnn", "resnet", "unet")
# Every family at small size (the primitives do not depend on the size) and the scanned GPT.
EVERY_FAMILY = (*workloads.SMALL.values(), "gpt:scan=true")


@functools.cache
def traced(spec: str) -> ir.Program:
  return workloads.make_workload(spec, abstract=True).trace()


def _assert_factor_sizes_consistent(program: ir.Program) -> None:
  """Every operand and result dim of every op is the product of its factors' sizes."""
  for op in program.ops:
    rule = op.rule
    for values, dims in ((op.operands, rule.operand_dims), (op.results, rule.result_dims)):
      assert len(values) == len(dims), op
      for value_id, dim_factors in zip(values, dims):
        shape = program.values[value_id].shape
        assert len(dim_factors) == len(shape), (op.primitive, shape)
        for size, factors in zip(shape, dim_factors):
          product = 1
          for f in factors:
            product *= rule.factor_sizes[f]
          assert product == size, (op.primitive, shape, factors, rule.factor_sizes)


@pytest.mark.parametrize("spec", EVERY_FAMILY)
def test_every_family_traces_with_known_primitives_and_consistent_factor_sizes(spec):
  """The primitives every workload family emits all have rules: none falls back to the
  conservative rule (which warns and replicates)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # A fallback warns: fail on it.
    program = workloads.make_workload(spec, abstract=True).trace()
  primitives = {op.primitive for op in program.ops}
  assert program.unknown_primitives == ()
  assert primitives <= set(rules.REGISTRY), sorted(primitives - set(rules.REGISTRY))
  _assert_factor_sizes_consistent(program)


# Functions emitting primitives that third-party models use and the zoo does not.
THIRD_PARTY = {
  "stack": lambda x: jnp.stack([x, 2 * x, x + 1], axis=1),
  "unstack": lambda x: sum(jnp.unstack(x, axis=1)),
  "tile": lambda x: jnp.tile(x, (2, 1, 3)),
  "reduce": lambda x: jax.lax.reduce(  # A variadic arg-max: no gradient.
    (x, x + 1),
    (-jnp.inf, 0.0),
    lambda a, b: tuple(jnp.where(a[0] > b[0], u, v) for u, v in zip(a, b)),
    (1,),
  )[1],
  "approx_top_k": lambda x: jax.lax.approx_max_k(x, 2)[0],
  "le_to": lambda x: jnp.searchsorted(jnp.sort(x[0, 0]), x[0, 1]),
  "bessel_i0e": jax.scipy.special.i0e,
  "fft": lambda x: jnp.abs(jnp.fft.rfft(x)),
  "cholesky": lambda x: jnp.linalg.cholesky(
    x[..., :3, :3] @ jnp.swapaxes(x[..., :3, :3], -1, -2) + jnp.eye(3)
  ),
  "scatter-sub": lambda x: x.at[:, 0].subtract(1.0),
  "grouped conv": lambda x: jax.lax.conv_general_dilated(
    x,
    jnp.ones((4, x.shape[1] // 2, 3)),
    (1,),
    "SAME",
    feature_group_count=2,
    dimension_numbers=("NCH", "OIH", "NCH"),
  ),
}


@pytest.mark.parametrize("name", THIRD_PARTY)
def test_third_party_primitives_have_rules_with_consistent_factor_sizes(name):
  """Each function and its gradient (where it has one) trace with no fallback; the
  primitive is in them."""
  fn = THIRD_PARTY[name]
  step = (
    fn if name in ("le_to", "reduce") else jax.value_and_grad(lambda x: jnp.sum(jnp.abs(fn(x))))
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    program = ir.trace(step, jnp.linspace(0.5, 1.5, 4 * 6 * 4).reshape(4, 6, 4))
  assert name.split()[-1].replace("conv", "conv_general_dilated") in {
    op.primitive for op in program.ops
  }
  _assert_factor_sizes_consistent(program)


@settings(max_examples=25, deadline=None)
@given(
  shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
  axis=st.integers(0, 3),
  count=st.integers(1, 3),
  reps=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_stack_unstack_and_tile_rules_keep_every_dim_whole(shape, axis, count, reps):
  """For any shapes: every dim is its factors' product, and a dim passes through exactly
  when its size is unchanged and its data is not rearranged."""
  x = jnp.ones(shape)
  axis %= len(shape) + 1
  stacked = _rule(lambda x: jnp.stack([x] * count, axis=axis), x, primitive="stack")
  (out,) = stacked.result_dims
  for dim, factors in enumerate(
    out
  ):  # The new dim is the result's own; the rest are the operands'.
    owners = [
      i for i, dims in enumerate(stacked.operand_dims) for d in dims if factors and d == factors
    ]
    assert len(owners) == (0 if dim == axis or shape[dim - (dim > axis)] == 1 else count)
  for program in (
    ir.trace(lambda x: jnp.stack([x] * count, axis=axis), x),
    ir.trace(lambda x: jnp.tile(x, reps), x),
    ir.trace(lambda x: jnp.unstack(x, axis=axis % len(shape)), x),
  ):
    _assert_factor_sizes_consistent(program)
  tiled = (
    _rule(lambda x: jnp.tile(x, reps), x, primitive="tile")
    if len(reps) <= len(shape) and any(r > 1 for r in reps)
    else None
  )
  if tiled is not None:
    reps_ = (1,) * (len(shape) - len(reps)) + tuple(reps)
    for dim, (size, rep) in enumerate(zip(shape, reps_)):
      factors = tiled.result_dims[0][dim]
      assert [tiled.factor_sizes[f] for f in factors] == [n for n in (rep, size) if n > 1]
      if (
        size > 1
      ):  # The operand's dim is the minor factor: a shard of it is never a block of the result.
        assert tiled.operand_dims[0][dim] == factors[-1:]


def _rule(fn, *args, primitive=None):
  program = ir.trace(fn, *args)
  (op,) = [o for o in program.ops if primitive in (None, o.primitive)]
  return op.rule


def test_dot_general_contracting_dim_is_a_reduction():
  rule = _rule(lambda x, w: x @ w, jnp.ones((8, 16)), jnp.ones((16, 4)))
  assert rule.factor_sizes == (8, 4, 16)
  assert rule.factor_kinds == (
    FactorKind.PASS_THROUGH,
    FactorKind.PASS_THROUGH,
    FactorKind.REDUCTION,
  )
  assert rule.operand_dims == (((0,), (2,)), ((2,), (1,)))
  assert rule.result_dims == (((0,), (1,)),)


def test_reshape_splits_a_merged_dim_into_major_and_minor_factors():
  rule = _rule(lambda x: x.reshape(4, 8, 2, 16), jnp.ones((4, 8, 32)))
  assert rule.operand_dims == (((0,), (1,), (2, 3)),)
  assert rule.result_dims == (((0,), (1,), (2,), (3,)),)
  assert rule.factor_sizes == (4, 8, 2, 16)


def test_reshape_without_common_refinement_needs_replication():
  rule = _rule(lambda x: x.reshape(4, 6), jnp.ones((6, 4)))
  kinds = [rule.factor_kinds[f] for dim in rule.result_dims[0] for f in dim]
  assert FactorKind.NEED_REPLICATION in kinds
  assert rule.factor_sizes[0] == 2  # The common major factor survives.


@pytest.mark.parametrize("table_role", ["parameter", "input"])
def test_a_lookup_splits_a_parameters_rows_and_gathers_datas_whole(table_role):
  """An SGD step on an embedding lookup: batch and feature dims pass through; a parameter
  table's rows are a reduction of the gather (each shard gathers the rows it holds, the
  partial results summed) and pass through the gradient's scatter-add (each shard adds to
  its rows). Rows that are the step's data need replication in both."""
  loss = lambda t, i: jnp.sum(jnp.take(t, i, axis=0, mode="clip") ** 2)
  program = ir.trace(
    lambda t, i: t - 0.1 * jax.grad(loss)(t, i),
    jnp.ones((256, 32)),
    jnp.zeros((8, 16), jnp.int32),
    arg_roles=(table_role, "input"),
  )
  (gather,) = [op for op in program.ops if op.primitive == "gather"]
  (scatter,) = [op for op in program.ops if op.primitive.startswith("scatter")]
  gathered = dict(zip(gather.rule.factor_sizes, gather.rule.factor_kinds))
  added = dict(zip(scatter.rule.factor_sizes, scatter.rule.factor_kinds))
  assert gathered[32] == gathered[8] == gathered[16] == FactorKind.PASS_THROUGH
  assert added[8] == added[16] == FactorKind.REDUCTION  # Partial sums over the tokens.
  if table_role == "parameter":
    assert gathered[256] == FactorKind.REDUCTION and added[256] == FactorKind.PASS_THROUGH
  else:
    assert gathered[256] == added[256] == FactorKind.NEED_REPLICATION


def test_unknown_primitive_gets_conservative_rule_and_one_warning():
  prim = jax.extend.core.Primitive("mystery_op")
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    program = ir.trace(lambda x: prim.bind(prim.bind(x)), jnp.ones((4, 8)))
  assert program.unknown_primitives == ("mystery_op",)
  assert sum("mystery_op" in str(w.message) for w in caught) == 1
  for op in program.ops:
    assert set(op.rule.factor_kinds) == {FactorKind.NEED_REPLICATION}


def test_one_minus_square_is_elementwise_with_the_flops_of_its_lowering():
  # jax 0.11's primitive (tanh's derivative), stood in for by one of the same name where
  # the installed jax lacks it; XLA computes it as (1 + x) * (1 - x).
  prim = getattr(jax.lax, "one_minus_square_p", None)
  if prim is None:
    prim = jax.extend.core.Primitive("one_minus_square")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  program = ir.trace(prim.bind, jnp.ones((4, 8)))
  (op,) = program.ops
  assert program.unknown_primitives == ()
  assert set(op.rule.factor_kinds) == {FactorKind.PASS_THROUGH}
  assert op.flops == 3 * 4 * 8


def test_scan_body_is_inlined_once_with_trip_count_and_tied_carries():
  def fn(x, ws):
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

  program = ir.trace(fn, jnp.ones((8, 16)), jnp.ones((5, 16, 16)))
  dots = [op for op in program.ops if op.primitive == "dot_general"]
  assert len(dots) == 1 and dots[0].repeat == 5
  # Body ops have origins through the scan's equation (eqn 0), as `lower` interprets it;
  # the IR's own scan_* ops have none.
  assert {op.primitive: op.origin for op in program.ops if op.origin} == {
    "dot_general": (0, 0),
    "tanh": (0, 1),
  }
  assert len(program.ties) == 1
  named = ir.analyze(program)
  x_in, ws = program.inputs
  out = program.outputs[0]
  assert named.class_of(x_in, 1) == named.class_of(out, 1) == named.class_of(ws, 2)


class _Groups:
  """Stands in for jax 0.11's `ft_in` flat tree: `unpack()` gives (consts, carries, xs)."""

  def __init__(self, *groups):
    self.groups = groups

  def unpack(self):
    return self.groups


def test_scan_counts_read_both_param_layouts():
  # The installed jax's own scan: two closed-over arrays are its consts, one carry, one xs.
  def fn(a, b, x, ws):
    return jax.lax.scan(lambda h, w: (h @ w * a + b, None), x, ws)[0]

  closed = jax.make_jaxpr(fn)(jnp.ones(16), jnp.ones(16), jnp.ones((8, 16)), jnp.ones((5, 16, 16)))
  (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  assert scan_counts(scan.params) == (2, 1)
  # jax up to 0.10 names the counts; jax 0.11 groups the operands in `ft_in`.
  assert scan_counts({"num_consts": 3, "num_carry": 2, "length": 4}) == (3, 2)
  assert scan_counts({"ft_in": _Groups((None,) * 3, (None,) * 2, (None,)), "length": 4}) == (3, 2)
  assert scan_counts({"ft_in": _Groups((), (None,), (None,) * 4)}) == (0, 1)


def test_cond_inlines_every_branch_and_merges_results():
  def fn(p, x):
    return jax.lax.cond(p, lambda a: a * 2.0, jnp.sin, x)

  program = ir.trace(fn, True, jnp.ones((8,)))
  primitives = [op.primitive for op in program.ops]
  assert "mul" in primitives and "sin" in primitives and "cond_merge" in primitives


def test_argument_paths_and_roles():
  program = traced("gpt")
  paths = {program.values[v].path: program.values[v].role for v in program.inputs}
  assert paths["params/block_0/mlp/fc1/kernel"] == ir.Role.PARAMETER
  assert paths["opt_state/0/mu/block_0/mlp/fc1/kernel"] == ir.Role.OPTIMIZER_STATE
  assert paths["batch/inputs"] == ir.Role.INPUT
  assert any(program.values[v].role == ir.Role.OUTPUT for v in program.outputs)


@pytest.mark.parametrize("spec", ["gpt:layers=12", "gpt:layers=12,scan=true"])
def test_gpt_named_dims_groups_and_conflict(spec):
  program = traced(spec)
  named = ir.analyze(program)
  summary = summarize(program, named)

  def class_of(path, dim):
    return named.class_of(program.input_by_path(path).id, dim)

  layer = "blocks" if "scan" in spec else "block_{}"
  dim_offset = 1 if "scan" in spec else 0  # Scanned parameters lead with the layer dim.
  batch = class_of("batch/inputs", 0)
  seq = class_of("batch/inputs", 1)
  embed = class_of(f"params/{layer.format(0)}/mlp/fc1/kernel", dim_offset)
  ffn = [class_of(f"params/{layer.format(i)}/mlp/fc1/kernel", dim_offset + 1) for i in range(12)]
  heads = [
    class_of(f"params/{layer.format(i)}/attn/query/kernel", dim_offset + 1) for i in range(12)
  ]
  assert len({batch, seq, embed, ffn[0], heads[0]}) == 5
  assert named.classes[batch].size == 16 and named.classes[embed].size == 128
  assert named.classes[ffn[0]].size == 512 and named.classes[heads[0]].size == 4
  if "scan" in spec:  # One stacked parameter: one class for all layers.
    assert len(set(ffn)) == 1 and len(set(heads)) == 1
  else:  # One class per layer, all in one group.
    assert len(set(ffn)) == 12 and len({named.classes[c].group for c in ffn}) == 1
    assert len(named.groups[named.classes[ffn[0]].group]) == 12
    assert len({named.classes[c].group for c in heads}) == 1
  assert any(c["class_id"] == seq and c["kind"] == "value" for c in summary["conflicts"])
  assert summary["unknown_primitives"] == []


def _xla_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"])


@pytest.mark.parametrize(
  "strides, padding, lhs_dilation, rhs_dilation",
  [
    ((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1)),
    ((2, 2), ((0, 1), (0, 1)), (1, 1), (1, 1)),
    ((1, 1), ((2, 1), (2, 1)), (2, 2), (1, 1)),
    ((1, 1), ((0, 1), (0, 1)), (1, 1), (2, 2)),
  ],
)
def test_conv_flops_count_only_taps_inside_the_input_as_xla_does(
  strides, padding, lhs_dilation, rhs_dilation
):
  lhs, rhs = jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
  fn = lambda x, w: jax.lax.conv_general_dilated(x, w, strides, padding, lhs_dilation, rhs_dilation)
  program = ir.trace(fn, lhs, rhs)
  (conv,) = [op for op in program.ops if op.primitive == "conv_general_dilated"]
  assert conv.flops == _xla_flops(fn, lhs, rhs)
  assert conv.flops < 2 * program.values[conv.results[0]].size * 3 * 3 * 3  # Not the full window.


def test_elementwise_reduction_and_dot_flops_follow_cost_analysis():
  x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
  fn = lambda x, w: (jnp.tanh(x @ w) * 2.0 + 1.0).sum(axis=1)
  program = ir.trace(fn, x, w)
  flops = {op.primitive: op.flops for op in program.ops}
  assert flops["dot_general"] == 2 * 16 * 32 * 8
  assert flops["tanh"] == 0  # A transcendental: XLA counts it apart.
  assert flops["reduce_sum"] == 16 * 8 - 16
  assert sum(op.flops for op in program.ops) == _xla_flops(fn, x, w)


def _fused_flops(program: ir.Program) -> float:
  return sum(op.flops * n for op, n in zip(program.ops, fusion_copies(program)))


@pytest.mark.parametrize(
  "size, producer, copies",
  [
    (32, lambda x: x * 2.0 + x, 2),  # Cheap: cloned into both reduction fusions.
    (32, jnp.exp, 1),  # Expensive: computed once, read by both.
    (128, lambda x: x * 2.0 + x, 1),  # Library reductions (4096 elements) fuse nothing they share.
  ],
)
def test_fusion_copies_clone_cheap_producers_into_each_fusion_that_reads_them(
  size, producer, copies
):
  fn = lambda x: (lambda y: (y.sum(axis=0), y.sum(axis=1)))(producer(x))
  x = jnp.ones((size, size))
  program = ir.trace(fn, x)
  first = program.ops[0]
  assert fusion_copies(program)[0] == copies, first.primitive
  assert _fused_flops(program) == _xla_flops(fn, x)


def test_fusion_copies_drop_what_cse_merges():
  fn = lambda x: jnp.sum(jnp.exp(x) * 3.0) + jnp.sum(jnp.exp(x) * 3.0)
  x = jnp.ones((64, 64))
  program = ir.trace(fn, x)
  assert fusion_copies(program) == (1, 1, 1, 0, 0, 0, 1)
  assert _fused_flops(program) == _xla_flops(fn, x)


def _block(params, x):
  """Pre-LayerNorm MLP block with a GELU: cheap chains that several fusions read."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * params["g"] + params["b"]
  return jnp.sum((jax.nn.gelu(h @ params["w1"]) @ params["w2"]) ** 2)


def _conv_relu(w, x):
  y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jnp.sum(jax.nn.relu(y * 2.0 + 1.0) ** 2)


@pytest.mark.parametrize(
  "fn, args",
  [
    # Batch 1: small reductions (loop fusions), 3-d activations reshaped for the dots.
    (
      _block,
      (
        {
          "g": jnp.ones(32),
          "b": jnp.zeros(32),
          "w1": jnp.ones((32, 128)),
          "w2": jnp.ones((128, 32)),
        },
        jnp.ones((1, 16, 32)),
      ),
    ),
    # Batch 8: 4096-element reductions go to the library.
    (
      _block,
      (
        {
          "g": jnp.ones(32),
          "b": jnp.zeros(32),
          "w1": jnp.ones((32, 128)),
          "w2": jnp.ones((128, 32)),
        },
        jnp.ones((8, 16, 32)),
      ),
    ),
    (lambda w, x: jnp.sum(jax.nn.log_softmax(x @ w)), (jnp.ones((32, 32)), jnp.ones((64, 32)))),
    # The weight gradient reads the activation transposed: its producers are recomputed.
    (_conv_relu, (jnp.ones((3, 3, 8, 8)), jnp.ones((4, 8, 8, 8)))),
  ],
)
def test_fused_flops_of_training_steps_follow_the_compiled_module(fn, args):
  step = jax.value_and_grad(fn)
  program = ir.trace(step, *args)
  compiled = _xla_flops(step, *args)
  assert abs(_fused_flops(program) - compiled) <= 0.005 * compiled


def memory_bytes(
  program: ir.Program, multi_output_fusion: bool = True, minor_concatenate_fusion: bool = True
) -> list[float]:
  """Bytes each op moves, its operands' and results' summed."""
  return [
    sum(reads) + sum(writes)
    for reads, writes in memory_traffic(program, multi_output_fusion, minor_concatenate_fusion)
  ]


def test_memory_traffic_of_a_fused_elementwise_chain_is_its_ends():
  """x @ w feeds a chain of elementwise ops that XLA fuses into one loop: the dot reads
  its operands and writes its result; the chain reads the dot's result once and writes
  only what the program returns."""
  x, w = jnp.ones((32, 64)), jnp.ones((64, 16))
  program = ir.trace(lambda x, w: jnp.tanh(x @ w) * 2.0 + 1.0, x, w)
  traffic = memory_bytes(program)
  by_primitive = {op.primitive: traffic[op.id] for op in program.ops}
  out_bytes = 32 * 16 * 4
  assert by_primitive["dot_general"] == x.nbytes + w.nbytes + out_bytes
  assert by_primitive["tanh"] == out_bytes  # Reads the dot's result, writes into the fusion.
  assert by_primitive["mul"] == 0.0  # Inside the fusion.
  assert by_primitive["add"] == out_bytes  # Writes the program's output.


def test_an_optimizer_update_moves_what_each_backend_fuses():
  """Adam's update of one parameter: XLA:CPU has no multi-output fusion, so each new
  moment is a fusion of its own that the parameter's fusion reads back (10 passes over the
  parameter's size, its compiled module's bytes); with multi-output fusion (XLA:GPU) one
  fusion reads the gradient, the parameter and the moments once and writes three (7).
  Each fusion reads the gradient once, however many of its ops read it."""

  def update(w, g, m, v):
    m = 0.9 * m + 0.1 * g
    v = 0.99 * v + 0.01 * g * g
    return w - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

  x = jnp.ones((256, 256))
  compiled = (
    jax.jit(update, donate_argnums=(0, 2, 3))
    .lower(x, x, x, x)
    .compile()
    .cost_analysis()["bytes accessed"]
  )
  program = ir.trace(update, x, x, x, x)
  assert compiled == pytest.approx(10 * x.nbytes, abs=64)  # And a few scalar constants.
  assert sum(memory_bytes(program, multi_output_fusion=False)) == 10 * x.nbytes
  assert sum(memory_bytes(program, multi_output_fusion=True)) == 7 * x.nbytes


def _two_outputs(x, y):
  shared = x * y  # Cheap: each output's fusion computes it.
  return shared + 1.0, shared - 1.0


def _a_sum_and_an_output(x, y):
  shared = jnp.tanh(x * y)  # Expensive: written once, read by both fusions.
  return (shared + 1.0).sum(1), shared * 3.0


@pytest.mark.parametrize("fn", [_two_outputs, _a_sum_and_an_output], ids=["cheap", "expensive"])
def test_without_multi_output_fusion_each_fusion_has_one_result(fn):
  """XLA:CPU's fusions write one result each: a value two of them need is computed by
  each, reading its inputs again, when it is cheap, and written once and read by each
  when it is expensive (a transcendental); the program's traffic is the bytes XLA:CPU's
  compiled module accesses. With multi-output fusion, one fusion reads the inputs once."""
  x = jnp.ones((256, 128))
  compiled = jax.jit(fn).lower(x, x).compile().cost_analysis()["bytes accessed"]
  program = ir.trace(fn, x, x)
  assert sum(memory_bytes(program, multi_output_fusion=False)) == pytest.approx(compiled, rel=1e-3)
  assert sum(memory_bytes(program, multi_output_fusion=True)) < 0.8 * compiled


def _normalized(x):
  return (x - x.mean(0)) / jnp.sqrt(((x - x.mean(0)) ** 2).mean(0) + 1e-5)


def _relu_sums(x, y):
  return (jnp.maximum(x, 0.0) * y).sum(0) + jnp.maximum(x, 0.0).sum(0)


def test_an_op_computed_again_is_one_of_an_earlier_op():
  """`x - x.mean(0)` written twice: the second mean, its division, broadcast and
  subtraction compute what the first ones did (`Op.same_as`), as XLA's common
  subexpression elimination finds; the square of the second does not."""
  program = ir.trace(_normalized, jnp.ones((8, 4)))
  subs = [op for op in program.ops if op.primitive == "sub"]
  assert [op.same_as for op in subs] == [-1, subs[0].id]
  again = [op for op in program.ops if op.same_as >= 0]
  assert [op.primitive for op in again] == ["reduce_sum", "div", "broadcast_in_dim", "sub"]
  assert all(program.ops[op.same_as].primitive == op.primitive for op in again)


@pytest.mark.parametrize("fn", [_normalized, _relu_sums], ids=["normalized", "relu_sums"])
def test_a_value_computed_once_for_reductions_is_written_and_read_by_each(fn):
  """A value the program computes twice and XLA once (common subexpressions), read by two
  fusions one of which is a reduction's: XLA:CPU writes it once and each fusion reads it;
  the program's traffic is the bytes its compiled module accesses."""
  x = jnp.ones((1024, 256))
  args = (x,) * fn.__code__.co_argcount
  compiled = jax.jit(fn).lower(*args).compile().cost_analysis()["bytes accessed"]
  program = ir.trace(fn, *args)
  assert sum(memory_bytes(program, multi_output_fusion=False)) == pytest.approx(compiled, rel=0.01)


def test_a_concatenate_along_the_minor_dim_is_a_kernel_of_its_own_on_xla_cpu():
  """A graph network's edge update: the senders' and receivers' node features gathered
  and concatenated with the edge features on the last dim feed a dot. XLA:CPU fuses the
  concatenate with nothing: each gather writes its rows and the concatenate reads them back
  (the compiled module's bytes); where concatenates fuse, the gathers are read inside it."""

  def edge_update(nodes, edges, senders, receivers, w):
    return jnp.tanh(jnp.concatenate([nodes[senders], nodes[receivers], edges], axis=-1) @ w)

  nodes, edges, w = jnp.ones((256, 64)), jnp.ones((2048, 64)), jnp.ones((192, 64))
  indices = jnp.zeros(2048, jnp.int32)
  args = (nodes, edges, indices, indices, w)
  compiled = jax.jit(edge_update).lower(*args).compile().cost_analysis()["bytes accessed"]
  program = ir.trace(edge_update, *args)
  assert (
    sum(memory_bytes(program, multi_output_fusion=False, minor_concatenate_fusion=False))
    == compiled
  )
  # Each gather's rows written once and read once more.
  fused = sum(memory_bytes(program, multi_output_fusion=False, minor_concatenate_fusion=True))
  assert (
    fused == compiled - 2 * 2 * edges.nbytes - nodes.nbytes
  )  # And the table read once by one fusion.


@pytest.mark.parametrize(
  "fn",
  [
    lambda x, w: jnp.tanh((x @ w)[:, :64]),
    lambda x, w: jnp.tanh(jax.lax.dynamic_slice_in_dim(x @ w, 128, 64, axis=1)),
    # Slices of the arguments feed a dot; its result updates the first dot's in place.
    lambda x, w: jax.lax.dynamic_update_slice_in_dim(
      x @ w, jnp.tanh(x[:, :8] @ w[:8, :64]), 128, axis=1
    ),
  ],
  ids=["slice", "dynamic_slice", "dynamic_update_slice"],
)
def test_slices_move_what_they_keep_and_an_update_slice_what_it_writes(fn):
  """A slice or dynamic slice of a dot's result reads the elements it keeps, not the whole
  result; a dynamic-update-slice writes its update into its operand's buffer in place:
  the program's memory traffic is the bytes XLA's compiled module accesses."""
  x, w = jnp.ones((256, 64)), jnp.ones((64, 512))
  compiled = jax.jit(fn).lower(x, w).compile().cost_analysis()["bytes accessed"]
  assert sum(memory_bytes(ir.trace(fn, x, w))) == compiled


def test_a_scan_iteration_reads_and_writes_its_slice_not_the_stack():
  """`scan` over 64 steps: each iteration's slice of the stacked input and of the stacked
  output moves one step's bytes (a dynamic-slice, an in-place dynamic-update-slice), so
  the loop's traffic grows with its length, not with its square."""
  xs = jnp.ones((64, 8, 16))
  program = ir.trace(
    lambda xs: jax.lax.scan(lambda c, x: (c + x, c * x), jnp.zeros((8, 16)), xs), xs
  )
  traffic = memory_bytes(program)
  step_bytes = 8 * 16 * 4
  moved = {
    op.primitive: (op.repeat, traffic[op.id])
    for op in program.ops
    if op.primitive.startswith("scan_")
  }
  assert moved["scan_slice"] == (64, 2 * step_bytes)
  assert moved["scan_stack"] == (64, 2 * step_bytes)


@pytest.mark.parametrize("groups", ["none", "feature", "batch"])
def test_conv_batch_group_factor_is_the_kernel_gradients_group(groups):
  """The kernel gradient of a depthwise convolution is a batch-grouped convolution whose
  group factor (the channels) a backend may compute dense; the forward (feature-grouped)
  and ungrouped convolutions have none."""
  channels = 6
  x, w = jnp.ones((4, channels, 16)), jnp.ones((channels, 1 if groups != "none" else channels, 3))
  conv = functools.partial(
    jax.lax.conv_general_dilated,
    window_strides=(1,),
    padding="SAME",
    feature_group_count=1 if groups == "none" else channels,
  )
  fn = (lambda x, w: jax.grad(lambda w: conv(x, w).sum())(w)) if groups == "batch" else conv
  convs = [op for op in ir.trace(fn, x, w).ops if op.primitive == "conv_general_dilated"]
  group_sizes = [
    op.rule.factor_sizes[f] for op in convs if (f := rules.conv_batch_group_factor(op.rule)) >= 0
  ]
  assert group_sizes == (
    [channels] if groups == "batch" else []
  )  # The gradient's trace has the forward too.


def test_non_trainable_state_has_a_role_of_its_own():
  """Batch-norm statistics are `state`: neither parameters (FSDP shards those) nor
  optimizer state."""
  program = workloads.make_workload(workloads.SMALL["wresnet"], abstract=True).trace()
  roles = {program.values[v].path.split("/")[0]: program.values[v].role for v in program.inputs}
  assert roles == {
    "params": ir.Role.PARAMETER,
    "opt_state": ir.Role.OPTIMIZER_STATE,
    "model_state": ir.Role.STATE,
    "batch": ir.Role.INPUT,
  }
