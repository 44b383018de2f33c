"""Mixture-of-experts transformer: the GPT model with a top-k routed MLP.

Routing follows GShard: each sequence is a group of ``seq`` tokens; every
token picks its ``top_k`` experts, each expert takes at most ``capacity``
tokens per group (first choices have priority, overflow is dropped), and
tokens are moved with one-hot dispatch/combine tensors
[batch, seq, experts, capacity] contracted by einsum (``dispatch="einsum"``) or
permuted into their experts' slots by index (``dispatch="gather"``).

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

# How tokens reach their experts: "einsum", GShard's one-hot dispatch and combine tensors
# contracted with the tokens; "gather", a token permutation by slot index (Megatron-Core's
# and MaxText's dropless dispatchers move tokens so, here at the same capacity).
DISPATCHES = ("einsum", "gather")


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
    dispatch: how tokens reach their experts (`DISPATCHES`).
  """

  experts: int = 8
  top_k: int = 2
  capacity_factor: float = 2.0
  aux_loss_weight: float = 0.01
  gated: bool = False
  dispatch: str = "einsum"

  def __post_init__(self):
    super().__post_init__()
    if self.dispatch not in DISPATCHES:
      raise ValueError(f"dispatch={self.dispatch!r} is not one of {', '.join(DISPATCHES)}")
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


def _choices(probs: jax.Array, top_k: int) -> tuple[jax.Array, ...]:
  """Each token's `top_k` choices and their places in line at their experts.

  Returns:
    gates: normalized gates [groups, seq, top_k].
    index: chosen experts [groups, seq, top_k].
    choice: one-hot choices [groups, seq, top_k, experts].
    choice_ks: one-hot choices, k-major (first choices first) [groups, top_k * seq, experts].
    position: each k-major choice's place in line at its expert [groups, top_k * seq, experts]
      (0 where not chosen).
  """
  groups, seq, experts = probs.shape
  gates, index = jax.lax.top_k(probs, top_k)  # [g, s, k]
  gates = gates / gates.sum(axis=-1, keepdims=True)
  choice = jax.nn.one_hot(index, experts, dtype=probs.dtype)  # [g, s, k, e]
  # Slot of each (choice, token) in its expert: k-major so first choices win.
  choice_ks = choice.transpose(0, 2, 1, 3).reshape(groups, top_k * seq, experts)
  position = (jnp.cumsum(choice_ks, axis=1) - 1.0) * choice_ks
  return gates, index, choice, choice_ks, position


def _aux_loss(probs: jax.Array, choice: jax.Array) -> jax.Array:
  """Switch-style load-balancing loss [], 1 when balanced."""
  density = choice[:, :, 0].mean(axis=(0, 1))  # top-1 token share [e]
  return probs.shape[-1] * jnp.sum(density * probs.mean(axis=(0, 1)))


def route(probs: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-k routing with capacity, as one-hot dispatch and combine tensors.

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
  gates, _, choice, choice_ks, position = _choices(probs, top_k)
  choice_ks = choice_ks * (position < capacity)
  slots = jax.nn.one_hot(position.astype(jnp.int32), capacity, dtype=probs.dtype)
  slots = (slots * choice_ks[..., None]).reshape(
    groups, top_k, seq, experts, capacity
  )  # [g, k, s, e, c]
  dispatch = slots.sum(axis=1)
  combine = jnp.einsum("gksec,gsk->gsec", slots, gates)
  return dispatch, combine, _aux_loss(probs, choice)


def route_slots(
  probs: jax.Array, top_k: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-k routing with capacity, as slot indices: the same assignment as `route`.

  Returns:
    slot: int32 [groups, seq, top_k]: each choice's slot ``expert * capacity + place``
      in the experts' buffers, ``experts * capacity`` (past the end) where dropped.
    gates: normalized gates [groups, seq, top_k].
    aux_loss: Switch-style load-balancing loss [], 1 when balanced.
  """
  groups, seq, experts = probs.shape
  gates, index, choice, choice_ks, position = _choices(probs, top_k)
  place = position.sum(axis=-1).reshape(groups, top_k, seq).transpose(0, 2, 1)  # [g, s, k]
  slot = index * capacity + place.astype(jnp.int32)
  slot = jnp.where(place < capacity, slot, experts * capacity)
  return slot, gates, _aux_loss(probs, choice)


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
  dispatch: str = "einsum"

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
    probs = jax.nn.softmax(training.widen(logits), axis=-1)
    # The experts' activations, kept by the "dots" remat policy as a framework that keeps
    # its projections keeps them (`training.EXPERT_ACTIVATION`).
    kept = functools.partial(checkpoint_name, name=training.EXPERT_ACTIVATION)
    if self.dispatch == "einsum":
      dispatch, combine, aux_loss = route(probs, self.top_k, self.capacity)
      dispatch, combine = dispatch.astype(x.dtype), combine.astype(x.dtype)
      expert_in = kept(jnp.einsum("bsec,bsd->ebcd", dispatch, x))
    else:
      slot, gates, aux_loss = route_slots(probs, self.top_k, self.capacity)
      chosen = _choice_of_slot(slot, self.experts, self.capacity)
      expert_in = kept(_permute(x, slot, chosen, self.capacity))
    h = kept(jnp.einsum("ebcd,edf->ebcf", expert_in, wi)) + bi[:, None, None]
    if self.gated:
      wg = self.param("wg", init, (self.experts, d_model, self.hidden))
      h = nn.silu(kept(jnp.einsum("ebcd,edf->ebcf", expert_in, wg))) * h
    else:
      h = nn.gelu(h)
    expert_out = kept(jnp.einsum("ebcf,efd->ebcd", h, wo)) + bo[:, None, None]
    if self.dispatch == "einsum":
      return jnp.einsum("bsec,ebcd->bsd", combine, expert_out), aux_loss
    return _unpermute(expert_out, slot, chosen, gates.astype(x.dtype)), aux_loss


@jax.custom_vjp
def _take_rows(values: jax.Array, index: jax.Array, sources: jax.Array) -> jax.Array:
  """Rows of `values` [b, n, d] at `index` [b, m] (a zero row where out of range), [b, m, d].

  A token permutation's rows, whose gradient is a permutation too: `sources` [b, n, r]
  names, for each row of `values`, the rows of the result that took it (out of range where
  fewer than r did), and the gradient gathers them and sums over r, where a gather's own
  gradient would scatter-add (a dispatcher's unpermute is the transpose of its permute)."""
  return jnp.take_along_axis(values, index[..., None], axis=1, mode="fill", fill_value=0)


def _take_rows_fwd(values, index, sources):
  return _take_rows(values, index, sources), (index, sources)


def _take_rows_bwd(residuals, cotangent):
  index, sources = residuals
  batch, rows, taken = sources.shape
  gathered = jnp.take_along_axis(
    cotangent, sources.reshape(batch, rows * taken, 1), axis=1, mode="fill", fill_value=0
  )
  return gathered.reshape(batch, rows, taken, -1).sum(axis=2), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _choice_of_slot(slot: jax.Array, experts: int, capacity: int) -> jax.Array:
  """Which choice fills each slot: [b, experts * capacity], the index ``s * top_k + k`` of
  the token's choice in `slot` [b, s, k], ``seq * top_k`` (past the end) where empty."""
  batch, seq, top_k = slot.shape
  choices = jnp.arange(seq * top_k, dtype=jnp.int32).reshape(1, seq, top_k)
  empty = jnp.full((batch, experts * capacity), seq * top_k, jnp.int32)
  # The dropped choices' slot, past the end, is dropped.
  return empty.at[jnp.arange(batch)[:, None, None], slot].set(
    jnp.broadcast_to(choices, slot.shape), mode="drop"
  )


def _permute(x: jax.Array, slot: jax.Array, chosen: jax.Array, capacity: int) -> jax.Array:
  """The tokens `x` [b, s, d] in their experts' slots [experts, b, capacity, d] (zeros in
  empty slots), by `slot` [b, s, k] (`route_slots`) and its inverse `chosen` [b, slots]
  (`_choice_of_slot`)."""
  batch, _, top_k = slot.shape
  rows = _take_rows(x, chosen // top_k, slot)  # [b, slots, d]
  return rows.reshape(batch, -1, capacity, rows.shape[-1]).transpose(1, 0, 2, 3)


def _unpermute(
  expert_out: jax.Array, slot: jax.Array, chosen: jax.Array, gates: jax.Array
) -> jax.Array:
  """Each token's experts' outputs, gate-weighted and summed: [b, s, d] from `expert_out`
  [experts, b, capacity, d] at `slot` [b, s, k] (zero for a dropped choice), `chosen` its
  inverse (`_choice_of_slot`)."""
  experts, batch, capacity, width = expert_out.shape
  flat = expert_out.transpose(1, 0, 2, 3).reshape(batch, experts * capacity, width)
  _, seq, top_k = slot.shape
  picked = _take_rows(flat, slot.reshape(batch, seq * top_k), chosen[..., None])
  return jnp.einsum("bskd,bsk->bsd", picked.reshape(batch, seq, top_k, width), gates)


def make(config: MoEConfig, seed: int = 0) -> training.Workload:
  """Builds the MoE LM training step (batch as in :mod:`gpt`)."""
  ffn = functools.partial(
    MoEFeedForward,
    config.experts,
    config.hidden,
    config.top_k,
    config.capacity,
    config.gated,
    config.dispatch,
  )
  return gpt.make_lm_workload(
    training.spec_string("moe", config, PRESETS), config, ffn, seed, config.aux_loss_weight
  )
