"""Tests for the model zoo ``automap_rl.workloads``."""

import collections

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from automap_rl.workloads import (
  FAMILIES,
  SMALL,
  lstm,
  make_workload,
  moe,
  parse_model_spec,
  spec,
  ssm,
  vit,
)
from automap_rl.xla.numerics import reference_outputs

# The largest preset of every family with presets.
LARGEST = (
  "gpt:size=39b",
  "moe:size=70b",
  "llama:size=70b",
  "t5:size=xxl",
  "vit:size=22b",
  "wresnet:size=13b",
  "unet:size=sd-1.5",
  "gnn:size=graphcast",
  "ssm:size=2.8b",
  "lstm:size=8192-2048",
  "dit:size=xl-2",
)


def _shapes(tree):
  return jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), tree)


def test_every_family_has_a_small_spec_and_a_style():
  assert set(SMALL) == set(FAMILIES) == set(spec.STYLES)
  assert set(spec.STYLES.values()) == {"flax.linen", "flax.nnx", "haiku", "equinox"}


# Two families (flax linen, flax nnx) in `make test`; every family in `make test-all`.
FAST_FAMILIES = ("gpt", "llama")


@pytest.mark.parametrize(
  "name", [n if n in FAST_FAMILIES else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES]
)
def test_step_runs_preserves_structure_and_lowers_the_loss(name):
  w = make_workload(SMALL[name])
  stateful = w.model_state is not None
  assert w.arg_names == (
    ("params", "opt_state", "model_state", "batch")
    if stateful
    else ("params", "opt_state", "batch")
  )
  step = jax.jit(w.step)
  out = step(*w.args)
  assert _shapes(out[:-1]) == _shapes(w.args[:-1])
  if stateful:  # Batch-norm statistics: state the step updates, not parameters.
    assert w.arg_roles == ("parameter", "optimizer_state", "state", "input")
    before, after = jax.tree_util.tree_leaves(w.model_state), jax.tree_util.tree_leaves(out[2])
    assert not all(np.allclose(a, b) for a, b in zip(before, after))
  for leaf in jax.tree_util.tree_leaves(w.params):
    assert leaf.dtype == jnp.float32
  losses = [out[-1]]
  for _ in range(2):
    out = step(*out[:-1], w.batch)
    losses.append(out[-1])
  assert all(loss.shape == () and np.isfinite(loss) for loss in losses)
  assert losses[-1] < losses[0]
  # The numerics check's float64 reference runs in float64 throughout (nothing in the
  # step narrows it back to float32) and agrees with the float32 step.
  reference = reference_outputs(w.step, w.args)
  assert reference.note == "float64"
  for p, r in zip(
    jax.tree_util.tree_leaves(reference.plain), jax.tree_util.tree_leaves(reference.float64)
  ):
    assert r.dtype == (np.float64 if jnp.issubdtype(p.dtype, jnp.floating) else p.dtype)
  np.testing.assert_allclose(reference.float64[-1], reference.plain[-1], rtol=1e-3)


@pytest.mark.parametrize(
  "spec_",
  [
    s if s.split(":")[0] in FAST_FAMILIES else pytest.param(s, marks=pytest.mark.slow)
    for s in LARGEST
  ],
)
def test_full_size_abstract_builds_allocate_nothing(spec_):
  w = make_workload(spec_, abstract=True)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(w.args))
  assert w.name == spec_


def _paths(tree, is_leaf=None):
  return {
    jax.tree_util.keystr(path, simple=True, separator="/")
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  }


def test_flax_linen_trees_are_module_dicts_of_kernels():
  for name in ("gpt", "moe", "unet", "wresnet"):
    params = make_workload(SMALL[name], abstract=True).params
    assert type(params) is dict
    leaf_names = {p.rsplit("/", 1)[-1] for p in _paths(params)}
    assert "kernel" in leaf_names and leaf_names <= {
      "kernel",
      "bias",
      "scale",
      "embedding",
      "pos_embed",
      "wi",
      "bi",
      "wo",
      "bo",
    }, name
  state = make_workload(SMALL["wresnet"], abstract=True).model_state
  assert {p.rsplit("/", 1)[-1] for p in _paths(state)} == {"mean", "var"}


def test_flax_nnx_tree_is_a_state_of_params():
  params = make_workload("llama", abstract=True).params
  assert isinstance(params, nnx.State)
  variables = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert variables and all(isinstance(v, nnx.Param) for v in variables)
  assert "layers/attn/q_proj/kernel/value" in _paths(params)
  assert params["layers"]["attn"]["k_proj"]["kernel"].shape == (2, 64, 32)  # GQA: 2 of 4 heads.


def test_haiku_trees_map_module_paths_to_parameter_dicts():
  for name in ("t5", "gnn", "mlp", "resnet"):
    params = make_workload(SMALL[name], abstract=True).params
    assert all(
      isinstance(v, dict) and all(not isinstance(x, dict) for x in v.values())
      for v in params.values()
    ), name
  t5_params = make_workload("t5", abstract=True).params
  assert t5_params["encoder/layer_stack/layer/self_attention/q"]["w"].shape == (2, 64, 64)


def test_equinox_trees_are_modules_with_out_in_weights():
  model = make_workload("vit", abstract=True).params
  assert isinstance(model, vit.ViT)
  assert model.blocks.mlp.fc1.weight.shape == (2, 64, 32)  # [layers, out, in]
  mamba = make_workload("ssm", abstract=True).params
  assert isinstance(mamba, ssm.Mamba) and isinstance(mamba, eqx.Module)
  assert mamba.layers.mixer.in_proj.weight.shape == (2, 128, 32)


def test_parse_model_spec_converts_types():
  assert parse_model_spec("gpt") == ("gpt", {})
  assert parse_model_spec("gpt:layers=12,d_model=768,scan=true") == (
    "gpt",
    {"layers": 12, "d_model": 768, "scan": True},
  )
  name, kwargs = parse_model_spec("moe:capacity_factor=1.5,scan=False")
  assert name == "moe" and kwargs == {"capacity_factor": 1.5, "scan": False}
  assert type(kwargs["capacity_factor"]) is float


def test_presets_expand_and_round_trip():
  name, kwargs = parse_model_spec("gpt:batch=8,size=1.3b")
  assert name == "gpt" and kwargs["d_model"] == 2048 and kwargs["batch"] == 8
  assert parse_model_spec("gpt:size=1.3b,layers=2")[1]["layers"] == 2
  w = make_workload("gpt:batch=8,size=1.3b", abstract=True)
  assert w.name == "gpt:size=1.3b,batch=8"
  assert make_workload(w.name, abstract=True).name == w.name
  for family in FAMILIES:
    for size in spec.presets(family):
      assert spec.canonical_spec(f"{family}:size={size}") == f"{family}:size={size}"


@pytest.mark.parametrize(
  "spec_, match",
  [
    ("transformer:layers=2", r"unknown model 'transformer'.*gpt.*unet"),
    ("gpt:depth=3", r"unknown key 'depth'.*valid keys: layers, d_model.*size"),
    ("resnet:size=18", r"unknown size '18' for model 'resnet'; valid sizes: none"),
    ("mlp:size=1b", r"unknown size '1b' for model 'mlp'; valid sizes: 4x4096, 8x8192"),
    ("gpt:size=7b", r"unknown size '7b'.*350m, 1.3b"),
    ("gpt:size=1.3b,size=350m", r"'size' given twice"),
    ("gpt:layers=1,layers=2", r"'layers' given twice"),
    ("gpt:scan=yes", r"'yes'.*'scan'"),
    ("gpt:layers=two", r"'two'.*'layers'"),
    ("gpt:layers", r"key=value"),
    ("gpt:dtype=float16", r"dtype='float16'.*float32, bfloat16"),
    ("moe:dispatch=sort", r"dispatch='sort' is not one of einsum, gather"),
  ],
)
def test_parse_model_spec_errors(spec_, match):
  with pytest.raises(ValueError, match=match):
    make_workload(spec_, abstract=True)


def test_canonical_name_lists_non_default_fields():
  w = make_workload("mlp:width=64,layers=2,batch=8")
  assert w.name == "mlp:width=64,batch=8"
  assert jax.tree_util.tree_leaves(w.batch)[0].shape[0] == 8


def test_gpt_param_paths():
  params = make_workload("gpt", abstract=True).params
  assert params["block_0"]["attn"]["query"]["kernel"].shape == (128, 4, 32)
  assert set(params["block_1"]["mlp"]) == {"fc1", "fc2"}


def test_gpt_scan_stacks_blocks_into_a_scan():
  w = make_workload("gpt:scan=true", abstract=True)
  assert "block_0" not in w.params
  assert w.params["blocks"]["attn"]["query"]["kernel"].shape == (2, 128, 4, 32)
  jaxpr = jax.make_jaxpr(w.step)(*w.args)
  assert "scan" in {eqn.primitive.name for eqn in jaxpr.eqns}


def test_seed_determinism():
  def leaves(seed):
    return jax.tree_util.tree_leaves(make_workload("mlp", seed).args)

  for a, b in zip(leaves(0), leaves(0)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(0), leaves(1)))


def test_moe_routing_respects_capacity():
  probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (2, 16, 4)))
  dispatch, combine, aux_loss = jax.jit(moe.route, static_argnums=(1, 2))(probs, 2, 3)
  assert dispatch.shape == combine.shape == (2, 16, 4, 3)
  assert jnp.all(dispatch.sum(axis=1) <= 1)  # every slot holds <= 1 token
  assert jnp.all(dispatch.sum(axis=(2, 3)) <= 2)  # every token in <= top_k
  assert jnp.all((combine > 0) <= (dispatch > 0))
  assert np.isfinite(aux_loss)


@pytest.mark.parametrize("gated", [False, True])
def test_moe_dispatch_by_index_computes_what_the_one_hot_dispatch_does(gated):
  """Tokens permuted to their experts by slot index (`dispatch="gather"`) give the one-hot
  einsum's outputs and gradients, overflowing tokens dropped alike (capacity 5 of the 8
  a balanced load would need)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 16, 8))
  layers = [
    moe.MoEFeedForward(experts=4, hidden=12, top_k=2, capacity=5, gated=gated, dispatch=d)
    for d in moe.DISPATCHES
  ]
  params = layers[0].init(jax.random.PRNGKey(1), x)
  slot, _, _ = moe.route_slots(jax.nn.softmax(x @ params["params"]["router"]["kernel"]), 2, 5)
  assert jnp.any(slot == 4 * 5)  # Some choices overflow and are dropped.
  (y0, aux0), (y1, aux1) = (layer.apply(params, x) for layer in layers)
  np.testing.assert_allclose(y1, y0, atol=1e-6)
  assert aux1 == aux0
  grads = [jax.grad(lambda p, m=m: m.apply(p, x)[0].sum())(params) for m in layers]
  for g1, g0 in zip(jax.tree_util.tree_leaves(grads[1]), jax.tree_util.tree_leaves(grads[0])):
    np.testing.assert_allclose(g1, g0, atol=1e-5)


def test_ssm_scan_matches_the_recurrence():
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  u, b, c = (jax.random.normal(k, s) for k, s in zip(keys, [(5, 3), (5, 2), (5, 2)]))
  dt = jax.nn.softplus(jax.random.normal(keys[3], (5, 3)))
  a = -jnp.arange(1.0, 7.0).reshape(3, 2)
  state, expected = jnp.zeros((3, 2)), []
  for t in range(5):
    state = jnp.exp(dt[t][:, None] * a) * state + (dt[t] * u[t])[:, None] * b[t]
    expected.append(state @ c[t])
  np.testing.assert_allclose(ssm.selective_scan(u, dt, a, b, c), jnp.stack(expected), rtol=1e-5)


def test_lstm_scan_matches_the_recurrence():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  gates_in = jax.random.normal(keys[0], (5, 2, 12))  # [seq, batch, 4 * cells], cells 3
  w_recurrent = jax.random.normal(keys[1], (4, 12))  # [d_model, 4 * cells]
  w_project = jax.random.normal(keys[2], (3, 4))  # [cells, d_model]
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))
  h, c, expected = np.zeros((2, 4)), np.zeros((2, 3)), []
  for t in range(5):
    z = np.asarray(gates_in[t]) + h @ np.asarray(w_recurrent)
    i, f, g, o = z[:, 0:3], z[:, 3:6], z[:, 6:9], z[:, 9:12]
    c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    h = (sigmoid(o) * np.tanh(c)) @ np.asarray(w_project)
    expected.append(h)
  np.testing.assert_allclose(
    lstm.lstm_scan(gates_in, w_recurrent, w_project), np.stack(expected), rtol=1e-5, atol=1e-5
  )


def test_lstm_parameters_are_stacked_per_layer_and_the_time_loop_runs_inside_the_layer_loop():
  w = make_workload("lstm:size=8192-1024", abstract=True)
  layers = w.params["layers"]
  assert {k: v.shape for k, v in layers.items()} == {
    "w_input": (2, 1024, 32768),
    "w_recurrent": (2, 1024, 32768),
    "bias": (2, 32768),
    "w_project": (2, 8192, 1024),
  }
  program = w.trace()
  assert (
    max(op.repeat for op in program.ops) == 2 * 256
  )  # Two layers of 256 time steps (forward and backward).


def test_dit_presets_have_the_published_parameter_counts():
  """DiT-B/2 and DiT-XL/2: 130M and 675M parameters (Peebles & Xie 2023)."""

  def count(size):
    return sum(
      leaf.size
      for leaf in jax.tree_util.tree_leaves(make_workload(f"dit:size={size}", abstract=True).params)
    )

  assert count("b-2") == pytest.approx(130e6, rel=0.01)
  assert count("xl-2") == pytest.approx(675e6, rel=0.01)


def test_gated_moe_experts_are_swiglu_with_a_gate_projection_each():
  """`gated` experts hold a gate projection beside the up projection and compute
  silu(x wg) * (x wi + bi): with the biases zero, each expert's output on one token is
  (silu(x wg) * (x wi)) wo."""
  layer = moe.MoEFeedForward(experts=2, hidden=8, top_k=1, capacity=4, gated=True)
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 6))
  params = layer.init(jax.random.PRNGKey(1), x)["params"]
  assert params["wg"].shape == params["wi"].shape == (2, 6, 8)
  y, _ = layer.apply({"params": params}, x)
  probs = jax.nn.softmax(x @ params["router"]["kernel"], axis=-1)
  chosen = jnp.argmax(probs, axis=-1)[0]  # [4]: every token has a free slot (capacity 4).
  for t in range(4):
    e = int(chosen[t])
    h = jax.nn.silu(x[0, t] @ params["wg"][e]) * (x[0, t] @ params["wi"][e])
    np.testing.assert_allclose(y[0, t], h @ params["wo"][e], rtol=1e-4, atol=1e-5)


def _matmuls(jaxpr: jax.extend.core.Jaxpr) -> collections.Counter:
  """dot_generals in `jaxpr` and its sub-jaxprs, by whether they have batch dims."""
  found = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (_, (batch, _)) = eqn.params["dimension_numbers"]
      found["batched" if batch else "unbatched"] += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _matmuls(sub)
  return found


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_dots_policy_recomputes_the_batched_matmuls_and_keeps_the_projections(family):
  def matmuls(remat: str) -> collections.Counter:
    w = make_workload(f"{family}:layers=2,{remat}", abstract=True)
    return _matmuls(jax.make_jaxpr(w.step)(*w.args).jaxpr)

  none, dots, full = (
    matmuls("remat=false"),
    matmuls("remat=true,remat_policy=dots"),
    matmuls("remat=true"),
  )
  assert dots["unbatched"] == none["unbatched"] < full["unbatched"]
  assert none["batched"] < dots["batched"] == full["batched"]


def _expert_matmuls(jaxpr: jax.extend.core.Jaxpr, experts: int) -> int:
  """dot_generals in `jaxpr` and its sub-jaxprs batched over `experts` on both operands."""
  found = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (_, (lhs_batch, rhs_batch)) = eqn.params["dimension_numbers"]
      shapes = [v.aval.shape for v in eqn.invars]
      found += any(shapes[0][a] == shapes[1][b] == experts for a, b in zip(lhs_batch, rhs_batch))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _expert_matmuls(sub, experts)
  return found


def test_the_dots_policy_keeps_the_experts_matmuls():
  """Under "dots" a mixture of experts recomputes none of its experts' matmuls (batched
  over experts) in the backward pass; full recomputation recomputes them."""

  def expert_matmuls(remat: str) -> int:
    w = make_workload(f"moe:layers=2,d_model=64,heads=4,seq=32,experts=5,{remat}", abstract=True)
    return _expert_matmuls(jax.make_jaxpr(w.step)(*w.args).jaxpr, experts=5)

  none = expert_matmuls("remat=false")
  assert expert_matmuls("remat=true,remat_policy=dots") == none < expert_matmuls("remat=true")


@pytest.mark.parametrize(
  "spec_, match",
  [
    ("llama:remat_policy=dots", r"remat_policy='dots' needs remat=true"),
    ("gpt:remat=true,remat_policy=some", r"remat_policy='some' is not one of full, dots"),
  ],
)
def test_a_remat_policy_is_named_and_needs_remat(spec_, match):
  with pytest.raises(ValueError, match=match):
    make_workload(spec_, abstract=True)
