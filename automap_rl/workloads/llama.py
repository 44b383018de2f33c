"""Llama-style decoder in Flax nnx: RMSNorm, rotary embeddings, grouped-query
attention and a SwiGLU MLP, with the decoder layers stacked by ``nnx.vmap``
and run by ``nnx.scan``.

The step works on ``nnx.split``'s state: ``params`` is the model's
``nnx.State`` (paths ``embed/embedding/value``,
``layers/attn/{q,k,v,o}_proj/kernel/value``,
``layers/mlp/{gate,up,down}_proj/kernel/value``,
``layers/{input,post_attention}_norm/scale/value``, ``norm/scale/value``,
``lm_head/kernel/value``), every ``layers`` leaf with a leading ``[layers]``
axis.

Presets (``llama:size=8b``): Llama 3.2 1B, Llama 3 8B and 70B (Meta's model
cards and ``params.json``; Grattafiori et al. 2024, Table 3). The sequence is
2048 tokens (the models' context is longer; the spec can set ``seq``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from automap_rl.workloads import attention, training


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Decoder size.

  Attributes:
    layers: decoder layers.
    d_model: residual stream width.
    heads: query heads; must divide ``d_model``.
    kv_heads: key/value heads (grouped-query attention); must divide
      ``heads``.
    d_ff: SwiGLU hidden width.
    vocab: vocabulary size.
    seq: sequence length.
    batch: sequences per batch.
    rope_theta: rotary embedding base.
    tie_embeddings: the output projection is the embedding (no ``lm_head``).
    remat: rematerialize each layer in the backward pass (``nnx.remat``).
    remat_policy: what a rematerialized layer keeps (`training.REMAT_POLICIES`: "full",
      "dots").
    dtype: compute dtype (float32 parameters are cast to it in the step).
    fused_attention: attention as a fused kernel
      (`workloads.attention.fused_causal_attention`: flash attention's memory and flops).
  """

  layers: int = 2
  d_model: int = 64
  heads: int = 4
  kv_heads: int = 2
  d_ff: int = 128
  vocab: int = 256
  seq: int = 32
  batch: int = 8
  rope_theta: float = 500000.0
  tie_embeddings: bool = False
  remat: bool = False
  remat_policy: str = "full"
  dtype: str = "float32"
  fused_attention: bool = False

  def __post_init__(self):
    training.check_dtype(self.dtype)
    training.check_remat(self.remat, self.remat_policy)
    if self.d_model % self.heads or self.heads % self.kv_heads:
      raise ValueError(
        f"heads={self.heads} must divide d_model={self.d_model} and be a "
        f"multiple of kv_heads={self.kv_heads}"
      )

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


_LLAMA3 = {"vocab": 128256, "seq": 2048, "kv_heads": 8, "dtype": "bfloat16"}
# Size label -> config fields.
PRESETS: dict[str, dict[str, Any]] = {
  "1b": {
    "layers": 16,
    "d_model": 2048,
    "heads": 32,
    "d_ff": 8192,
    "tie_embeddings": True,
    **_LLAMA3,
  },
  "8b": {"layers": 32, "d_model": 4096, "heads": 32, "d_ff": 14336, **_LLAMA3},
  "70b": {"layers": 80, "d_model": 8192, "heads": 64, "d_ff": 28672, **_LLAMA3},
}


def rotary(x: jax.Array, theta: float) -> jax.Array:
  """Rotates pairs (i, i + d/2) of x [b, s, h, d] by position-dependent angles."""
  seq, dim = x.shape[1], x.shape[-1]
  freqs = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [d/2]
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs  # [s, d/2]
  cos = jnp.cos(angles)[None, :, None].astype(x.dtype)
  sin = jnp.sin(angles)[None, :, None].astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
  """Causal grouped-query attention: x [b, s, d] -> [b, s, d]."""

  def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
    d, hd = config.d_model, config.head_dim
    self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, hd
    self.rope_theta = config.rope_theta
    self.fused = config.fused_attention
    self.q_proj = nnx.Linear(d, config.heads * hd, use_bias=False, rngs=rngs)
    self.k_proj = nnx.Linear(d, config.kv_heads * hd, use_bias=False, rngs=rngs)
    self.v_proj = nnx.Linear(d, config.kv_heads * hd, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(config.heads * hd, d, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, _ = x.shape
    groups = self.heads // self.kv_heads
    q = self.q_proj(x).reshape(b, s, self.heads, self.head_dim)
    k = self.k_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, s, self.kv_heads, self.head_dim)
    q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
    q = q.reshape(b, s, self.kv_heads, groups, self.head_dim)
    if self.fused:
      out = attention.fused_causal_attention(q, k, v)
      return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))
    logits = jnp.einsum("bskgd,btkd->bkgst", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(training.widen(logits), axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", weights, v)  # [b, s, kv, g, hd]
    return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))


class MLP(nnx.Module):
  """SwiGLU feed-forward: x [b, s, d] -> [b, s, d]."""

  def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
    d, f = config.d_model, config.d_ff
    self.gate_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(f, d, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm residual layer: x [b, s, d] -> [b, s, d]."""

  def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
    self.input_norm = nnx.RMSNorm(config.d_model, epsilon=1e-5, rngs=rngs)
    self.attn = Attention(config, rngs)
    self.post_attention_norm = nnx.RMSNorm(config.d_model, epsilon=1e-5, rngs=rngs)
    self.mlp = MLP(config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.input_norm(x))
    return x + self.mlp(self.post_attention_norm(x))


class Llama(nnx.Module):
  """Decoder LM: tokens int32 [b, s] -> logits [b, s, vocab]."""

  def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
    self.embed = nnx.Embed(config.vocab, config.d_model, rngs=rngs)
    self.remat = config.remat
    self.remat_policy = config.remat_policy

    @nnx.split_rngs(splits=config.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
      return DecoderLayer(config, rngs)

    self.layers = make_layers(rngs)
    self.norm = nnx.RMSNorm(config.d_model, epsilon=1e-5, rngs=rngs)
    self.lm_head = (
      None
      if config.tie_embeddings
      else nnx.Linear(config.d_model, config.vocab, use_bias=False, rngs=rngs)
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    # A plain lookup, not `self.embed(tokens)`: nnx.Embed casts to its float32 default
    # dtype, which would narrow the float64 numerics reference at the scan's carry.
    table = self.embed.embedding[...]  # [vocab, d]
    x = jnp.take(table, tokens, axis=0)

    def run(x: jax.Array, layer: DecoderLayer) -> jax.Array:
      return layer(x)

    run = nnx.scan(
      nnx.remat(run, policy=training.REMAT_POLICIES[self.remat_policy]) if self.remat else run,
      in_axes=(nnx.Carry, 0),
      out_axes=nnx.Carry,
    )
    x = self.norm(run(x, self.layers))
    return x @ table.T if self.lm_head is None else self.lm_head(x)


def make(config: LlamaConfig, seed: int = 0) -> training.Workload:
  """Builds the next-token LM step on the model's ``nnx.State``.

  Batch: ``inputs`` and ``targets`` int32 [batch, seq]; ``targets`` is
  ``inputs`` shifted left by one token; loss is the mean cross-entropy.
  """
  params_key, data_key = training.split_seed(seed)
  graphdef, params = nnx.split(Llama(config, nnx.Rngs(params=params_key)))
  tokens = jax.random.randint(data_key, (config.batch, config.seq + 1), 0, config.vocab, jnp.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, training.cast_floating(params, config.dtype))
    logits = training.widen(model(batch["inputs"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return training.build_workload(
    training.spec_string("llama", config, PRESETS), loss_fn, params, batch
  )
