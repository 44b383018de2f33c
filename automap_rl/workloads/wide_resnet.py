"""Wide-ResNet image classifier in Flax linen with BatchNorm.

The bottleneck ResNet v1 of Flax's ImageNet example with a width factor on
the 3x3 convolutions (Zagoruyko & Komodakis 2016), as Alpa benchmarks it.
BatchNorm runs in training mode: the step updates the running statistics, so
the workload carries them as ``model_state = {"batch_stats": ...}`` next to
``params`` (Flax's two variable collections). Parameter paths:
``conv_init``, ``bn_init``, ``stage{i}_block{j}/{conv1,conv2,conv3,
conv_proj,bn1,bn2,bn3,bn_proj}``, ``head``.

Presets (``wresnet:size=1b``) are Alpa's Wide-ResNet table (Zheng et al.,
OSDI 2022, Table 4; alpa-projects/alpa benchmark/alpa/suite_wresnet.py):
ResNet-50 layout, 224x224 images, 1024 classes; float32 as in Alpa.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from automap_rl.workloads import training

# Depth -> bottleneck blocks per stage (He et al. 2016, Table 1; 14 and 26 are
# the same pattern with one and two blocks per stage).
STAGE_SIZES: dict[int, tuple[int, ...]] = {
  14: (1, 1, 1, 1),
  26: (2, 2, 2, 2),
  50: (3, 4, 6, 3),
  101: (3, 4, 23, 3),
  152: (3, 8, 36, 3),
}


@dataclasses.dataclass(frozen=True)
class WideResNetConfig:
  """Wide-ResNet size.

  Attributes:
    depth: a key of :data:`STAGE_SIZES`.
    width: filters of the first stage's 1x1 convolutions (64 in ResNet-50);
      every stage doubles them.
    width_factor: multiplier of the 3x3 convolutions' filters.
    image_size: input height and width.
    channels: input channels.
    classes: output classes.
    batch: images per batch.
    dtype: compute dtype (float32 parameters are cast to it in the step).
  """

  depth: int = 14
  width: int = 8
  width_factor: int = 2
  image_size: int = 32
  channels: int = 3
  classes: int = 10
  batch: int = 8
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)
    if self.depth not in STAGE_SIZES:
      raise ValueError(f"depth={self.depth} is not one of {', '.join(map(str, STAGE_SIZES))}")


_ALPA = {"depth": 50, "image_size": 224, "classes": 1024}
# Size label -> config fields (base channels and width factor from Alpa).
PRESETS: dict[str, dict[str, Any]] = {
  "250m": {"width": 160, "width_factor": 2, **_ALPA},
  "500m": {"width": 224, "width_factor": 2, **_ALPA},
  "1b": {"width": 320, "width_factor": 2, **_ALPA},
  "2b": {"width": 448, "width_factor": 2, **_ALPA},
  "4b": {"width": 640, "width_factor": 2, **_ALPA},
  "6.8b": {"width": 320, "width_factor": 16, **_ALPA},
  "13b": {"width": 320, "width_factor": 32, **_ALPA},
}


class Bottleneck(nn.Module):
  """1x1 -> 3x3 (strided, widened) -> 1x1 with BatchNorm and a (projected)
  shortcut: [b, h, w, c] -> [b, h / stride, w / stride, 4 * filters]."""

  filters: int
  width_factor: int
  stride: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, epsilon=1e-5)
    strides = (self.stride, self.stride)
    y = nn.relu(norm(name="bn1")(conv(self.filters, (1, 1), name="conv1")(x)))
    y = conv(self.filters * self.width_factor, (3, 3), strides, name="conv2")(y)
    y = nn.relu(norm(name="bn2")(y))
    y = conv(self.filters * 4, (1, 1), name="conv3")(y)
    y = norm(scale_init=nn.initializers.zeros, name="bn3")(y)
    if x.shape != y.shape:
      x = conv(self.filters * 4, (1, 1), strides, name="conv_proj")(x)
      x = norm(name="bn_proj")(x)
    return nn.relu(x + y)


class WideResNet(nn.Module):
  """images [b, s, s, c] -> logits [b, classes]."""

  config: WideResNetConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = nn.Conv(
      cfg.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, name="conv_init"
    )(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, name="bn_init")(x)
    x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
    for stage, blocks in enumerate(STAGE_SIZES[cfg.depth]):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = Bottleneck(
          cfg.width * 2**stage, cfg.width_factor, stride, name=f"stage{stage}_block{block}"
        )(x)
    return nn.Dense(cfg.classes, name="head")(x.mean(axis=(1, 2)))


def make(config: WideResNetConfig, seed: int = 0) -> training.Workload:
  """Builds the Wide-ResNet training step.

  Batch: ``images`` float32 [batch, image_size, image_size, channels],
  ``labels`` int32 [batch]; loss is softmax cross-entropy. The step is
  ``step(params, opt_state, model_state, batch)``.
  """
  model = WideResNet(config)
  params_key, data_key = training.split_seed(seed)
  images_key, labels_key = jax.random.split(data_key)
  size = config.image_size
  batch = {
    "images": jax.random.normal(
      images_key, (config.batch, size, size, config.channels), jnp.float32
    ),
    "labels": jax.random.randint(labels_key, (config.batch,), 0, config.classes, jnp.int32),
  }

  def loss_fn(params, model_state, batch):
    variables = {"params": training.cast_floating(params, config.dtype), **model_state}
    logits, updates = model.apply(
      variables, training.cast_floating(batch["images"], config.dtype), mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      training.widen(logits), batch["labels"]
    ).mean()
    return loss, jax.tree_util.tree_map(
      lambda new, old: new.astype(old.dtype), updates, model_state
    )

  variables = jax.jit(model.init)(params_key, batch["images"])
  model_state = {"batch_stats": variables["batch_stats"]}
  return training.build_workload(
    training.spec_string("wresnet", config, PRESETS),
    loss_fn,
    variables["params"],
    batch,
    model_state,
  )
