"""Expert tactics find their dims from the program's structure, in every framework style."""

import collections
import math

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_hardware import H100_WORK_ONLY

from automap_rl import problem as problem_module
from automap_rl import tactics
from automap_rl.ir import Role
from automap_rl.mesh import make_mesh
from automap_rl.problem import Problem
from automap_rl.workloads import make_workload, training

VOCAB, D, HEADS, FF, SEQ, BATCH, LAYERS = 128, 64, 4, 256, 16, 8, 2


def _batch():
  tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, VOCAB)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _xent(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


class _FlaxBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(FF)(nn.LayerNorm()(x)))
    return x + nn.Dense(D)(h)


class _FlaxTransformer(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    for _ in range(LAYERS):
      x = _FlaxBlock()(x)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _flax():
  model, batch = _FlaxTransformer(), _batch()
  params = model.init(jax.random.key(1), batch["inputs"])["params"]
  return training.build_workload(
    "flax", lambda p, b: _xent(model.apply({"params": p}, b["inputs"]), b), params, batch
  )


def _haiku_forward(tokens):
  x = hk.Embed(VOCAB, D)(tokens)
  for _ in range(LAYERS):
    y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
    x = x + hk.MultiHeadAttention(HEADS, D // HEADS, w_init=hk.initializers.VarianceScaling())(
      y, y, y
    )
    y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
    x = x + hk.Linear(D)(jax.nn.gelu(hk.Linear(FF)(y)))
  return hk.Linear(VOCAB)(hk.LayerNorm(-1, create_scale=True, create_offset=True)(x))


def _haiku():
  model, batch = hk.without_apply_rng(hk.transform(_haiku_forward)), _batch()
  params = model.init(jax.random.key(1), batch["inputs"])
  return training.build_workload(
    "haiku", lambda p, b: _xent(model.apply(p, b["inputs"]), b), params, batch
  )


class _EqxBlock(eqx.Module):
  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  fc1: eqx.nn.Linear
  fc2: eqx.nn.Linear

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.norm1, self.norm2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
    self.attention = eqx.nn.MultiheadAttention(
      HEADS,
      D,
      use_query_bias=True,
      use_key_bias=True,
      use_value_bias=True,
      use_output_bias=True,
      key=k1,
    )
    self.fc1, self.fc2 = eqx.nn.Linear(D, FF, key=k2), eqx.nn.Linear(FF, D, key=k3)

  def __call__(self, x):  # [seq, d]
    y = jax.vmap(self.norm1)(x)
    x = x + self.attention(y, y, y)
    y = jax.vmap(self.norm2)(x)
    return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(y)))


class _EqxTransformer(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, LAYERS + 2)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
    self.blocks = [_EqxBlock(k) for k in keys[1:-1]]
    self.norm, self.head = eqx.nn.LayerNorm(D), eqx.nn.Linear(D, VOCAB, key=keys[-1])

  def __call__(self, tokens):  # [seq]
    x = jax.vmap(self.embed)(tokens)
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def _equinox():
  params, static = eqx.partition(_EqxTransformer(jax.random.key(1)), eqx.is_inexact_array)
  loss = lambda p, b: _xent(jax.vmap(eqx.combine(p, static))(b["inputs"]), b)
  return training.build_workload("equinox", loss, params, _batch())


STYLES = {"flax": _flax, "haiku": _haiku, "equinox": _equinox}
MESH = "data=2,model=4"


def _problem(workload) -> Problem:
  return Problem.build(workload.trace(), make_mesh(MESH, "h100"))


def _parameter_shards(problem: Problem, decisions) -> collections.Counter:
  """Multiset of (parameter elements, elements per device): the same dims sharded the same
  way give the same multiset whatever the parameters' names and layouts."""
  ids = [v for v in problem.program.inputs if problem.program.values[v].role == Role.PARAMETER]
  specs = problem.partition_specs(decisions, ids)
  shards = collections.Counter()
  for value_id, spec in zip(ids, specs):
    size = problem.program.values[value_id].size
    axes = [
      a
      for entry in spec
      if entry is not None
      for a in ((entry,) if isinstance(entry, str) else entry)
    ]
    shards[(size, size // math.prod(problem.mesh.axis_size(a) for a in axes))] += 1
  return shards


@pytest.fixture(scope="module")
def problems():
  return {style: _problem(build()) for style, build in STYLES.items()}


@pytest.mark.parametrize(
  "tactic", ["megatron", "fsdp", "data_megatron", "fsdp_megatron", "sequence_parallel"]
)
def test_each_tactic_shards_the_same_dims_in_flax_haiku_and_equinox(problems, tactic):
  shards = {
    style: _parameter_shards(p, tactics.TACTICS[tactic](p)) for style, p in problems.items()
  }
  assert shards["flax"] == shards["haiku"] == shards["equinox"]


def test_megatron_shards_heads_and_ffn_hidden_not_the_residual_width(problems):
  for problem in problems.values():
    shards = _parameter_shards(problem, tactics.megatron(problem))
    model = problem.mesh.axis_size("model")
    # Per block: q, k, v, out and both FFN kernels (D*D and D*FF elements), and the q, k, v
    # and FFN-hidden biases, are split over `model`; so are the head's kernel and bias and
    # the embedding over the vocabulary (vocabulary-parallel, as Megatron-LM's); norms not.
    assert shards[(D * D, D * D // model)] == 4 * LAYERS
    assert shards[(D * FF, D * FF // model)] == 2 * LAYERS
    assert shards[(FF, FF // model)] == LAYERS
    assert shards[(D, D // model)] == 3 * LAYERS
    assert shards[(VOCAB * D, VOCAB * D // model)] == 2
    assert shards[(VOCAB, VOCAB // model)] == 1
    # Unsplit width-D vectors: per block two norms' scales and offsets, the attention's
    # output bias and the FFN's output bias; and the final norm's scale and offset.
    assert shards[(D, D)] == 6 * LAYERS + 2


TRANSFORMERS = ("gpt:layers=2", "llama", "moe", "t5", "vit")


@pytest.mark.parametrize("spec", TRANSFORMERS)
def test_every_expert_tactic_changes_the_plan_of_every_transformer_family(spec):
  problem = _problem(make_workload(spec, abstract=True))
  plans = tactics.applicable(problem)
  expected = {
    "replicated",
    "data_parallel",
    "megatron",
    "fsdp",
    "hsdp",
    "data_megatron",
    "fsdp_megatron",
  }
  expected |= {"expert_parallel"} if spec == "moe" else set()
  expected |= {"sequence_parallel", "fsdp_megatron_sp"} if spec != "vit" else set()
  assert set(plans) == expected
  replicated = _parameter_shards(problem, [])
  for name, decisions in plans.items():
    if name in ("replicated", "data_parallel", "sequence_parallel"):
      continue
    assert _parameter_shards(problem, decisions) != replicated, name
  base = float(problem.cost([]).peak_memory)
  assert all(
    float(problem.cost(d).peak_memory) < base for n, d in plans.items() if n != "replicated"
  )


def test_expert_costs_are_evaluated_together_with_one_compile(problems):
  problem = problems["flax"]
  compiled = problem_module.bucketed_costs.jitted()._cache_size
  before = compiled()
  evaluated = tactics.applicable_costs(problem)
  lengths = {len(problem.encode(plan)[0]) for plan, _ in evaluated.values()}
  assert len(lengths) > 1  # Plans of several lengths (buckets), compiled once for the set.
  assert compiled() - before <= 1
  for name, (plan, cost) in evaluated.items():
    alone = problem.cost(plan)
    assert float(cost.step_time) == pytest.approx(float(alone.step_time), rel=1e-6), name
    assert float(cost.peak_memory) == pytest.approx(float(alone.peak_memory), rel=1e-6), name


def test_fsdp_megatron_stores_every_parameter_over_all_data_axes_beside_tensor_parallelism():
  """On data x fsdp x model: the batch over data and fsdp, heads and FFN hidden over model,
  and every parameter large enough stored over data and fsdp on a dim that is not its
  tensor-parallel one; so parameters take 1/64th of their memory where Megatron's are split
  8 ways and FSDP's 2 ways."""
  problem = Problem.build(
    make_workload(
      "gpt:layers=2,d_model=256,heads=8,seq=64,vocab=512,batch=16", abstract=True
    ).trace(),
    make_mesh("data=4,fsdp=2,model=8", "h100"),
  )
  decisions = tactics.fsdp_megatron(problem)
  ids = [v for v in problem.program.inputs if problem.program.values[v].role == Role.PARAMETER]
  tp = set(tactics.structure(problem).tensor_parallel)
  for value_id, spec in zip(ids, problem.partition_specs(decisions, ids)):
    value = problem.program.values[value_id]
    entries = [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in spec]
    assert sum(a in ("data", "fsdp") for e in entries for a in e) in (0, 2), (value.path, spec)
    for dim, axes in enumerate(entries):
      if (
        "data" in axes and problem.named.class_of(value_id, dim) in tp
      ):  # Only if nothing else divides.
        others = [d for d in range(len(value.shape)) if d != dim and value.shape[d] % 8 == 0]
        assert not others, (value.path, spec)
    if value.size >= 256 * 256:
      assert any(axes == ("data", "fsdp") for axes in entries), (value.path, spec)
  memory = {
    name: float(problem.cost(tactics.TACTICS[name](problem)).peak_memory)
    for name in ("fsdp", "data_megatron", "fsdp_megatron")
  }
  assert memory["fsdp_megatron"] < min(memory["fsdp"], memory["data_megatron"])


def test_hsdp_splits_the_batch_over_every_axis_and_stores_parameters_over_the_model_axis():
  """On data x fsdp x model: every input's batch over all three axes, every parameter large
  enough stored over `model` alone (replicated over the other two), so the step computes no
  copy of another device's work and parameters take 1/8th of their memory. (The profile
  prices the work alone: every device pays the kernel overhead whole, whatever the split.)"""
  problem = Problem.build(
    make_workload(
      "gpt:layers=2,d_model=256,heads=8,seq=64,vocab=512,batch=16", abstract=True
    ).trace(),
    make_mesh("data=2,fsdp=2,model=4", H100_WORK_ONLY),
  )
  decisions = tactics.hsdp(problem)
  program = problem.program
  for value_id, spec in zip(
    program.batch_inputs, problem.partition_specs(decisions, program.batch_inputs)
  ):
    assert tuple(spec[0]) == ("data", "fsdp", "model"), (program.values[value_id].path, spec)
  ids = [v for v in program.inputs if program.values[v].role == Role.PARAMETER]
  for value_id, spec in zip(ids, problem.partition_specs(decisions, ids)):
    axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    assert axes in ([], ["model"]), (program.values[value_id].path, spec)
    if program.values[value_id].size >= 256 * 256:
      assert axes == ["model"], (program.values[value_id].path, spec)
  cost = {
    name: problem.cost(tactics.TACTICS[name](problem)) for name in ("data_parallel", "fsdp", "hsdp")
  }
  assert float(cost["hsdp"].compute_time) < 0.5 * float(
    cost["data_parallel"].compute_time
  )  # A 4x larger share.
  assert float(cost["hsdp"].peak_memory) < float(cost["data_parallel"].peak_memory)


def test_hsdp_needs_two_mesh_axes():
  assert "hsdp" not in tactics.applicable(
    _gpt("gpt:layers=2,d_model=256,heads=8,seq=64,vocab=512,batch=16", "data=8")
  )


def test_fsdp_megatron_sp_stores_the_residual_stream_split_by_sequence():
  problem = Problem.build(
    make_workload(
      "gpt:layers=2,d_model=256,heads=8,seq=64,vocab=512,batch=16", abstract=True
    ).trace(),
    make_mesh("data=2,model=4", "h100"),
  )
  sequence = problem.named.class_of(
    next(v for v in problem.program.inputs if problem.program.values[v].role == Role.INPUT), 1
  )
  for name, split in (("fsdp_megatron", False), ("fsdp_megatron_sp", True)):
    resolution = problem.resolution(tactics.TACTICS[name](problem))
    axes = np.asarray(resolution.value_mask)  # [value signatures, dims]: bit masks of mesh axes.
    sig_class = problem.sigs.value_class
    model = 1 << problem.mesh.axis_index("model")
    on_sequence = (sig_class == sequence) & ((axes & model) != 0)
    assert bool(on_sequence.any()) == split, name


@settings(max_examples=200, deadline=None)
@given(
  st.dictionaries(
    st.sampled_from(sorted(tactics.TACTICS)),
    st.tuples(st.floats(1e-3, 1e3), st.floats(1.0, 1e12), st.booleans()),
    min_size=1,
  )
)
def test_the_best_expert_is_the_fastest_that_fits_and_never_one_that_does_not(raw):
  scores = {name: tactics.Score(*score) for name, score in raw.items()}
  best = tactics.best_expert(scores)
  fitting = [s for s in scores.values() if s.fits]
  if fitting:
    assert scores[best].fits and scores[best].step_time == min(s.step_time for s in fitting)
  else:
    assert scores[best].peak_memory == min(s.peak_memory for s in scores.values())


def test_the_best_expert_plan_is_the_best_of_the_applicable_costs(problems):
  problem = problems["flax"]
  expert = tactics.best_expert_plan(problem)
  costs = tactics.applicable_costs(problem)
  assert list(expert.decisions) == costs[expert.name][0]
  assert expert.name == tactics.best_expert({n: tactics.Score.of(c) for n, (_, c) in costs.items()})


def test_the_expert_plans_come_in_the_yardsticks_order(problems):
  for problem in problems.values():
    experts = tactics.expert_plans(problem)
    assert {e.name for e in experts} == set(tactics.applicable(problem))
    assert experts[0].name == tactics.best_expert_plan(problem).name
    fits = [e.fits for e in experts]
    assert fits == sorted(fits, reverse=True)  # Every plan that fits before any that does not.
    for a, b in zip(experts, experts[1:]):
      if a.fits and b.fits:
        assert a.cost.step_time <= b.cost.step_time
      elif not a.fits:
        assert a.cost.peak_memory <= b.cost.peak_memory


def _gpt(spec: str, mesh: str) -> Problem:
  return Problem.build(make_workload(spec, abstract=True).trace(), make_mesh(mesh, "h100"))


def test_megatron_3d_pipelines_the_slow_axis_with_tensor_parallelism_on_the_fast_one():
  """data=4,fsdp=2,model=8 on H100s: `model` is one node's NVLink, `data` and `fsdp` cross
  nodes; the stages go on `data` (the most major of the slowest), the batch over `fsdp`,
  heads and FFN hidden over `model`, one sequence per data-parallel replica a microbatch."""
  problem = _gpt(
    "gpt:layers=8,d_model=256,heads=8,seq=64,vocab=512,batch=16,scan=true", "data=4,fsdp=2,model=8"
  )
  assert tactics.stage_axis(problem) == "data"
  decisions, pipeline = tactics.megatron_3d(problem)
  assert (pipeline.axis, pipeline.stages, pipeline.microbatches, pipeline.schedule) == (
    "data",
    4,
    8,
    "1f1b",
  )
  assert all(d.axis != "data" for d in decisions)
  assert {d.axis for d in decisions} == {"fsdp", "model"}
  assert [d for d in decisions if d.axis == "model"] == tactics.megatron(problem)
  cost = problem.plan_cost(decisions, pipeline)
  terms = cost.terms
  assert float(cost.step_time) == pytest.approx(
    sum(
      float(getattr(terms, t))
      for t in ("steady_s", "bubble_s", "transfer_s", "gradient_reduction_s", "update_s")
    )
  )
  assert float(cost.comm_bytes[-1]) > 0  # Collective-permutes between the stages.


def test_stages_that_leave_devices_of_the_stage_axis_shard_the_batch_over_them():
  """6 layers over an axis of 4: 2 stages, each keeping 2 devices of `data` for the batch."""
  problem = _gpt("gpt:layers=6,d_model=256,heads=8,seq=64,vocab=512,batch=16", "data=4,model=2")
  decisions, pipeline = tactics.fsdp_megatron_3d(problem)
  assert (pipeline.axis, pipeline.stages, pipeline.microbatches) == ("data", 2, 8)
  assert any(d.axis == "data" for d in decisions)
  assert bool(problem.plan_cost(decisions, pipeline).fits)


def test_fsdp_inside_stages_never_splits_a_stacked_weight_on_its_layer_dim():
  """12 layers, 4 stages of 3 over `data`: sharding the layer dim over `fsdp` (4 divides 12)
  would leave each stage's 3 layers to split 4 ways."""
  problem = _gpt(
    "gpt:layers=12,d_model=256,heads=8,seq=64,vocab=512,batch=32,scan=true", "data=4,fsdp=4,model=2"
  )
  decisions, pipeline = tactics.fsdp_megatron_3d(problem)
  assert (pipeline.axis, pipeline.stages) == ("data", 4)
  layer_classes = set(problem.layer_stacks[pipeline.stack].layer_classes)
  stored = [d for d in decisions if d.axis == "fsdp" and "blocks" in str(d.target)]
  assert stored and not any(
    problem.named.class_of(problem.program.input_by_path(d.target.path).id, d.target.dim)
    in layer_classes
    for d in stored
  )
  assert float(problem.plan_cost(decisions, pipeline).step_time) > 0


def test_pipeline_tactics_need_a_layer_stack_and_a_second_axis():
  assert (
    tactics.applicable_pipelines(
      _gpt("gpt:layers=1,d_model=256,heads=8,seq=64,vocab=512,batch=16", "data=4,model=2")
    )
    == {}
  )
  assert (
    tactics.applicable_pipelines(
      _gpt("gpt:layers=4,d_model=256,heads=8,seq=64,vocab=512,batch=16", "data=8")
    )
    == {}
  )
  with pytest.raises(ValueError, match="no repeated layer stack"):
    tactics.megatron_3d(
      _gpt("gpt:layers=1,d_model=256,heads=8,seq=64,vocab=512,batch=16", "data=4,model=2")
    )
