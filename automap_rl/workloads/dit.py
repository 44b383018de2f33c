"""Diffusion Transformer (DiT) in Flax nnx, trained to predict the noise.

Peebles & Xie (2023, "Scalable Diffusion Models with Transformers"): a latent
image is cut into patches (a strided convolution) and given fixed 2-D sine-
cosine positions; the conditioning vector is a timestep embedding
(sinusoidal, then an MLP) plus a class-label embedding whose last row is the
null label of classifier-free guidance. Each block is a transformer block
with adaLN-Zero: one linear layer of the SiLU of the conditioning gives the
shift, scale and gate of the attention and of the MLP, zero-initialized so
that every block starts as the identity. A final adaptive LayerNorm and a
zero-initialized linear layer give each token its patch of the output, which
is put back together into an image. The blocks are stacked by ``nnx.vmap``
and run by ``nnx.scan``.

The step works on ``nnx.split``'s state: ``params`` is the model's
``nnx.State`` (paths ``patch_embed/{kernel,bias}/value``,
``time_embed/{fc1,fc2}/{kernel,bias}/value``, ``label_embed/embedding/value``,
``blocks/attn/{q,k,v,o}_proj/{kernel,bias}/value``,
``blocks/mlp/{fc1,fc2}/{kernel,bias}/value``,
``blocks/modulation/{kernel,bias}/value``,
``final/{modulation,proj}/{kernel,bias}/value``), every ``blocks`` leaf with a
leading ``[layers]`` axis.

Presets (``dit:size=xl-2``): DiT-S/2, B/2, L/2 and XL/2 (Peebles & Xie 2023,
Table 1; 33M, 130M, 458M and 675M parameters) on the 32x32x4 latents of
256x256 ImageNet images with 1000 classes and bfloat16 compute. The paper's
models also learn the variance of the reverse process (twice the output
channels); here the output is the predicted noise only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from automap_rl.workloads import training, unet

# Probability of the null label in a batch (the paper's classifier-free
# guidance dropout).
LABEL_DROPOUT = 0.1


@dataclasses.dataclass(frozen=True)
class DiTConfig:
  """DiT size.

  Attributes:
    layers: transformer blocks.
    d_model: token width; must be divisible by 4 (the 2-D positions).
    heads: attention heads; must divide ``d_model``.
    mlp_dim: MLP hidden width.
    patch: patch height and width; must divide ``image_size``.
    image_size: latent height and width.
    channels: latent channels.
    classes: class labels, not counting the null label.
    frequency_dim: width of the sinusoidal timestep embedding; must be even.
    batch: latents per batch.
    remat: rematerialize each block in the backward pass (``nnx.remat``).
    dtype: compute dtype (float32 parameters are cast to it in the step).
  """

  layers: int = 2
  d_model: int = 32
  heads: int = 4
  mlp_dim: int = 128
  patch: int = 2
  image_size: int = 32
  channels: int = 4
  classes: int = 10
  frequency_dim: int = 256
  batch: int = 8
  remat: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)
    if self.image_size % self.patch or self.d_model % self.heads or self.d_model % 4:
      raise ValueError(
        f"patch={self.patch} must divide image_size={self.image_size}, and "
        f"heads={self.heads} and 4 must divide d_model={self.d_model}"
      )
    if self.frequency_dim % 2:
      raise ValueError(f"frequency_dim={self.frequency_dim} must be even")

  @property
  def grid(self) -> int:
    """Patches per side."""
    return self.image_size // self.patch


_IMAGENET_256 = {"patch": 2, "image_size": 32, "channels": 4, "classes": 1000, "dtype": "bfloat16"}
# Size label -> config fields.
PRESETS: dict[str, dict[str, Any]] = {
  "s-2": {"layers": 12, "d_model": 384, "heads": 6, "mlp_dim": 1536, **_IMAGENET_256},
  "b-2": {"layers": 12, "d_model": 768, "heads": 12, "mlp_dim": 3072, **_IMAGENET_256},
  "l-2": {"layers": 24, "d_model": 1024, "heads": 16, "mlp_dim": 4096, **_IMAGENET_256},
  "xl-2": {"layers": 28, "d_model": 1152, "heads": 16, "mlp_dim": 4608, **_IMAGENET_256},
}


def positions_2d(grid: int, dim: int) -> jax.Array:
  """Fixed sine-cosine positions of a [grid, grid] patch grid, row-major:
  [grid * grid, dim], the first half encoding the row, the second the column."""
  quarter = dim // 4
  freqs = 1.0 / 10000.0 ** (jnp.arange(quarter, dtype=jnp.float32) / quarter)
  angles = jnp.arange(grid, dtype=jnp.float32)[:, None] * freqs  # [grid, dim / 4]
  axis = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [grid, dim / 2]
  rows = jnp.broadcast_to(axis[:, None], (grid, grid, dim // 2))
  columns = jnp.broadcast_to(axis[None, :], (grid, grid, dim // 2))
  return jnp.concatenate([rows, columns], axis=-1).reshape(grid * grid, dim)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
  """Adaptive affine map of tokens x [b, n, d] by shift, scale [b, d]."""
  return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nnx.Module):
  """Multi-head self-attention: x [b, n, d] -> [b, n, d]."""

  def __init__(self, config: DiTConfig, rngs: nnx.Rngs):
    d = config.d_model
    self.heads, self.head_dim = config.heads, d // config.heads
    self.q_proj = nnx.Linear(d, d, rngs=rngs)
    self.k_proj = nnx.Linear(d, d, rngs=rngs)
    self.v_proj = nnx.Linear(d, d, rngs=rngs)
    self.o_proj = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, n, d = x.shape
    q, k, v = (
      proj(x).reshape(b, n, self.heads, self.head_dim)
      for proj in (self.q_proj, self.k_proj, self.v_proj)
    )
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
    weights = jax.nn.softmax(training.widen(logits), axis=-1).astype(x.dtype)
    return self.o_proj(jnp.einsum("bhst,bthd->bshd", weights, v).reshape(b, n, d))


class MLP(nnx.Module):
  """gelu MLP: x [..., d] -> [..., d]."""

  def __init__(self, d_model: int, hidden: int, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(d_model, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(nnx.gelu(self.fc1(x)))


class TimeEmbedding(nnx.Module):
  """Sinusoidal embedding, then a SiLU MLP: timesteps t [b] in [0, 1) -> [b, d]."""

  def __init__(self, config: DiTConfig, rngs: nnx.Rngs):
    self.frequency_dim = config.frequency_dim
    self.fc1 = nnx.Linear(config.frequency_dim, config.d_model, rngs=rngs)
    self.fc2 = nnx.Linear(config.d_model, config.d_model, rngs=rngs)

  def __call__(self, t: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return self.fc2(
      nnx.silu(self.fc1(unet.timestep_embedding(t, self.frequency_dim).astype(dtype)))
    )


class Block(nnx.Module):
  """adaLN-Zero transformer block: tokens x [b, n, d], conditioning c [b, d]
  -> [b, n, d]."""

  def __init__(self, config: DiTConfig, rngs: nnx.Rngs):
    d = config.d_model
    self.norm1 = nnx.LayerNorm(d, epsilon=1e-6, use_bias=False, use_scale=False, rngs=rngs)
    self.attn = Attention(config, rngs)
    self.norm2 = nnx.LayerNorm(d, epsilon=1e-6, use_bias=False, use_scale=False, rngs=rngs)
    self.mlp = MLP(d, config.mlp_dim, rngs)
    self.modulation = nnx.Linear(d, 6 * d, kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

  def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
      self.modulation(nnx.silu(c)), 6, axis=-1
    )
    x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1))
    return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nnx.Module):
  """Adaptive LayerNorm and projection to patches: x [b, n, d], c [b, d] ->
  [b, n, patch * patch * channels]."""

  def __init__(self, config: DiTConfig, rngs: nnx.Rngs):
    d = config.d_model
    zeros = nnx.initializers.zeros_init()
    self.norm = nnx.LayerNorm(d, epsilon=1e-6, use_bias=False, use_scale=False, rngs=rngs)
    self.modulation = nnx.Linear(d, 2 * d, kernel_init=zeros, rngs=rngs)
    self.proj = nnx.Linear(d, config.patch**2 * config.channels, kernel_init=zeros, rngs=rngs)

  def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
    shift, scale = jnp.split(self.modulation(nnx.silu(c)), 2, axis=-1)
    return self.proj(modulate(self.norm(x), shift, scale))


class DiT(nnx.Module):
  """Noisy latents [b, s, s, c], timesteps [b] in [0, 1), labels int32 [b]
  -> predicted noise [b, s, s, c]."""

  def __init__(self, config: DiTConfig, rngs: nnx.Rngs):
    d, p = config.d_model, config.patch
    self.config = config
    self.patch_embed = nnx.Conv(
      config.channels, d, (p, p), strides=(p, p), padding="VALID", rngs=rngs
    )
    self.time_embed = TimeEmbedding(config, rngs)
    self.label_embed = nnx.Embed(config.classes + 1, d, rngs=rngs)

    @nnx.split_rngs(splits=config.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs: nnx.Rngs) -> Block:
      return Block(config, rngs)

    self.blocks = make_blocks(rngs)
    self.final = FinalLayer(config, rngs)

  def __call__(self, x: jax.Array, t: jax.Array, labels: jax.Array) -> jax.Array:
    cfg = self.config
    b, p, grid = x.shape[0], cfg.patch, cfg.grid
    tokens = self.patch_embed(x).reshape(b, grid * grid, cfg.d_model)
    tokens = tokens + positions_2d(grid, cfg.d_model).astype(x.dtype)
    # A plain lookup, not `self.label_embed(labels)`: nnx.Embed casts to its float32
    # default dtype, which would narrow the float64 numerics reference.
    c = self.time_embed(t, x.dtype) + jnp.take(self.label_embed.embedding[...], labels, axis=0)

    def run(tokens: jax.Array, block: Block, c: jax.Array) -> jax.Array:
      return block(tokens, c)

    run = nnx.scan(
      nnx.remat(run) if cfg.remat else run, in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry
    )
    out = self.final(run(tokens, self.blocks, c), c)  # [b, grid * grid, p * p * channels]
    out = out.reshape(b, grid, grid, p, p, cfg.channels).transpose(0, 1, 3, 2, 4, 5)
    return out.reshape(b, grid * p, grid * p, cfg.channels)


def make(config: DiTConfig, seed: int = 0) -> training.Workload:
  """Builds the noise-prediction step on the model's ``nnx.State``.

  Batch: ``latents`` and ``noise`` float32 [batch, s, s, channels] with
  ``s = image_size``, ``timesteps`` float32 [batch] in [0, 1), ``labels``
  int32 [batch] in [0, classes], the null label ``classes`` with probability
  ``LABEL_DROPOUT``. The model sees ``sqrt(a) * latents + sqrt(1 - a) *
  noise`` with the cosine schedule ``a = cos(pi t / 2)**2`` and the loss is
  the MSE between its output and ``noise``.
  """
  params_key, data_key = training.split_seed(seed)
  graphdef, params = nnx.split(DiT(config, nnx.Rngs(params=params_key)))
  shape = (config.batch, config.image_size, config.image_size, config.channels)
  latents_key, noise_key, time_key, labels_key, drop_key = jax.random.split(data_key, 5)
  labels = jax.random.randint(labels_key, (config.batch,), 0, config.classes, jnp.int32)
  dropped = jax.random.uniform(drop_key, (config.batch,)) < LABEL_DROPOUT
  batch = {
    "latents": jax.random.normal(latents_key, shape, jnp.float32),
    "noise": jax.random.normal(noise_key, shape, jnp.float32),
    "timesteps": jax.random.uniform(time_key, (config.batch,), jnp.float32),
    "labels": jnp.where(dropped, config.classes, labels),
  }

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, training.cast_floating(params, config.dtype))
    alpha = jnp.cos(0.5 * jnp.pi * batch["timesteps"])[:, None, None, None] ** 2
    latents = jnp.sqrt(alpha) * batch["latents"] + jnp.sqrt(1.0 - alpha) * batch["noise"]
    predicted = model(
      training.cast_floating(latents, config.dtype), batch["timesteps"], batch["labels"]
    )
    return jnp.mean((training.widen(predicted) - batch["noise"]) ** 2)

  return training.build_workload(
    training.spec_string("dit", config, PRESETS), loss_fn, params, batch
  )
