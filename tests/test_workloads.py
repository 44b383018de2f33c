"""Tests for the model zoo ``automap_rl.workloads``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from automap_rl.workloads import (FAMILIES, Workload, make_workload,
                               parse_model_spec)
from automap_rl.workloads import moe


def _shapes(tree):
  return jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), tree)


@functools.cache
def _workload(spec: str) -> Workload:
  """Default-seed workload, built once per test session."""
  return make_workload(spec)


@pytest.mark.parametrize("name", FAMILIES)
def test_step_runs_and_preserves_structure(name):
  w = _workload(name)
  assert w.name == name
  assert w.arg_names == ("params", "opt_state", "batch")
  new_params, new_opt_state, loss = jax.jit(w.step)(*w.args)
  assert _shapes(new_params) == _shapes(w.params)
  assert _shapes(new_opt_state) == _shapes(w.opt_state)
  for leaf in jax.tree_util.tree_leaves(w.params):
    assert leaf.dtype == jnp.float32
  assert loss.shape == () and np.isfinite(loss)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_two_steps_reduce_loss(name):
  w = _workload(name)
  step = jax.jit(w.step)
  params, opt_state, first = step(*w.args)
  params, opt_state, _ = step(params, opt_state, w.batch)
  _, _, third = step(params, opt_state, w.batch)
  assert third < first


def test_parse_model_spec_converts_types():
  assert parse_model_spec("gpt") == ("gpt", {})
  assert parse_model_spec("gpt:layers=12,d_model=768,scan=true") == (
      "gpt", {"layers": 12, "d_model": 768, "scan": True})
  name, kwargs = parse_model_spec("moe:capacity_factor=1.5,scan=False")
  assert name == "moe" and kwargs == {"capacity_factor": 1.5, "scan": False}
  assert type(kwargs["capacity_factor"]) is float


@pytest.mark.parametrize("spec, match", [
    ("transformer:layers=2", r"unknown model 'transformer'.*gpt.*unet"),
    ("gpt:depth=3", r"unknown key 'depth'.*valid keys: layers, d_model"),
    ("gpt:scan=yes", r"'yes'.*'scan'"),
    ("gpt:layers=two", r"'two'.*'layers'"),
    ("gpt:layers", r"key=value"),
])
def test_parse_model_spec_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    parse_model_spec(spec)


def test_canonical_name_lists_non_default_fields():
  w = make_workload("mlp:width=64,layers=2,batch=8")
  assert w.name == "mlp:width=64,batch=8"
  assert jax.tree_util.tree_leaves(w.batch)[0].shape[0] == 8


def test_gpt_param_paths():
  params = _workload("gpt").params
  assert params["block_0"]["attn"]["query"]["kernel"].shape == (128, 4, 32)
  assert set(params["block_1"]["mlp"]) == {"fc1", "fc2"}


def test_gpt_scan_stacks_blocks_into_a_scan():
  w = make_workload("gpt:scan=true")
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
  dispatch, combine, aux_loss = moe.route(probs, top_k=2, capacity=3)
  assert dispatch.shape == combine.shape == (2, 16, 4, 3)
  assert jnp.all(dispatch.sum(axis=1) <= 1)  # every slot holds <= 1 token
  assert jnp.all(dispatch.sum(axis=(2, 3)) <= 2)  # every token in <= top_k
  assert jnp.all((combine > 0) <= (dispatch > 0))
  assert np.isfinite(aux_loss)
