"""GPT-style decoder-only transformer in Flax linen.

Parameter paths (unrolled): ``embed``, ``pos_embed``,
``block_{i}/{ln1,attn/{query,key,value,out},ln2,mlp/{fc1,fc2}}``, ``ln_f``,
``lm_head``. With ``scan=True`` the blocks live under ``blocks`` with a leading
``[layers]`` axis on every parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training

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
  """

  layers: int = 2
  d_model: int = 128
  heads: int = 4
  d_ff: int = 0
  seq: int = 64
  vocab: int = 256
  batch: int = 16
  scan: bool = False

  def __post_init__(self):
    if self.d_model % self.heads:
      raise ValueError(
          f"d_model={self.d_model} is not divisible by heads={self.heads}")

  @property
  def hidden(self) -> int:
    """Feed-forward hidden width with the ``d_ff=0`` default resolved."""
    return self.d_ff or 4 * self.d_model


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention: [batch, seq, d] -> [batch, seq, d]."""

  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    seq, d_model = x.shape[-2:]
    head_dim = d_model // self.heads
    qkv = [nn.DenseGeneral((self.heads, head_dim), name=name)(x)
           for name in ("query", "key", "value")]  # each [b, s, h, hd]
    q, k, v = qkv
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
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

  ``__call__(x, _)`` has the ``nn.scan`` carry signature and returns
  ``(x [b, s, d], aux_loss [])``.
  """

  heads: int
  ffn: FeedForwardFactory

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None):
    x = x + CausalSelfAttention(self.heads, name="attn")(
        nn.LayerNorm(name="ln1")(x))
    y, aux_loss = self.ffn(name="mlp")(nn.LayerNorm(name="ln2")(x))
    return x + y, aux_loss


class Transformer(nn.Module):
  """Decoder-only LM: tokens int32 [b, s] -> (logits [b, s, vocab], aux [])."""

  config: GPTConfig
  ffn: FeedForwardFactory

  @nn.compact
  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = self.config
    x = nn.Embed(cfg.vocab, cfg.d_model, name="embed")(tokens)
    pos = self.param("pos_embed", nn.initializers.normal(0.02),
                     (cfg.seq, cfg.d_model))
    x = x + pos[: tokens.shape[-1]]
    if cfg.scan:
      blocks = nn.scan(Block, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=cfg.layers)
      x, aux_losses = blocks(cfg.heads, self.ffn, name="blocks")(x, None)
      aux_loss = aux_losses.sum()
    else:
      aux_loss = jnp.zeros((), x.dtype)
      for i in range(cfg.layers):
        x, aux = Block(cfg.heads, self.ffn, name=f"block_{i}")(x)
        aux_loss = aux_loss + aux
    x = nn.LayerNorm(name="ln_f")(x)
    return nn.Dense(cfg.vocab, use_bias=False, name="lm_head")(x), aux_loss


def make_lm_workload(name: str, config: GPTConfig, ffn: FeedForwardFactory,
                     seed: int, aux_loss_weight: float = 0.0
                     ) -> training.Workload:
  """Next-token LM workload for a :class:`Transformer` with the given ffn.

  Batch: ``inputs`` and ``targets`` int32 [batch, seq]; ``targets`` is
  ``inputs`` shifted left by one token. Loss is the mean cross-entropy plus
  ``aux_loss_weight`` times the summed auxiliary loss of the blocks.
  """
  model = Transformer(config, ffn)
  params_key, data_key = training.split_seed(seed)
  tokens = jax.random.randint(
      data_key, (config.batch, config.seq + 1), 0, config.vocab, jnp.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  def loss_fn(params, batch):
    logits, aux_loss = model.apply({"params": params}, batch["inputs"])
    xent = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]).mean()
    return xent + aux_loss_weight * aux_loss

  params = jax.jit(model.init)(params_key, batch["inputs"])["params"]
  return training.build_workload(name, loss_fn, params, batch)


def make(config: GPTConfig, seed: int = 0) -> training.Workload:
  """Builds the GPT training step (see :func:`make_lm_workload`)."""
  return make_lm_workload(training.spec_string("gpt", config), config,
                          functools.partial(MLP, config.hidden), seed)
