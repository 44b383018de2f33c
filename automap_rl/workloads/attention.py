"""Causal attention as a fused kernel (flash attention), for the zoo's language models.

`fused_causal_attention` computes what the models' plain attention does, softmax of the
scaled, causally masked scores in float32 times the values, under a custom VJP whose
forward keeps only the queries, keys, values, output and the rows' log-sum-exp, and
whose backward recomputes the scores from them: flash attention's residuals and flops.
Its forward and backward run under the `ir.kernels` fused-attention scopes, so the
simulator prices them as one kernel each on backends that fuse attention (cuDNN's fused
attention on GPUs, Pallas' flash attention on TPUs: the scores never reach HBM), and as
the ops they are on XLA:CPU. The functions themselves run on any backend.

Shapes: queries [b, s, k, g, d] (k key/value heads of g query heads each: multi-head
attention is g = 1), keys and values [b, s, k, d], output [b, s, k, g, d].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from automap_rl.ir.kernels import FUSED_ATTENTION_BACKWARD, FUSED_ATTENTION_FORWARD


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
  """Scaled, causally masked scores in at least float32, [b, k, g, s, t]."""
  seq, head_dim = q.shape[1], q.shape[-1]
  wide = jnp.promote_types(q.dtype, jnp.float32)
  logits = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=wide)
  logits = logits / jnp.sqrt(jnp.asarray(head_dim, wide))
  causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
  return jnp.where(causal, logits, jnp.finfo(wide).min)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  with jax.named_scope(FUSED_ATTENTION_FORWARD):
    scores = _scores(q, k)
    log_sum_exp = jax.nn.logsumexp(scores, axis=-1, keepdims=True)  # [b, k, g, s, 1]
    weights = jnp.exp(scores - log_sum_exp)
    out = jnp.einsum("bkgst,btkd->bskgd", weights.astype(v.dtype), v)
  return out, (q, k, v, out, log_sum_exp)


def _backward(
  residuals: tuple[jax.Array, ...], d_out: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  q, k, v, out, log_sum_exp = residuals
  with jax.named_scope(FUSED_ATTENTION_BACKWARD):
    weights = jnp.exp(_scores(q, k) - log_sum_exp)  # [b, k, g, s, t]
    wide = weights.dtype
    d_v = jnp.einsum("bkgst,bskgd->btkd", weights.astype(v.dtype), d_out)
    d_weights = jnp.einsum("bskgd,btkd->bkgst", d_out, v, preferred_element_type=wide)
    row = jnp.einsum("bskgd,bskgd->bkgs", d_out, out, preferred_element_type=wide)
    d_scores = weights * (d_weights - row[..., None]) / jnp.sqrt(jnp.asarray(q.shape[-1], wide))
    d_q = jnp.einsum("bkgst,btkd->bskgd", d_scores.astype(q.dtype), k)
    d_k = jnp.einsum("bkgst,bskgd->btkd", d_scores.astype(k.dtype), q)
  return d_q, d_k, d_v


@jax.custom_vjp
def fused_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal attention of queries [b, s, k, g, d] over keys and values [b, s, k, d]:
  [b, s, k, g, d], with flash attention's residuals and backward (see the module)."""
  return _forward(q, k, v)[0]


fused_causal_attention.defvjp(_forward, _backward)
