"""Model flops as papers count them: a decoder-only transformer's `Shape` and each paper's
flop formula over it (`FORMULAS`), so that a simulated step time gives the figure a paper
would report for it (TFLOP/s per device, MFU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from automap_rl.workloads import spec as spec_lib


@dataclasses.dataclass(frozen=True)
class Shape:
  """A decoder-only transformer as flop formulas read it.

  Attributes:
    layers: decoder layers L.
    d_model: residual width h.
    heads: query heads H.
    head_dim: width of each head Q (H * Q may differ from h, as in PaLM and MaxText).
    kv_heads: key/value heads (H: multi-head, 1: multi-query, between: grouped-query).
    d_ff: feed-forward hidden width (of each expert).
    vocab: vocabulary V.
    gated: the feed-forward is gated (SwiGLU: three matrices, not two).
    experts: experts per MoE layer (1: dense).
    top_k: experts each token is routed to.
    tied: the output projection is the input embedding.
  """

  layers: int
  d_model: int
  heads: int
  head_dim: int
  kv_heads: int
  d_ff: int
  vocab: int
  gated: bool = False
  experts: int = 1
  top_k: int = 1
  tied: bool = False

  def params(self) -> float:
    """Matmul and embedding parameters (norms and biases left out)."""
    h, attn = self.d_model, self.heads * self.head_dim
    attention = 2 * h * attn + 2 * h * self.kv_heads * self.head_dim
    ffn = (3 if self.gated else 2) * h * self.d_ff * self.experts
    router = h * self.experts if self.experts > 1 else 0
    return self.layers * (attention + ffn + router) + self.vocab * h * (1 if self.tied else 2)


def megatron_2021_flops(shape: Shape, batch: int, seq: int) -> float:
  """Narayanan et al. (SC 2021), Sec. 5.1: F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)
  flops per step, with activation recomputation (a second forward pass) counted."""
  l, h, v = shape.layers, shape.d_model, shape.vocab
  return 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))


def megatron_2021_params(shape: Shape, seq: int) -> float:
  """Narayanan et al. (SC 2021), Sec. 5.1: P = 12 l h^2 (1 + 13 / 12h + (V + s) / 12 l h)."""
  l, h = shape.layers, shape.d_model
  return 12 * l * h * h * (1 + 13 / (12 * h) + (shape.vocab + seq) / (12 * l * h))


def megatron_lm_flops(shape: Shape, batch: int, seq: int) -> float:
  """Megatron-LM's `num_floating_point_operations` (megatron/training/training.py): 12 B s
  L h^2 ((1 + K / H + s / h) H Q / h + (d_ff / h) top_k (3/2 if gated)) + 6 B s h V flops per
  step; model flops, recomputation not counted."""
  h = shape.d_model
  attention = (1 + shape.kv_heads / shape.heads + seq / h) * shape.heads * shape.head_dim / h
  ffn = shape.d_ff / h * shape.top_k * (1.5 if shape.gated else 1.0)
  return (
    12 * batch * seq * shape.layers * h * h * (attention + ffn) + 6 * batch * seq * h * shape.vocab
  )


def palm_flops(shape: Shape, batch: int, seq: int) -> float:
  """Chowdhery et al. (PaLM, 2022), Appendix B: 6 N + 12 L H Q T model flops per token (N
  the parameters, T the sequence), recomputation not counted."""
  per_token = 6 * shape.params() + 12 * shape.layers * shape.heads * shape.head_dim * seq
  return batch * seq * per_token


def maxtext_flops(shape: Shape, batch: int, seq: int) -> float:
  """MaxText's `calculate_tflops_training_per_device` (MaxText/maxtext_utils.py, 2024)
  times the devices: 3 (forward and backward) x [L (FFN + QKV + output projection +
  4 s H Q non-causal attention) + 2 h V embedding] per token."""
  h, hq = shape.d_model, shape.heads * shape.head_dim
  ffn = 2 * h * shape.d_ff * ((2 if shape.gated else 1) + 1) * shape.top_k
  ffn += 2 * h * shape.experts if shape.experts > 1 else 0
  qkv = 2 * h * (shape.heads + 2 * shape.kv_heads) * shape.head_dim
  layer = ffn + qkv + 2 * h * hq + 4 * seq * hq
  return 3 * batch * seq * (shape.layers * layer + 2 * h * shape.vocab)


FORMULAS: dict[str, Callable[[Shape, int, int], float]] = {
  "megatron-2021": megatron_2021_flops,
  "megatron-lm": megatron_lm_flops,
  "palm": palm_flops,
  "maxtext": maxtext_flops,
}


def simulated_shape(model: str) -> Shape:
  """The `Shape` of a gpt, moe or llama workload spec."""
  family, c = spec_lib.make_config(model)
  if family == "llama":
    return Shape(
      c.layers, c.d_model, c.heads, c.head_dim, c.kv_heads, c.d_ff, c.vocab, True,
      tied=c.tie_embeddings,
    )  # fmt: skip
  if family in ("gpt", "moe"):
    experts = (c.experts, c.top_k) if family == "moe" else (1, 1)
    gated = family == "moe" and c.gated
    return Shape(
      c.layers, c.d_model, c.heads, c.d_model // c.heads, c.heads, c.hidden, c.vocab, gated,
      *experts,
    )  # fmt: skip
  raise ValueError(f"no flop shape for model family {family!r} (gpt, moe or llama)")
