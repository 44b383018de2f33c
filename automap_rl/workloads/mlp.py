"""Haiku multi-layer perceptron classifier."""

from __future__ import annotations

import dataclasses
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """MLP size.

  Attributes:
    layers: number of hidden layers.
    width: hidden layer width.
    in_dim: input feature dimension.
    classes: number of output classes.
    batch: examples per batch.
  """

  layers: int = 2
  width: int = 256
  in_dim: int = 64
  classes: int = 16
  batch: int = 16


# Size label (hidden layers x width) -> config fields: deep and wide classifiers of
# 0.06B to 1.04B parameters.
PRESETS: dict[str, dict[str, Any]] = {
  "4x4096": {"layers": 4, "width": 4096, "in_dim": 1024, "classes": 1024},
  "8x8192": {"layers": 8, "width": 8192, "in_dim": 1024, "classes": 1024},
  "4x16384": {"layers": 4, "width": 16384, "in_dim": 4096, "classes": 4096},
  "16x8192": {"layers": 16, "width": 8192, "in_dim": 2048, "classes": 2048},
}


def make(config: MLPConfig, seed: int = 0) -> training.Workload:
  """Builds the MLP training step.

  Batch: ``inputs`` float32 [batch, in_dim], ``labels`` int32 [batch].
  """
  sizes = [config.width] * config.layers + [config.classes]
  net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP(sizes)(x)))
  params_key, data_key = training.split_seed(seed)
  inputs_key, labels_key = jax.random.split(data_key)
  batch = {
    "inputs": jax.random.normal(inputs_key, (config.batch, config.in_dim), jnp.float32),
    "labels": jax.random.randint(labels_key, (config.batch,), 0, config.classes, jnp.int32),
  }

  def loss_fn(params, batch):
    logits = net.apply(params, batch["inputs"])  # [batch, classes]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

  params = jax.jit(net.init)(params_key, batch["inputs"])
  return training.build_workload(
    training.spec_string("mlp", config, PRESETS), loss_fn, params, batch
  )
