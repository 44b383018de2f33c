"""GPT-style decoder-only transformer in Flax linen.

Parameter paths (unrolled): ``embed``, ``pos_embed``,
``block_{i}/{ln1,attn/{query,key,value,out},ln2,mlp/{fc1,fc2}}``, ``ln_f``,
``lm_head``. With ``scan=True`` the blocks live under ``blocks`` with a leading
``[layers]`` axis on every parameter.

Presets (``gpt:size=1.3b``) are the GPT-3 shapes benchmarked by Alpa (Zheng et
al., OSDI 2022, Table 4; alpa-projects/alpa benchmark/alpa/suite_manual_gpt.py)
and Megatron-LM: sequence 1024, vocabulary 51200, blocks scanned, bfloat16
compute.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import attention, training

# Builds a feed-forward sub-module; called as ``ffn(name=...)``. The module
# maps x [batch, seq, d_model] to (y [batch, seq, d_model], aux_loss []).
FeedForwardFactory = Callable[..., nn.Module]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Transformer size.

  Attributes:
    layers: number of transformer blocks.
    d_model: residual stream width.
    heads: attention heads; must divide ``d_model``.
    d_ff: feed-forward hidden width; 0 means ``4 * d_model``.
    seq: sequence length.
    vocab: vocabulary size.
    batch: sequences per batch.
    scan: stack the blocks with ``nn.scan`` instead of unrolling them.
    remat: rematerialize each block in the backward pass (``nn.remat``).
    remat_policy: what a rematerialized block keeps (`training.REMAT_POLICIES`: "full",
      "dots").
    dtype: compute dtype (float32 parameters are cast to it in the step).
    fused_attention: attention as a fused kernel
      (`workloads.attention.fused_causal_attention`: flash attention's memory and flops).
    dropout: Megatron-LM's dropout rate (its default 0.1; 0: none) on the attention
      probabilities (b x heads x seq x seq: the one that costs, as an unfused kernel over
      the scores), the embedding and each block's two residual branches. The masks come
      from the batch's `dropout_seeds` (uint32 [batch], one per sequence, drawn by the
      data loader), so a sequence's masks are the same on any partitioning.
  """

  layers: int = 2
  d_model: int = 128
  heads: int = 4
  d_ff: int = 0
  seq: int = 64
  vocab: int = 256
  batch: int = 16
  scan: bool = False
  remat: bool = False
  remat_policy: str = "full"
  dtype: str = "float32"
  fused_attention: bool = False
  dropout: float = 0.0

  def __post_init__(self):
    training.check_dtype(self.dtype)
    training.check_remat(self.remat, self.remat_policy)
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
    if self.dropout and self.fused_attention:
      raise ValueError("dropout on fused attention is not modelled: set one of them")
    if self.d_model % self.heads:
      raise ValueError(f"d_model={self.d_model} is not divisible by heads={self.heads}")

  @property
  def hidden(self) -> int:
    """Feed-forward hidden width with the ``d_ff=0`` default resolved."""
    return self.d_ff or 4 * self.d_model


_GPT3 = {"seq": 1024, "vocab": 51200, "scan": True, "dtype": "bfloat16"}
# Size label -> config fields: layers, d_model, heads as in Alpa's GPT table;
# 13b is GPT-3 13B (Brown et al. 2020, Table 2.1: 40 layers, 40 heads, d_model
# 5120; the table's 5140 is a typo that does not divide into 40 heads); 175b is GPT-3
# 175B (the same table: 96 layers, 96 heads, d_model 12288).
PRESETS: dict[str, dict[str, Any]] = {
  "350m": {"layers": 24, "d_model": 1024, "heads": 16, **_GPT3},
  "1.3b": {"layers": 24, "d_model": 2048, "heads": 32, **_GPT3},
  "2.6b": {"layers": 32, "d_model": 2560, "heads": 32, **_GPT3},
  "6.7b": {"layers": 32, "d_model": 4096, "heads": 32, **_GPT3},
  "13b": {"layers": 40, "d_model": 5120, "heads": 40, **_GPT3},
  "39b": {"layers": 48, "d_model": 8192, "heads": 64, **_GPT3},
  "175b": {"layers": 96, "d_model": 12288, "heads": 96, **_GPT3},
}


def apply_dropout(x: jax.Array, rate: float, keys: jax.Array | None, site: int) -> jax.Array:
  """Inverted dropout of `x` [b, ...] at `rate`, sequence b's mask from `keys[b]` (typed
  PRNG keys [b]) folded with `site` (where in the model it applies); `x` where `keys` is
  None or the rate 0."""
  if keys is None or not rate:
    return x
  keep = jax.vmap(
    lambda k: jax.random.bernoulli(jax.random.fold_in(k, site), 1.0 - rate, x.shape[1:])
  )(keys)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention: [batch, seq, d] -> [batch, seq, d], as a fused kernel
  with `fused`."""

  heads: int
  fused: bool = False
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, keys: jax.Array | None = None) -> jax.Array:
    seq, d_model = x.shape[-2:]
    head_dim = d_model // self.heads
    qkv = [
      nn.DenseGeneral((self.heads, head_dim), name=name)(x) for name in ("query", "key", "value")
    ]  # each [b, s, h, hd]
    q, k, v = qkv
    if self.fused:
      out = attention.fused_causal_attention(q[:, :, :, None], k, v)[:, :, :, 0]
      return nn.DenseGeneral(d_model, axis=(-2, -1), name="out")(out)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = apply_dropout(jax.nn.softmax(logits, axis=-1), self.dropout, keys, 0)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return nn.DenseGeneral(d_model, axis=(-2, -1), name="out")(out)


class MLP(nn.Module):
  """Dense feed-forward block: [b, s, d] -> ([b, s, d], aux_loss=0)."""

  hidden: int

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    h = nn.gelu(nn.Dense(self.hidden, name="fc1")(x))
    return nn.Dense(x.shape[-1], name="fc2")(h), jnp.zeros((), x.dtype)


class Block(nn.Module):
  """Pre-LayerNorm transformer block.

  ``__call__(x, layer, keys)`` has the ``nn.scan`` carry signature (``layer`` [], this
  block's index, scanned; ``keys`` [b] the sequences' dropout keys, or None) and returns
  ``(x [b, s, d], aux_loss [])``.
  """

  heads: int
  ffn: FeedForwardFactory
  fused_attention: bool = False
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, layer: Any = None, keys: jax.Array | None = None):
    if keys is not None:
      keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, layer)
    attn = CausalSelfAttention(self.heads, self.fused_attention, self.dropout, name="attn")
    x = x + apply_dropout(attn(nn.LayerNorm(name="ln1")(x), keys), self.dropout, keys, 1)
    y, aux_loss = self.ffn(name="mlp")(nn.LayerNorm(name="ln2")(x))
    return x + apply_dropout(y, self.dropout, keys, 2), aux_loss


class Transformer(nn.Module):
  """Decoder-only LM: tokens int32 [b, s] -> (logits [b, s, vocab], aux [])."""

  config: GPTConfig
  ffn: FeedForwardFactory

  @nn.compact
  def __call__(
    self, tokens: jax.Array, dropout_seeds: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """tokens int32 [b, s], dropout_seeds uint32 [b] (with `GPTConfig.dropout`)."""
    cfg = self.config
    keys = None if dropout_seeds is None else jax.vmap(jax.random.key)(dropout_seeds)
    x = nn.Embed(cfg.vocab, cfg.d_model, name="embed")(tokens)
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq, cfg.d_model))
    x = apply_dropout(x + pos[: tokens.shape[-1]], cfg.dropout, keys, cfg.layers)
    policy = training.REMAT_POLICIES[cfg.remat_policy]
    block_cls = nn.remat(Block, policy=policy) if cfg.remat else Block
    block_args = (cfg.heads, self.ffn, cfg.fused_attention, cfg.dropout)
    if cfg.scan:
      blocks = nn.scan(
        block_cls,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast),
        length=cfg.layers,
      )
      layers = None if keys is None else jnp.arange(cfg.layers)
      x, aux_losses = blocks(*block_args, name="blocks")(x, layers, keys)
      aux_loss = aux_losses.sum()
    else:
      aux_loss = jnp.zeros((), x.dtype)
      for i in range(cfg.layers):
        x, aux = block_cls(*block_args, name=f"block_{i}")(x, i, keys)
        aux_loss = aux_loss + aux
    x = nn.LayerNorm(name="ln_f")(x)
    return nn.Dense(cfg.vocab, use_bias=False, name="lm_head")(x), aux_loss


def make_lm_workload(
  name: str, config: GPTConfig, ffn: FeedForwardFactory, seed: int, aux_loss_weight: float = 0.0
) -> training.Workload:
  """Next-token LM workload for a :class:`Transformer` with the given ffn.

  Batch: ``inputs`` and ``targets`` int32 [batch, seq]; ``targets`` is ``inputs`` shifted
  left by one token; with dropout, ``dropout_seeds`` uint32 [batch]. Loss is the mean
  cross-entropy plus ``aux_loss_weight`` times the summed auxiliary loss of the blocks.
  """
  model = Transformer(config, ffn)
  params_key, data_key = training.split_seed(seed)
  tokens = jax.random.randint(data_key, (config.batch, config.seq + 1), 0, config.vocab, jnp.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  if config.dropout:
    seeds_key = jax.random.fold_in(data_key, 1)  # Not the tokens' key.
    batch["dropout_seeds"] = jax.random.bits(seeds_key, (config.batch,), jnp.uint32)

  def loss_fn(params, batch):
    logits, aux_loss = model.apply(
      {"params": training.cast_floating(params, config.dtype)},
      batch["inputs"],
      batch.get("dropout_seeds"),
    )
    xent = optax.softmax_cross_entropy_with_integer_labels(
      training.widen(logits), batch["targets"]
    ).mean()
    return xent + aux_loss_weight * training.widen(aux_loss)

  params = jax.jit(model.init)(params_key, batch["inputs"], batch.get("dropout_seeds"))["params"]
  return training.build_workload(name, loss_fn, params, batch)


def make(config: GPTConfig, seed: int = 0) -> training.Workload:
  """Builds the GPT training step (see :func:`make_lm_workload`)."""
  return make_lm_workload(
    training.spec_string("gpt", config, PRESETS),
    config,
    functools.partial(MLP, config.hidden),
    seed,
  )
