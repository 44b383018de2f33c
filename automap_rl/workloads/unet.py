"""Diffusion U-Net in Flax linen, trained to predict the noise (DDPM).

The ADM / Stable Diffusion layout: a timestep embedding (sinusoidal, then an
MLP) conditions every residual block (GroupNorm-swish-conv twice, plus the
embedding); each resolution has ``blocks`` residual blocks on the way down and
``blocks + 1`` on the way up (each fed a skip), optionally each followed by an
attention block; stride-2 convolutions downsample, nearest-neighbour
upsampling plus a convolution upsample; the middle is residual-attention-
residual. Attention blocks are self-attention, or with ``context_dim`` a
Stable Diffusion spatial transformer (self-attention, cross-attention to the
context, GEGLU feed-forward). Parameter paths: ``time_mlp_{0,1}``,
``conv_in``, ``down_{level}_res_{i}``, ``down_{level}_attn_{i}``,
``downsample_{level}``, ``mid_res_{0,1}``, ``mid_attn``, ``up_{level}_res_{i}``,
``up_{level}_attn_{i}``, ``upsample_{level}``, ``norm_out``, ``conv_out``.

Presets (``unet:size=sd-1.5``): DDPM's CIFAR-10 model (Ho et al. 2020,
Appendix B: 35.7M parameters) and the Stable Diffusion v1 U-Net (Rombach et
al. 2022; CompVis/stable-diffusion configs/stable-diffusion/v1-inference.yaml:
860M parameters on 64x64x4 latents with 77 CLIP text states of width 768).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class UNetConfig:
  """U-Net size.

  Attributes:
    levels: downsampling steps; ``image_size`` must be divisible by
      ``2**levels``. Level ``l`` (0 to ``levels``) has resolution
      ``image_size / 2**l``.
    base_channels: channels at level 0.
    max_mult: cap of the channel multiplier ``2**l`` of level ``l``; 0 means
      no cap (DDPM's (1, 2, 2, 2) is ``max_mult=2``, SD's (1, 2, 4, 4) is 4).
    blocks: residual blocks per level on the way down.
    groups: GroupNorm groups; must divide ``base_channels``.
    attention: digits of the levels with attention blocks, e.g. ``"12"``;
      the middle has one whenever any level does.
    heads: attention heads.
    context_dim: width of the cross-attention context; 0 means plain
      self-attention blocks and no context input.
    context_len: context tokens.
    image_size: input height and width.
    channels: image channels.
    batch: images per batch.
    dtype: compute dtype (float32 parameters are cast to it in the step).
  """

  levels: int = 2
  base_channels: int = 16
  max_mult: int = 0
  blocks: int = 1
  groups: int = 8
  attention: str = "1"
  heads: int = 2
  context_dim: int = 0
  context_len: int = 77
  image_size: int = 32
  channels: int = 3
  batch: int = 16
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)
    if self.image_size % 2**self.levels:
      raise ValueError(
        f"image_size={self.image_size} is not divisible by 2**levels={2**self.levels}"
      )
    if any(not c.isdigit() or int(c) > self.levels for c in self.attention):
      raise ValueError(f"attention={self.attention!r} must be digits of levels 0 to {self.levels}")

  def level_channels(self, level: int) -> int:
    mult = 2**level
    return self.base_channels * (min(mult, self.max_mult) if self.max_mult else mult)

  def has_attention(self, level: int) -> bool:
    return str(level) in self.attention


# Size label -> config fields.
PRESETS: dict[str, dict[str, Any]] = {
  "ddpm-cifar10": {
    "levels": 3,
    "base_channels": 128,
    "max_mult": 2,
    "blocks": 2,
    "groups": 32,
    "attention": "1",
    "heads": 1,
    "image_size": 32,
    "channels": 3,
  },
  "sd-1.5": {
    "levels": 3,
    "base_channels": 320,
    "max_mult": 4,
    "blocks": 2,
    "groups": 32,
    "attention": "012",
    "heads": 8,
    "context_dim": 768,
    "context_len": 77,
    "image_size": 64,
    "channels": 4,
    "dtype": "bfloat16",
  },
}


def timestep_embedding(t: jax.Array, dim: int) -> jax.Array:
  """Sinusoidal embedding of timesteps t [b] in [0, 1): [b, dim]."""
  half = dim // 2
  freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
  angles = 1000.0 * training.widen(t[:, None]) * freqs
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ResBlock(nn.Module):
  """x [b, h, w, c], temb [b, t] -> [b, h, w, features]."""

  features: int
  groups: int

  @nn.compact
  def __call__(self, x: jax.Array, temb: jax.Array) -> jax.Array:
    h = nn.Conv(self.features, (3, 3), name="conv1")(
      nn.swish(nn.GroupNorm(self.groups, name="norm1")(x))
    )
    h = h + nn.Dense(self.features, name="time_proj")(nn.swish(temb))[:, None, None]
    h = nn.Conv(self.features, (3, 3), name="conv2")(
      nn.swish(nn.GroupNorm(self.groups, name="norm2")(h))
    )
    if x.shape[-1] != self.features:
      x = nn.Conv(self.features, (1, 1), name="skip")(x)
    return x + h


class AttentionBlock(nn.Module):
  """Residual attention over the pixels: x [b, h, w, c], context [b, n, e]
  or None -> [b, h, w, c]."""

  heads: int
  groups: int

  @nn.compact
  def __call__(self, x: jax.Array, context: jax.Array | None) -> jax.Array:
    b, height, width, c = x.shape
    t = nn.GroupNorm(self.groups, name="norm")(x).reshape(b, height * width, c)
    if context is None:
      t = nn.MultiHeadDotProductAttention(self.heads, name="attn")(t)
    else:
      t = nn.Dense(c, name="proj_in")(t)
      t = t + nn.MultiHeadDotProductAttention(self.heads, name="attn1")(
        nn.LayerNorm(name="norm1")(t)
      )
      t = t + nn.MultiHeadDotProductAttention(self.heads, name="attn2")(
        nn.LayerNorm(name="norm2")(t), context
      )
      value, gate = jnp.split(
        nn.Dense(8 * c, name="ff_in")(nn.LayerNorm(name="norm3")(t)), 2, axis=-1
      )
      t = t + nn.Dense(c, name="ff_out")(value * nn.gelu(gate))
      t = nn.Dense(c, name="proj_out")(t)
    return x + t.reshape(b, height, width, c)


class UNet(nn.Module):
  """Noisy images [b, s, s, c], timesteps [b], context [b, n, e] or None ->
  predicted noise [b, s, s, c]."""

  config: UNetConfig

  @nn.compact
  def __call__(self, x: jax.Array, t: jax.Array, context: jax.Array | None) -> jax.Array:
    cfg = self.config
    time_dim = 4 * cfg.base_channels
    temb = timestep_embedding(t, cfg.base_channels).astype(x.dtype)
    temb = nn.Dense(time_dim, name="time_mlp_0")(temb)
    temb = nn.Dense(time_dim, name="time_mlp_1")(nn.swish(temb))

    def attend(x: jax.Array, name: str) -> jax.Array:
      return AttentionBlock(cfg.heads, cfg.groups, name=name)(x, context)

    x = nn.Conv(cfg.base_channels, (3, 3), name="conv_in")(x)
    skips = [x]
    for level in range(cfg.levels + 1):
      for i in range(cfg.blocks):
        x = ResBlock(cfg.level_channels(level), cfg.groups, name=f"down_{level}_res_{i}")(x, temb)
        if cfg.has_attention(level):
          x = attend(x, f"down_{level}_attn_{i}")
        skips.append(x)
      if level < cfg.levels:
        x = nn.Conv(x.shape[-1], (3, 3), strides=(2, 2), name=f"downsample_{level}")(x)
        skips.append(x)
    x = ResBlock(x.shape[-1], cfg.groups, name="mid_res_0")(x, temb)
    if cfg.attention:
      x = attend(x, "mid_attn")
    x = ResBlock(x.shape[-1], cfg.groups, name="mid_res_1")(x, temb)
    for level in reversed(range(cfg.levels + 1)):
      for i in range(cfg.blocks + 1):
        x = jnp.concatenate([x, skips.pop()], axis=-1)
        x = ResBlock(cfg.level_channels(level), cfg.groups, name=f"up_{level}_res_{i}")(x, temb)
        if cfg.has_attention(level):
          x = attend(x, f"up_{level}_attn_{i}")
      if level > 0:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        x = nn.Conv(x.shape[-1], (3, 3), name=f"upsample_{level}")(x)
    x = nn.swish(nn.GroupNorm(cfg.groups, name="norm_out")(x))
    return nn.Conv(cfg.channels, (3, 3), name="conv_out")(x)


def make(config: UNetConfig, seed: int = 0) -> training.Workload:
  """Builds the noise-prediction step.

  Batch: ``images`` and ``noise`` float32 [batch, s, s, channels] with
  ``s = image_size``, ``timesteps`` float32 [batch] in [0, 1), and with
  ``context_dim`` a ``context`` float32 [batch, context_len, context_dim]. The
  model sees ``sqrt(a) * images + sqrt(1 - a) * noise`` with the cosine
  schedule ``a = cos(pi t / 2)**2`` and the loss is the MSE between its output
  and ``noise``.
  """
  model = UNet(config)
  params_key, data_key = training.split_seed(seed)
  shape = (config.batch, config.image_size, config.image_size, config.channels)
  images_key, noise_key, time_key, context_key = jax.random.split(data_key, 4)
  batch = {
    "images": jax.random.normal(images_key, shape, jnp.float32),
    "noise": jax.random.normal(noise_key, shape, jnp.float32),
    "timesteps": jax.random.uniform(time_key, (config.batch,), jnp.float32),
  }
  if config.context_dim:
    batch["context"] = jax.random.normal(
      context_key, (config.batch, config.context_len, config.context_dim), jnp.float32
    )

  def noisy(batch):
    alpha = jnp.cos(0.5 * jnp.pi * batch["timesteps"])[:, None, None, None] ** 2
    images = jnp.sqrt(alpha) * batch["images"] + jnp.sqrt(1.0 - alpha) * batch["noise"]
    context = batch.get("context")
    return (
      training.cast_floating(images, config.dtype),
      batch["timesteps"],
      None if context is None else training.cast_floating(context, config.dtype),
    )

  def loss_fn(params, batch):
    predicted = model.apply({"params": training.cast_floating(params, config.dtype)}, *noisy(batch))
    return jnp.mean((training.widen(predicted) - batch["noise"]) ** 2)

  params = jax.jit(model.init)(params_key, *noisy(batch))["params"]
  return training.build_workload(
    training.spec_string("unet", config, PRESETS), loss_fn, params, batch
  )
