"""The ``eqx-mlp`` family: ``equinox`` 0.13.8's ``eqx.nn.MLP``."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from automap_rl.workloads import training
from automap_rl.workloads.external.common import cross_entropy, random_ids


@dataclasses.dataclass(frozen=True)
class EqxMLPConfig:
  """``eqx.nn.MLP`` size.

  Attributes:
    in_dim: input features.
    width: hidden width (``width_size``).
    depth: hidden layers (``depth``: depth + 1 linear layers).
    classes: output classes.
    batch: examples per batch.
    dtype: compute dtype (parameters stay float32).
  """

  in_dim: int = 32
  width: int = 64
  depth: int = 2
  classes: int = 8
  batch: int = 16
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)


# Deep and wide MLPs by parameter count, at a batch of 4096.
MLP_PRESETS: dict[str, dict[str, Any]] = {
  "250m": {
    "in_dim": 1024,
    "width": 8192,
    "depth": 4,
    "classes": 1000,
    "batch": 4096,
    "dtype": "bfloat16",
  },
  "1b": {
    "in_dim": 4096,
    "width": 16384,
    "depth": 4,
    "classes": 1000,
    "batch": 4096,
    "dtype": "bfloat16",
  },
}


def make_mlp(config: EqxMLPConfig, seed: int = 0) -> training.Workload:
  """MLP classification on one example, ``jax.vmap``ped over the batch.

  ``params`` is the model's floating-point part (``eqx.partition(mlp,
  eqx.is_inexact_array)``: ``layers[i].weight`` [out, in] and ``bias`` [out]).
  Batch: ``inputs`` float32 [batch, in_dim], ``labels`` int32 [batch]; softmax
  cross-entropy.
  """
  params_key, data_key = training.split_seed(seed)

  def build(key: jax.Array) -> eqx.nn.MLP:
    return eqx.nn.MLP(config.in_dim, config.classes, config.width, config.depth, key=key)

  params = eqx.partition(build(params_key), eqx.is_inexact_array)[0]
  _, static = eqx.partition(eqx.filter_eval_shape(build, params_key), eqx.is_inexact_array)
  inputs_key, labels_key = jax.random.split(data_key)
  batch = {
    "inputs": jax.random.normal(inputs_key, (config.batch, config.in_dim), jnp.float32),
    "labels": random_ids(labels_key, (config.batch,), config.classes),
  }

  def loss_fn(params, batch):
    mlp = eqx.combine(training.cast_floating(params, config.dtype), static)
    logits = jax.vmap(mlp)(training.cast_floating(batch["inputs"], config.dtype))
    return cross_entropy(logits, batch["labels"]).mean()

  return training.build_workload(
    training.spec_string("eqx-mlp", config, MLP_PRESETS), loss_fn, params, batch
  )
