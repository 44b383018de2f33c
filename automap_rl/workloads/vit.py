"""Vision Transformer classifier in Equinox.

The model works on one image [channels, height, width] (Equinox's
convention) and the loss ``jax.vmap``s it over the batch. The encoder blocks
are built with ``eqx.filter_vmap`` and run by ``jax.lax.scan`` over their
array leaves, so every block leaf has a leading ``[layers]`` axis. ``params``
is the model's floating-point part (``eqx.partition(model,
eqx.is_inexact_array)``): an Equinox module with fields ``patch_embedding``
(Conv2d ``weight`` [d, c, p, p], ``bias``), ``cls_token`` [1, d],
``positional_embedding`` [tokens, d], ``blocks`` (``norm1``, ``attention``
with ``{query,key,value,output}_proj`` Linear ``weight`` [out, in] and
``bias``, ``norm2``, ``mlp/{fc1,fc2}``), ``norm`` and ``head``.

Presets (``vit:size=l16``): ViT-B/16, L/16 and H/14 (Dosovitskiy et al. 2021,
Table 1), ViT-g/14 and G/14 (Zhai et al. 2022, Table 2) and the ViT-22B shape
(Dehghani et al. 2023, Table 1; as a plain serial block, without its parallel
layers and query/key normalization), all at 224x224 with 1000 classes and
bfloat16 compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """ViT size.

  Attributes:
    layers: encoder blocks.
    d_model: token width.
    heads: attention heads; must divide ``d_model``.
    mlp_dim: MLP hidden width.
    patch: patch height and width; must divide ``image_size``.
    image_size: input height and width.
    channels: input channels.
    classes: output classes.
    batch: images per batch.
    remat: rematerialize each block in the backward pass
      (``jax.checkpoint``).
    dtype: compute dtype (float32 parameters are cast to it in the step).
  """

  layers: int = 2
  d_model: int = 32
  heads: int = 4
  mlp_dim: int = 64
  patch: int = 4
  image_size: int = 16
  channels: int = 3
  classes: int = 10
  batch: int = 8
  remat: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)
    if self.image_size % self.patch or self.d_model % self.heads:
      raise ValueError(
        f"patch={self.patch} must divide image_size={self.image_size} and "
        f"heads={self.heads} must divide d_model={self.d_model}"
      )

  @property
  def tokens(self) -> int:
    """Patches plus the class token."""
    return (self.image_size // self.patch) ** 2 + 1


_IMAGENET = {"image_size": 224, "classes": 1000, "dtype": "bfloat16"}
# Size label -> config fields.
PRESETS: dict[str, dict[str, Any]] = {
  "b16": {"layers": 12, "d_model": 768, "heads": 12, "mlp_dim": 3072, "patch": 16, **_IMAGENET},
  "l16": {"layers": 24, "d_model": 1024, "heads": 16, "mlp_dim": 4096, "patch": 16, **_IMAGENET},
  "h14": {"layers": 32, "d_model": 1280, "heads": 16, "mlp_dim": 5120, "patch": 14, **_IMAGENET},
  "g14": {"layers": 40, "d_model": 1408, "heads": 16, "mlp_dim": 6144, "patch": 14, **_IMAGENET},
  "G14": {"layers": 48, "d_model": 1664, "heads": 16, "mlp_dim": 8192, "patch": 14, **_IMAGENET},
  "22b": {"layers": 48, "d_model": 6144, "heads": 48, "mlp_dim": 24576, "patch": 14, **_IMAGENET},
}


class MLP(eqx.Module):
  """gelu MLP on one token: [d] -> [d]."""

  fc1: eqx.nn.Linear
  fc2: eqx.nn.Linear

  def __init__(self, d_model: int, hidden: int, key: jax.Array):
    key1, key2 = jax.random.split(key)
    self.fc1 = eqx.nn.Linear(d_model, hidden, key=key1)
    self.fc2 = eqx.nn.Linear(hidden, d_model, key=key2)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x)))


class EncoderBlock(eqx.Module):
  """Pre-LayerNorm transformer block: tokens [n, d] -> [n, d]."""

  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp: MLP

  def __init__(self, config: ViTConfig, key: jax.Array):
    attention_key, mlp_key = jax.random.split(key)
    self.norm1 = eqx.nn.LayerNorm(config.d_model)
    self.attention = eqx.nn.MultiheadAttention(
      config.heads,
      config.d_model,
      use_query_bias=True,
      use_key_bias=True,
      use_value_bias=True,
      use_output_bias=True,
      key=attention_key,
    )
    self.norm2 = eqx.nn.LayerNorm(config.d_model)
    self.mlp = MLP(config.d_model, config.mlp_dim, mlp_key)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h)
    return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class ViT(eqx.Module):
  """image [channels, s, s] -> logits [classes]."""

  patch_embedding: eqx.nn.Conv2d
  cls_token: jax.Array
  positional_embedding: jax.Array
  blocks: EncoderBlock
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear
  remat: bool = eqx.field(static=True)

  def __init__(self, config: ViTConfig, key: jax.Array):
    keys = jax.random.split(key, 5)
    d = config.d_model
    self.patch_embedding = eqx.nn.Conv2d(
      config.channels, d, config.patch, stride=config.patch, key=keys[0]
    )
    self.cls_token = 0.02 * jax.random.normal(keys[1], (1, d))
    self.positional_embedding = 0.02 * jax.random.normal(keys[2], (config.tokens, d))
    self.blocks = eqx.filter_vmap(lambda k: EncoderBlock(config, k))(
      jax.random.split(keys[3], config.layers)
    )
    self.norm = eqx.nn.LayerNorm(d)
    self.head = eqx.nn.Linear(d, config.classes, key=keys[4])
    self.remat = config.remat

  def __call__(self, image: jax.Array) -> jax.Array:
    x = self.patch_embedding(image)  # [d, s / patch, s / patch]
    x = x.reshape(x.shape[0], -1).T  # [patches, d]
    x = jnp.concatenate([self.cls_token, x]) + self.positional_embedding
    dynamic, static = eqx.partition(self.blocks, eqx.is_array)

    def run(x: jax.Array, block_arrays: EncoderBlock) -> tuple[jax.Array, None]:
      return eqx.combine(block_arrays, static)(x), None

    x, _ = jax.lax.scan(jax.checkpoint(run) if self.remat else run, x, dynamic)
    return self.head(self.norm(x[0]))


def make(config: ViTConfig, seed: int = 0) -> training.Workload:
  """Builds the ViT classification step.

  Batch: ``images`` float32 [batch, channels, image_size, image_size],
  ``labels`` int32 [batch]; loss is softmax cross-entropy.
  """
  params_key, data_key = training.split_seed(seed)
  params = jax.jit(lambda key: eqx.partition(ViT(config, key), eqx.is_inexact_array)[0])(params_key)
  _, static = eqx.partition(eqx.filter_eval_shape(ViT, config, params_key), eqx.is_inexact_array)
  images_key, labels_key = jax.random.split(data_key)
  size = config.image_size
  batch = {
    "images": jax.random.normal(
      images_key, (config.batch, config.channels, size, size), jnp.float32
    ),
    "labels": jax.random.randint(labels_key, (config.batch,), 0, config.classes, jnp.int32),
  }

  def loss_fn(params, batch):
    model = eqx.combine(training.cast_floating(params, config.dtype), static)
    logits = jax.vmap(model)(training.cast_floating(batch["images"], config.dtype))
    return optax.softmax_cross_entropy_with_integer_labels(
      training.widen(logits), batch["labels"]
    ).mean()

  return training.build_workload(
    training.spec_string("vit", config, PRESETS), loss_fn, params, batch
  )
