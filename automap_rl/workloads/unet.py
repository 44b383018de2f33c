"""Flax U-Net trained as a denoiser.

Each level applies a conv block (two conv-GroupNorm-swish layers) and halves
the resolution with ``avg_pool``; the decoder upsamples with a stride-2
``ConvTranspose``, concatenates the matching skip and applies a conv block.
Parameter paths: ``down_{i}``, ``middle``, ``up_{i}``, ``upsample_{i}``,
``out``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class UNetConfig:
  """U-Net size.

  Attributes:
    levels: number of downsampling steps; ``image_size`` must be divisible
      by ``2**levels``.
    base_channels: channels at full resolution, doubled at each level.
    groups: GroupNorm groups; must divide ``base_channels``.
    image_size: input height and width.
    channels: image channels.
    noise_std: standard deviation of the added Gaussian noise.
    batch: images per batch.
  """

  levels: int = 2
  base_channels: int = 16
  groups: int = 8
  image_size: int = 32
  channels: int = 3
  noise_std: float = 0.5
  batch: int = 16


class ConvBlock(nn.Module):
  """Two conv3x3-GroupNorm-swish layers: [b, h, w, c] -> [b, h, w, features]."""

  features: int
  groups: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(2):
      x = nn.Conv(self.features, (3, 3), name=f"conv{i}")(x)
      x = nn.swish(nn.GroupNorm(self.groups, name=f"norm{i}")(x))
    return x


class UNet(nn.Module):
  """images [b, s, s, c] -> prediction [b, s, s, c]."""

  config: UNetConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    skips = []
    for level in range(cfg.levels):
      x = ConvBlock(cfg.base_channels * 2**level, cfg.groups,
                    name=f"down_{level}")(x)
      skips.append(x)
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = ConvBlock(cfg.base_channels * 2**cfg.levels, cfg.groups,
                  name="middle")(x)
    for level in reversed(range(cfg.levels)):
      features = cfg.base_channels * 2**level
      x = nn.ConvTranspose(features, (2, 2), strides=(2, 2),
                           name=f"upsample_{level}")(x)
      x = jnp.concatenate([x, skips[level]], axis=-1)
      x = ConvBlock(features, cfg.groups, name=f"up_{level}")(x)
    return nn.Conv(cfg.channels, (1, 1), name="out")(x)


def make(config: UNetConfig, seed: int = 0) -> training.Workload:
  """Builds the U-Net denoising step.

  Batch: ``images`` and ``noise`` float32 [batch, s, s, channels] with
  ``s = image_size``; the model sees ``images + noise_std * noise`` and the
  loss is the MSE between its output and ``noise``.
  """
  model = UNet(config)
  params_key, data_key = training.split_seed(seed)
  shape = (config.batch, config.image_size, config.image_size,
           config.channels)
  images_key, noise_key = jax.random.split(data_key)
  batch = {
      "images": jax.random.normal(images_key, shape, jnp.float32),
      "noise": jax.random.normal(noise_key, shape, jnp.float32),
  }

  def loss_fn(params, batch):
    noisy = batch["images"] + config.noise_std * batch["noise"]
    predicted = model.apply({"params": params}, noisy)
    return jnp.mean((predicted - batch["noise"]) ** 2)

  params = jax.jit(model.init)(params_key, batch["images"])["params"]
  return training.build_workload(
      training.spec_string("unet", config), loss_fn, params, batch)
