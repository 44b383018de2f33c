"""Mixture-of-experts transformer: the GPT model with a top-k routed MLP.

Routing follows GShard: each sequence is a group of ``seq`` tokens; every
token picks its ``top_k`` experts, each expert takes at most ``capacity``
tokens per group (first choices have priority, overflow is dropped), and
tokens are moved with one-hot dispatch/combine tensors
[batch, seq, experts, capacity] contracted by einsum.

Presets (``moe:size=1.3b``) are the GShard MoE shapes benchmarked by Alpa
(Zheng et al., OSDI 2022, Table 4; alpa-projects/alpa
benchmark/alpa/suite_manual_moe.py): every layer's MLP is routed, sequence
1024, vocabulary 32000, 16 heads, top-2 routing with GShard's expert capacity
``2 * seq / experts`` (Lepikhin et al. 2021, Sec. 2.2), blocks scanned,
bfloat16 compute.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from automap_rl.workloads import gpt, training


@dataclasses.dataclass(frozen=True)
class MoEConfig(gpt.GPTConfig):
  """GPT size plus routing.

  Attributes:
    experts: number of experts per MoE layer.
    top_k: experts chosen per token.
    capacity_factor: expert capacity is
      ``ceil(top_k * seq * capacity_factor / experts)`` tokens per group.
    aux_loss_weight: weight of the load-balancing loss.
    gated: SwiGLU experts (Mixtral's: silu of a gate projection times an up
      projection, both [d_model, d_ff]) instead of GELU ones.
  """

  experts: int = 8
  top_k: int = 2
  capacity_factor: float = 2.0
  aux_loss_weight: float = 0.01
  gated: bool = False

  def __post_init__(self):
    super().__post_init__()
    if not 1 <= self.top_k <= self.experts:
      raise ValueError(f"top_k={self.top_k} must be in [1, experts={self.experts}]")

  @property
  def capacity(self) -> int:
    return max(1, math.ceil(self.top_k * self.seq * self.capacity_factor / self.experts))


_GSHARD = {
  "seq": 1024,
  "vocab": 32000,
  "heads": 16,
  "top_k": 2,
  "capacity_factor": 1.0,
  "scan": True,
  "dtype": "bfloat16",
}
# Size label -> config fields (d_model, layers, experts from Alpa's table).
PRESETS: dict[str, dict[str, Any]] = {
  "380m": {"d_model": 768, "layers": 8, "experts": 8, **_GSHARD},
  "690m": {"d_model": 768, "layers": 8, "experts": 16, **_GSHARD},
  "1.3b": {"d_model": 768, "layers": 16, "experts": 16, **_GSHARD},
  "2.4b": {"d_model": 1024, "layers": 16, "experts": 16, **_GSHARD},
  "10b": {"d_model": 1536, "layers": 16, "experts": 32, **_GSHARD},
  "27b": {"d_model": 2048, "layers": 16, "experts": 48, **_GSHARD},
  "70b": {"d_model": 2048, "layers": 32, "experts": 64, **_GSHARD},
}


def route(probs: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-k routing with capacity.

  Args:
    probs: router probabilities [groups, seq, experts].
    top_k: experts per token.
    capacity: token slots per expert per group.

  Returns:
    dispatch: 0/1 float [groups, seq, experts, capacity].
    combine: gate-weighted dispatch [groups, seq, experts, capacity].
    aux_loss: Switch-style load-balancing loss [], 1 when balanced.
  """
  groups, seq, experts = probs.shape
  gates, index = jax.lax.top_k(probs, top_k)  # [g, s, k]
  gates = gates / gates.sum(axis=-1, keepdims=True)
  choice = jax.nn.one_hot(index, experts, dtype=probs.dtype)  # [g, s, k, e]
  # Slot of each (choice, token) in its expert: k-major so first choices win.
  choice_ks = choice.transpose(0, 2, 1, 3).reshape(groups, top_k * seq, experts)
  position = (jnp.cumsum(choice_ks, axis=1) - 1.0) * choice_ks
  choice_ks = choice_ks * (position < capacity)
  slots = jax.nn.one_hot(position.astype(jnp.int32), capacity, dtype=probs.dtype)
  slots = (slots * choice_ks[..., None]).reshape(
    groups, top_k, seq, experts, capacity
  )  # [g, k, s, e, c]
  dispatch = slots.sum(axis=1)
  combine = jnp.einsum("gksec,gsk->gsec", slots, gates)
  density = choice[:, :, 0].mean(axis=(0, 1))  # top-1 token share [e]
  aux_loss = experts * jnp.sum(density * probs.mean(axis=(0, 1)))
  return dispatch, combine, aux_loss


class MoEFeedForward(nn.Module):
  """Routed expert MLP: x [b, s, d] -> (y [b, s, d], aux_loss []).

  Parameters: ``router/kernel`` [d, experts], ``wi`` [experts, d, hidden],
  ``bi`` [experts, hidden], ``wo`` [experts, hidden, d], ``bo`` [experts, d]; `gated`:
  also ``wg`` [experts, d, hidden], the experts SwiGLU (silu(x wg) * (x wi + bi)).
  """

  experts: int
  hidden: int
  top_k: int
  capacity: int
  gated: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    d_model = x.shape[-1]
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    wi = self.param("wi", init, (self.experts, d_model, self.hidden))
    bi = self.param("bi", nn.initializers.zeros, (self.experts, self.hidden))
    wo = self.param("wo", init, (self.experts, self.hidden, d_model))
    bo = self.param("bo", nn.initializers.zeros, (self.experts, d_model))
    logits = nn.Dense(self.experts, use_bias=False, name="router")(x)
    # Routing in float32: slot positions are token counts, exact in float32.
    dispatch, combine, aux_loss = route(
      jax.nn.softmax(training.widen(logits), axis=-1), self.top_k, self.capacity
    )
    dispatch, combine = dispatch.astype(x.dtype), combine.astype(x.dtype)
    # The experts' activations, kept by the "dots" remat policy as a framework that keeps
    # its projections keeps them (`training.EXPERT_ACTIVATION`).
    kept = functools.partial(checkpoint_name, name=training.EXPERT_ACTIVATION)
    expert_in = kept(jnp.einsum("bsec,bsd->ebcd", dispatch, x))
    h = kept(jnp.einsum("ebcd,edf->ebcf", expert_in, wi)) + bi[:, None, None]
    if self.gated:
      wg = self.param("wg", init, (self.experts, d_model, self.hidden))
      h = nn.silu(kept(jnp.einsum("ebcd,edf->ebcf", expert_in, wg))) * h
    else:
      h = nn.gelu(h)
    expert_out = kept(jnp.einsum("ebcf,efd->ebcd", h, wo)) + bo[:, None, None]
    return jnp.einsum("bsec,ebcd->bsd", combine, expert_out), aux_loss


def make(config: MoEConfig, seed: int = 0) -> training.Workload:
  """Builds the MoE LM training step (batch as in :mod:`gpt`)."""
  ffn = functools.partial(
    MoEFeedForward, config.experts, config.hidden, config.top_k, config.capacity, config.gated
  )
  return gpt.make_lm_workload(
    training.spec_string("moe", config, PRESETS), config, ffn, seed, config.aux_loss_weight
  )
