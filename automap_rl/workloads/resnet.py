"""Haiku ResNet-style image classifier.

Normalisation is ``hk.GroupNorm``, which keeps no running statistics, so the
model has no mutable state and the step signature stays
``(params, opt_state, batch)``.
"""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """ResNet size.

  Attributes:
    stages: number of stages; every stage after the first halves the
      resolution and doubles the channel count.
    blocks: residual blocks per stage.
    width: channels of the stem and first stage.
    groups: GroupNorm groups; must divide ``width``.
    image_size: input height and width.
    channels: input channels.
    classes: number of output classes.
    batch: images per batch.
  """

  stages: int = 3
  blocks: int = 1
  width: int = 16
  groups: int = 8
  image_size: int = 32
  channels: int = 3
  classes: int = 16
  batch: int = 16


class ResidualBlock(hk.Module):
  """conv-norm-relu-conv-norm plus (projected) shortcut, then relu."""

  def __init__(self, channels: int, stride: int, groups: int, name: str):
    super().__init__(name=name)
    self.channels, self.stride, self.groups = channels, stride, groups

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [b, h, w, c_in] -> [b, h / stride, w / stride, channels]."""
    shortcut = x
    if self.stride != 1 or x.shape[-1] != self.channels:
      shortcut = hk.Conv2D(self.channels, 1, stride=self.stride, with_bias=False, name="shortcut")(
        x
      )
    y = hk.Conv2D(self.channels, 3, stride=self.stride, with_bias=False, name="conv1")(x)
    y = jax.nn.relu(hk.GroupNorm(self.groups, name="norm1")(y))
    y = hk.Conv2D(self.channels, 3, with_bias=False, name="conv2")(y)
    y = hk.GroupNorm(self.groups, name="norm2")(y)
    return jax.nn.relu(y + shortcut)


def network(images: jax.Array, config: ResNetConfig) -> jax.Array:
  """images [b, image_size, image_size, channels] -> logits [b, classes]."""
  x = hk.Conv2D(config.width, 3, with_bias=False, name="stem")(images)
  x = jax.nn.relu(hk.GroupNorm(config.groups, name="stem_norm")(x))
  for stage in range(config.stages):
    for block in range(config.blocks):
      stride = 2 if stage > 0 and block == 0 else 1
      x = ResidualBlock(
        config.width * 2**stage, stride, config.groups, name=f"stage_{stage}_block_{block}"
      )(x)
  return hk.Linear(config.classes, name="head")(x.mean(axis=(1, 2)))


def make(config: ResNetConfig, seed: int = 0) -> training.Workload:
  """Builds the ResNet training step.

  Batch: ``images`` float32 [batch, image_size, image_size, channels],
  ``labels`` int32 [batch]; loss is softmax cross-entropy.
  """
  net = hk.without_apply_rng(hk.transform(lambda images: network(images, config)))
  params_key, data_key = training.split_seed(seed)
  images_key, labels_key = jax.random.split(data_key)
  size = config.image_size
  batch = {
    "images": jax.random.normal(
      images_key, (config.batch, size, size, config.channels), jnp.float32
    ),
    "labels": jax.random.randint(labels_key, (config.batch,), 0, config.classes, jnp.int32),
  }

  def loss_fn(params, batch):
    logits = net.apply(params, batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

  params = jax.jit(net.init)(params_key, batch["images"])
  return training.build_workload(training.spec_string("resnet", config), loss_fn, params, batch)
