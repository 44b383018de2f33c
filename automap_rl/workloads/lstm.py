"""Stacked LSTM language model with projected cells (LSTMP) in Flax linen.

Each layer is an LSTM with a recurrent projection (Sak et al. 2014): the input
gates of the whole sequence are one matmul outside the recurrence; inside it
(``jax.lax.scan`` over time, state in float32) each step adds the projected
hidden state times the recurrent weight, applies the gates and projects the
new cell output. Layers add their output to their input (residual
connections, as in GNMT) and are stacked with ``nn.scan``, each
rematerialized, so the time loop runs inside the layer loop. Per step the
recurrent and projection weights are read and their gradients accumulated:
the parameter reductions a batch split puts inside the time loop.

Parameter paths: ``embed``, ``layers/{w_input,w_recurrent,bias,w_project}``
(leading ``[layers]`` axis; ``w_input`` [d_model, 4 * cells], ``w_recurrent``
[d_model, 4 * cells], ``bias`` [4 * cells], ``w_project`` [cells, d_model]),
``ln_f``, ``lm_head``.

Presets (``lstm:size=8192-1024``): the LSTM language models of Jozefowicz et
al. (2016, "Exploring the Limits of Language Modeling", Table 1: LSTM-2048-512,
LSTM-8192-2048 and the 2-layer LSTM-8192-1024) and GNMT's 8-layer, 1024-cell
stack (Wu et al. 2016), named cells-projection. The one-billion-word
vocabulary (793k words, trained with a sampled softmax) is replaced by a 32k
subword vocabulary with a full softmax; 256 steps of backpropagation through
time; bfloat16 compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class LSTMConfig:
  """LSTM LM size.

  Attributes:
    layers: stacked LSTM layers.
    cells: LSTM cells per layer (the gates are ``4 * cells`` wide).
    d_model: the projection's width: the layers' input, output and recurrent state.
    seq: time steps (backpropagation through time).
    vocab: vocabulary size.
    batch: sequences per batch.
    dtype: compute dtype (float32 parameters are cast to it in the step; the
      cell state stays float32).
  """

  layers: int = 2
  cells: int = 64
  d_model: int = 32
  seq: int = 16
  vocab: int = 256
  batch: int = 8
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)


_LM = {"vocab": 32768, "seq": 256, "dtype": "bfloat16"}
# Size label (cells-projection) -> config fields.
PRESETS: dict[str, dict[str, Any]] = {
  "2048-512": {"layers": 1, "cells": 2048, "d_model": 512, **_LM},
  "8192-1024": {"layers": 2, "cells": 8192, "d_model": 1024, **_LM},
  "8192-2048": {"layers": 1, "cells": 8192, "d_model": 2048, **_LM},
  "gnmt-1024": {"layers": 8, "cells": 1024, "d_model": 1024, **_LM},
}


def lstm_scan(gates_in: jax.Array, w_recurrent: jax.Array, w_project: jax.Array) -> jax.Array:
  """The projected LSTM recurrence over time, in the dtype of `gates_in`.

  Args:
    gates_in: the input's gate pre-activations [seq, batch, 4 * cells] (input,
      forget, cell, output), bias included.
    w_recurrent: [d_model, 4 * cells].
    w_project: [cells, d_model].

  Returns:
    The projected outputs h_t [seq, batch, d_model].
  """
  batch, cells = gates_in.shape[1], w_project.shape[0]

  def step(
    carry: tuple[jax.Array, jax.Array], gates_t: jax.Array
  ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    h, c = carry
    i, f, g, o = jnp.split(gates_t + h @ w_recurrent, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = (jax.nn.sigmoid(o) * jnp.tanh(c)) @ w_project
    return (h, c), h

  init = (
    jnp.zeros((batch, w_project.shape[1]), gates_in.dtype),
    jnp.zeros((batch, cells), gates_in.dtype),
  )
  _, hs = jax.lax.scan(step, init, gates_in)
  return hs


class LSTMLayer(nn.Module):
  """x + LSTMP(x): [batch, seq, d_model] -> the same, with the ``nn.scan`` carry signature."""

  cells: int

  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    d, gates = x.shape[-1], 4 * self.cells
    init = nn.initializers.lecun_normal()
    w_input = self.param("w_input", init, (d, gates)).astype(x.dtype)
    w_recurrent = self.param("w_recurrent", init, (d, gates))
    bias = self.param("bias", nn.initializers.zeros, (gates,)).astype(x.dtype)
    w_project = self.param("w_project", init, (self.cells, d))
    gates_in = training.widen(jnp.swapaxes(x @ w_input + bias, 0, 1))
    hs = lstm_scan(gates_in, training.widen(w_recurrent), training.widen(w_project))
    return x + jnp.swapaxes(hs, 0, 1).astype(x.dtype), None


class LSTMLM(nn.Module):
  """tokens int32 [batch, seq] -> logits [batch, seq, vocab]."""

  config: LSTMConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    x = nn.Embed(cfg.vocab, cfg.d_model, name="embed")(tokens)
    layers = nn.scan(
      nn.remat(LSTMLayer),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=cfg.layers,
    )
    x, _ = layers(cfg.cells, name="layers")(x, None)
    x = nn.LayerNorm(name="ln_f")(x)
    return nn.Dense(cfg.vocab, use_bias=False, name="lm_head")(x)


def make(config: LSTMConfig, seed: int = 0) -> training.Workload:
  """Builds the next-token LM step.

  Batch: ``inputs`` and ``targets`` int32 [batch, seq]; ``targets`` is
  ``inputs`` shifted left by one token; loss is the mean cross-entropy.
  """
  model = LSTMLM(config)
  params_key, data_key = training.split_seed(seed)
  tokens = jax.random.randint(data_key, (config.batch, config.seq + 1), 0, config.vocab, jnp.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

  def loss_fn(params, batch):
    logits = model.apply({"params": training.cast_floating(params, config.dtype)}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(
      training.widen(logits), batch["targets"]
    ).mean()

  params = jax.jit(model.init)(params_key, batch["inputs"])["params"]
  return training.build_workload(
    training.spec_string("lstm", config, PRESETS), loss_fn, params, batch
  )
