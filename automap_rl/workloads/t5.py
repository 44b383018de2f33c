"""T5 v1.1 encoder-decoder in Haiku.

Pre-RMSNorm layers without biases, bucketed relative position biases (one
table per stack, shared by its layers), gated-GELU feed-forward, a shared
input embedding and an untied output projection (Raffel et al. 2020; the
v1.1 changes in google-research/text-to-text-transfer-transformer). Each stack
is one ``hk.layer_stack`` (a scan), so its parameters have a leading
``[layers]`` axis. Parameter paths: ``shared/embeddings``,
``{encoder,decoder}/relative_position_bias/embeddings``,
``{encoder,decoder}/layer_stack/layer/{self_attention,cross_attention}/{q,k,v,o}/w``,
``.../layer/mlp/{wi_0,wi_1,wo}/w``, ``.../layer/*_norm/scale``,
``{encoder,decoder}/final_norm/scale``, ``lm_head/w``.

Presets (``t5:size=xl``): the T5 v1.1 small, base, large, xl and xxl shapes
(the released checkpoints' configs) with the pre-training lengths: 512 input
tokens, 128 target tokens (the paper's 114, rounded up), vocabulary 32128.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Encoder-decoder size.

  Attributes:
    layers: layers of the encoder and of the decoder, each.
    d_model: residual stream width.
    heads: attention heads.
    d_kv: width of one head's keys and values.
    d_ff: gated feed-forward hidden width.
    vocab: vocabulary size.
    seq: encoder (input) length.
    target_seq: decoder (target) length.
    buckets: relative position buckets.
    max_distance: distance beyond which relative positions share a bucket.
    batch: examples per batch.
    remat: rematerialize each layer in the backward pass (``hk.remat``).
    dtype: compute dtype (float32 parameters are cast to it in the step).
  """

  layers: int = 2
  d_model: int = 64
  heads: int = 4
  d_kv: int = 16
  d_ff: int = 128
  vocab: int = 256
  seq: int = 32
  target_seq: int = 16
  buckets: int = 32
  max_distance: int = 128
  batch: int = 8
  remat: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)


_T5 = {"vocab": 32128, "seq": 512, "target_seq": 128, "d_kv": 64, "dtype": "bfloat16"}
# Size label -> config fields.
PRESETS: dict[str, dict[str, Any]] = {
  "small": {"layers": 8, "d_model": 512, "heads": 6, "d_ff": 1024, **_T5},
  "base": {"layers": 12, "d_model": 768, "heads": 12, "d_ff": 2048, **_T5},
  "large": {"layers": 24, "d_model": 1024, "heads": 16, "d_ff": 2816, **_T5},
  "xl": {"layers": 24, "d_model": 2048, "heads": 32, "d_ff": 5120, **_T5},
  "xxl": {"layers": 24, "d_model": 4096, "heads": 64, "d_ff": 10240, **_T5},
}


def relative_buckets(
  query_len: int, key_len: int, buckets: int, max_distance: int, bidirectional: bool
) -> jax.Array:
  """T5's bucket of every (query, key) offset: int32 [query_len, key_len].

  Half the buckets (per direction) are exact offsets, the rest grow
  logarithmically up to ``max_distance``.
  """
  offset = jnp.arange(key_len)[None, :] - jnp.arange(query_len)[:, None]
  bucket = jnp.zeros_like(offset)
  if bidirectional:
    buckets //= 2
    bucket = jnp.where(offset > 0, buckets, 0)
    distance = jnp.abs(offset)
  else:
    distance = jnp.maximum(-offset, 0)
  exact = buckets // 2
  log_bucket = exact + (
    jnp.log(jnp.maximum(distance, 1) / exact) / math.log(max_distance / exact) * (buckets - exact)
  ).astype(jnp.int32)
  log_bucket = jnp.minimum(log_bucket, buckets - 1)
  return bucket + jnp.where(distance < exact, distance, log_bucket)


class RelativePositionBias(hk.Module):
  """Per-head attention bias [1, heads, query_len, key_len] from a learned
  table ``embeddings`` [buckets, heads]."""

  def __init__(self, config: T5Config, bidirectional: bool, name: str):
    super().__init__(name=name)
    self.config, self.bidirectional = config, bidirectional

  def __call__(self, query_len: int, key_len: int) -> jax.Array:
    cfg = self.config
    table = hk.get_parameter(
      "embeddings", (cfg.buckets, cfg.heads), init=hk.initializers.RandomNormal(1.0)
    )
    index = relative_buckets(query_len, key_len, cfg.buckets, cfg.max_distance, self.bidirectional)
    return jnp.take(table, index, axis=0).transpose(2, 0, 1)[None]


class Attention(hk.Module):
  """Multi-head attention without scaling (T5 folds it into the init):
  queries x [b, q, d], memory [b, k, d], bias [1 or b, h, q, k] -> [b, q, d]."""

  def __init__(self, config: T5Config, name: str):
    super().__init__(name=name)
    self.config = config

  def __call__(self, x: jax.Array, memory: jax.Array, bias: jax.Array) -> jax.Array:
    cfg = self.config
    width = cfg.heads * cfg.d_kv

    def project(inputs: jax.Array, name: str) -> jax.Array:
      out = hk.Linear(width, with_bias=False, name=name)(inputs)
      return out.reshape(*inputs.shape[:-1], cfg.heads, cfg.d_kv)

    q, k, v = project(x, "q"), project(memory, "k"), project(memory, "v")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias.astype(q.dtype)
    weights = jax.nn.softmax(training.widen(logits), axis=-1).astype(q.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(*x.shape[:-1], width)
    return hk.Linear(cfg.d_model, with_bias=False, name="o")(out)


class GatedFeedForward(hk.Module):
  """gelu(x wi_0) * (x wi_1) wo: [b, s, d] -> [b, s, d]."""

  def __init__(self, config: T5Config, name: str):
    super().__init__(name=name)
    self.config = config

  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    gate = jax.nn.gelu(hk.Linear(cfg.d_ff, with_bias=False, name="wi_0")(x))
    hidden = gate * hk.Linear(cfg.d_ff, with_bias=False, name="wi_1")(x)
    return hk.Linear(cfg.d_model, with_bias=False, name="wo")(hidden)


def _norm(name: str) -> hk.RMSNorm:
  return hk.RMSNorm(axis=-1, eps=1e-6, name=name)


def encoder(tokens_embedded: jax.Array, config: T5Config) -> jax.Array:
  """Encoder stack: embedded inputs [b, s, d] -> [b, s, d]."""
  with hk.experimental.name_scope("encoder"):
    seq = tokens_embedded.shape[1]
    bias = RelativePositionBias(config, True, "relative_position_bias")(seq, seq)

    def layer(x: jax.Array) -> jax.Array:
      with hk.experimental.name_scope("layer"):
        h = _norm("self_attention_norm")(x)
        x = x + Attention(config, "self_attention")(h, h, bias)
        return x + GatedFeedForward(config, "mlp")(_norm("mlp_norm")(x))

    layer = hk.remat(layer) if config.remat else layer
    x = hk.layer_stack(config.layers, name="layer_stack")(layer)(tokens_embedded)
    return _norm("final_norm")(x)


def decoder(targets_embedded: jax.Array, encoded: jax.Array, config: T5Config) -> jax.Array:
  """Causal decoder stack with cross-attention: [b, t, d] -> [b, t, d]."""
  with hk.experimental.name_scope("decoder"):
    seq = targets_embedded.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    bias = RelativePositionBias(config, False, "relative_position_bias")(seq, seq)
    bias = jnp.where(causal, bias, -1e9)
    no_bias = jnp.zeros((1, 1, 1, 1), targets_embedded.dtype)

    def layer(x: jax.Array) -> jax.Array:
      with hk.experimental.name_scope("layer"):
        h = _norm("self_attention_norm")(x)
        x = x + Attention(config, "self_attention")(h, h, bias)
        h = _norm("cross_attention_norm")(x)
        x = x + Attention(config, "cross_attention")(h, encoded, no_bias)
        return x + GatedFeedForward(config, "mlp")(_norm("mlp_norm")(x))

    layer = hk.remat(layer) if config.remat else layer
    x = hk.layer_stack(config.layers, name="layer_stack")(layer)(targets_embedded)
    return _norm("final_norm")(x)


def network(inputs: jax.Array, decoder_inputs: jax.Array, config: T5Config) -> jax.Array:
  """inputs int32 [b, seq], decoder_inputs int32 [b, target_seq] -> logits
  [b, target_seq, vocab]."""
  embed = hk.Embed(config.vocab, config.d_model, name="shared")
  encoded = encoder(embed(inputs), config)
  decoded = decoder(embed(decoder_inputs), encoded, config)
  return hk.Linear(config.vocab, with_bias=False, name="lm_head")(decoded)


def make(config: T5Config, seed: int = 0) -> training.Workload:
  """Builds the span-corruption-shaped training step.

  Batch: ``inputs`` int32 [batch, seq], ``targets`` int32 [batch,
  target_seq]; the decoder sees ``targets`` shifted right (token 0 first) and
  the loss is the mean cross-entropy on ``targets``.
  """
  net = hk.without_apply_rng(
    hk.transform(lambda inputs, decoder_inputs: network(inputs, decoder_inputs, config))
  )
  params_key, data_key = training.split_seed(seed)
  inputs_key, targets_key = jax.random.split(data_key)
  batch = {
    "inputs": jax.random.randint(
      inputs_key, (config.batch, config.seq), 0, config.vocab, jnp.int32
    ),
    "targets": jax.random.randint(
      targets_key, (config.batch, config.target_seq), 0, config.vocab, jnp.int32
    ),
  }

  def shift_right(targets: jax.Array) -> jax.Array:
    return jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]

  def loss_fn(params, batch):
    logits = net.apply(
      training.cast_floating(params, config.dtype), batch["inputs"], shift_right(batch["targets"])
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      training.widen(logits), batch["targets"]
    ).mean()

  params = jax.jit(net.init)(params_key, batch["inputs"], shift_right(batch["targets"]))
  return training.build_workload(
    training.spec_string("t5", config, PRESETS), loss_fn, params, batch
  )
