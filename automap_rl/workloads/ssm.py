"""Mamba-style selective state-space language model in Equinox.

Each residual block is RMSNorm then the Mamba mixer (Gu & Dao 2023): an input
projection to two branches, a causal depthwise convolution and SiLU on one,
input-dependent step sizes and B, C projections, the diagonal selective scan
(``jax.lax.scan`` over time, in float32), a skip through ``D``, gating by the
other branch, and an output projection. The blocks are stacked with
``eqx.filter_vmap`` and run by ``jax.lax.scan`` over layers, each layer
rematerialized (``jax.checkpoint``) so that the backward pass keeps one
layer's scan states at a time. The model works on one sequence and the loss
``jax.vmap``s it over the batch; the output projection is the embedding.

``params`` is the model's floating-point part, an Equinox module with fields
``embedding/weight`` [vocab, d], ``layers/norm/weight``,
``layers/mixer/{in_proj,conv1d,x_proj,dt_proj,out_proj}`` (Linear ``weight``
[out, in]; ``conv1d`` weight [d_inner, 1, d_conv]),
``layers/mixer/{A_log,D}`` and ``norm_f/weight``; ``layers`` leaves have a
leading ``[layers]`` axis.

Presets (``ssm:size=1.4b``): the Mamba language models of Gu & Dao (2023,
Table 12 and the released checkpoints): 130m, 370m, 790m, 1.4b and 2.8b, with
d_state 16, expansion 2, convolution width 4, the GPT-NeoX vocabulary padded
to 50280 and sequence 2048, bfloat16 compute.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class SSMConfig:
  """Mamba size.

  Attributes:
    layers: residual blocks.
    d_model: residual stream width.
    d_state: state size per channel (N).
    expand: inner width is ``expand * d_model``.
    d_conv: causal convolution width.
    dt_rank: rank of the step-size projection; 0 means ``ceil(d_model / 16)``.
    vocab: vocabulary size.
    seq: sequence length.
    batch: sequences per batch.
    dtype: compute dtype (float32 parameters are cast to it in the step; the
      scan itself runs in float32).
  """

  layers: int = 2
  d_model: int = 32
  d_state: int = 8
  expand: int = 2
  d_conv: int = 4
  dt_rank: int = 0
  vocab: int = 256
  seq: int = 32
  batch: int = 8
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)

  @property
  def d_inner(self) -> int:
    return self.expand * self.d_model

  @property
  def rank(self) -> int:
    """Step-size projection rank with the ``dt_rank=0`` default resolved."""
    return self.dt_rank or math.ceil(self.d_model / 16)


_MAMBA = {"vocab": 50280, "seq": 2048, "d_state": 16, "dtype": "bfloat16"}
# Size label -> config fields.
PRESETS: dict[str, dict[str, Any]] = {
  "130m": {"layers": 24, "d_model": 768, **_MAMBA},
  "370m": {"layers": 48, "d_model": 1024, **_MAMBA},
  "790m": {"layers": 48, "d_model": 1536, **_MAMBA},
  "1.4b": {"layers": 48, "d_model": 2048, **_MAMBA},
  "2.8b": {"layers": 64, "d_model": 2560, **_MAMBA},
}


def selective_scan(
  u: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array
) -> jax.Array:
  """The diagonal selective scan h_t = exp(dt_t a) h_{t-1} + dt_t u_t b_t,
  y_t = h_t c_t, sequentially over time.

  Args:
    u: inputs [seq, d_inner].
    dt: positive step sizes [seq, d_inner].
    a: negative state decay rates [d_inner, d_state].
    b: input projections [seq, d_state].
    c: output projections [seq, d_state].

  Returns:
    y [seq, d_inner].
  """

  def step(state: jax.Array, inputs) -> tuple[jax.Array, jax.Array]:
    u_t, dt_t, b_t, c_t = inputs
    state = jnp.exp(dt_t[:, None] * a) * state + (dt_t * u_t)[:, None] * b_t[None, :]
    return state, state @ c_t

  _, y = jax.lax.scan(step, jnp.zeros(a.shape, a.dtype), (u, dt, b, c))
  return y


class Mixer(eqx.Module):
  """The Mamba mixer on one sequence: [seq, d] -> [seq, d]."""

  in_proj: eqx.nn.Linear
  conv1d: eqx.nn.Conv1d
  x_proj: eqx.nn.Linear
  dt_proj: eqx.nn.Linear
  A_log: jax.Array
  D: jax.Array
  out_proj: eqx.nn.Linear

  def __init__(self, config: SSMConfig, key: jax.Array):
    keys = jax.random.split(key, 5)
    d, inner, n, rank = config.d_model, config.d_inner, config.d_state, config.rank
    self.in_proj = eqx.nn.Linear(d, 2 * inner, use_bias=False, key=keys[0])
    self.conv1d = eqx.nn.Conv1d(
      inner, inner, config.d_conv, padding=[(config.d_conv - 1, 0)], groups=inner, key=keys[1]
    )
    self.x_proj = eqx.nn.Linear(inner, rank + 2 * n, use_bias=False, key=keys[2])
    self.dt_proj = eqx.nn.Linear(rank, inner, key=keys[3])
    # S4D-real initialization: a_n = -(n + 1).
    self.A_log = jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (inner, n)))
    self.D = jnp.ones((inner,))
    self.out_proj = eqx.nn.Linear(inner, d, use_bias=False, key=keys[4])

  def __call__(self, x: jax.Array) -> jax.Array:
    rank, n = self.dt_proj.in_features, self.A_log.shape[1]
    u, z = jnp.split(jax.vmap(self.in_proj)(x), 2, axis=-1)  # [seq, inner] each
    u = jax.nn.silu(self.conv1d(u.T).T)
    dt, b, c = jnp.split(jax.vmap(self.x_proj)(u), [rank, rank + n], axis=-1)
    dt = jax.nn.softplus(jax.vmap(self.dt_proj)(dt))
    y = selective_scan(
      training.widen(u),
      training.widen(dt),
      -jnp.exp(training.widen(self.A_log)),
      training.widen(b),
      training.widen(c),
    ).astype(x.dtype)
    y = (y + u * self.D) * jax.nn.silu(z)
    return jax.vmap(self.out_proj)(y)


class ResidualBlock(eqx.Module):
  """x + mixer(rmsnorm(x)) on one sequence: [seq, d] -> [seq, d]."""

  norm: eqx.nn.RMSNorm
  mixer: Mixer

  def __init__(self, config: SSMConfig, key: jax.Array):
    self.norm = eqx.nn.RMSNorm(config.d_model, use_bias=False)
    self.mixer = Mixer(config, key)

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.mixer(jax.vmap(self.norm)(x))


class Mamba(eqx.Module):
  """tokens int32 [seq] -> logits [seq, vocab]."""

  embedding: eqx.nn.Embedding
  layers: ResidualBlock
  norm_f: eqx.nn.RMSNorm

  def __init__(self, config: SSMConfig, key: jax.Array):
    embed_key, layers_key = jax.random.split(key)
    self.embedding = eqx.nn.Embedding(
      weight=0.02 * jax.random.normal(embed_key, (config.vocab, config.d_model))
    )
    self.layers = eqx.filter_vmap(lambda k: ResidualBlock(config, k))(
      jax.random.split(layers_key, config.layers)
    )
    self.norm_f = eqx.nn.RMSNorm(config.d_model, use_bias=False)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = jax.vmap(self.embedding)(tokens)
    dynamic, static = eqx.partition(self.layers, eqx.is_array)

    @jax.checkpoint
    def run(x: jax.Array, layer_arrays: ResidualBlock) -> tuple[jax.Array, None]:
      return eqx.combine(layer_arrays, static)(x), None

    x, _ = jax.lax.scan(run, x, dynamic)
    return jax.vmap(self.norm_f)(x) @ self.embedding.weight.T


def make(config: SSMConfig, seed: int = 0) -> training.Workload:
  """Builds the next-token LM step.

  Batch: ``inputs`` and ``targets`` int32 [batch, seq]; ``targets`` is
  ``inputs`` shifted left by one token; loss is the mean cross-entropy.
  """
  params_key, data_key = training.split_seed(seed)
  params = jax.jit(lambda key: eqx.partition(Mamba(config, key), eqx.is_inexact_array)[0])(
    params_key
  )
  _, static = eqx.partition(eqx.filter_eval_shape(Mamba, config, params_key), eqx.is_inexact_array)
  tokens = jax.random.randint(data_key, (config.batch, config.seq + 1), 0, config.vocab, jnp.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  def loss_fn(params, batch):
    model = eqx.combine(training.cast_floating(params, config.dtype), static)
    logits = training.widen(jax.vmap(model)(batch["inputs"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return training.build_workload(
    training.spec_string("ssm", config, PRESETS), loss_fn, params, batch
  )
