"""The ``hk-resnet`` family: ``dm-haiku`` 0.0.17's ``hk.nets.ResNet`` in its ResNet-18 to
200 configurations, with batch-norm statistics as state."""

from __future__ import annotations

import dataclasses
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from automap_rl.workloads import training
from automap_rl.workloads.external.common import cross_entropy, random_ids


@dataclasses.dataclass(frozen=True)
class HKResNetConfig:
  """``hk.nets.ResNet`` size: one of its ``CONFIGS`` with every group's channels scaled.

  Attributes:
    depth: 18, 34, 50, 101, 152 or 200 (``hk.nets.ResNet.CONFIGS``).
    width: the stem's channels and the first group's before bottleneck expansion (64
      as published; the other groups' are scaled with it).
    image_size: input height and width.
    classes: output classes.
    batch: images per batch.
    dtype: compute dtype (parameters and batch-norm statistics stay float32).
  """

  depth: int = 50
  width: int = 8
  image_size: int = 16
  classes: int = 10
  batch: int = 8
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)
    if self.depth not in hk.nets.ResNet.CONFIGS:
      raise ValueError(
        f"depth={self.depth} is not one of {', '.join(map(str, hk.nets.ResNet.CONFIGS))}"
      )


_RESNET = {"width": 64, "image_size": 224, "classes": 1000, "dtype": "bfloat16"}
# ResNet-50, 101 and 152 on ImageNet (He et al. 2016, Table 1).
RESNET_PRESETS: dict[str, dict[str, Any]] = {
  "50": {"depth": 50, **_RESNET},
  "101": {"depth": 101, **_RESNET},
  "152": {"depth": 152, **_RESNET},
}


def make_resnet(config: HKResNetConfig, seed: int = 0) -> training.Workload:
  """ResNet image classification, batch-norm statistics updated by the step.

  Batch: ``images`` float32 [batch, image_size, image_size, 3] (channels last, as
  Haiku takes them), ``labels`` int32 [batch]; softmax cross-entropy.
  """
  shape = dict(hk.nets.ResNet.CONFIGS[config.depth])
  shape["channels_per_group"] = tuple(c * config.width // 64 for c in shape["channels_per_group"])

  def forward(images: jax.Array, is_training: bool) -> jax.Array:
    return hk.nets.ResNet(
      num_classes=config.classes, initial_conv_config={"output_channels": config.width}, **shape
    )(images, is_training=is_training)

  net = hk.transform_with_state(forward)
  params_key, data_key = training.split_seed(seed)
  images_key, labels_key = jax.random.split(data_key)
  size = config.image_size
  batch = {
    "images": jax.random.normal(images_key, (config.batch, size, size, 3), jnp.float32),
    "labels": random_ids(labels_key, (config.batch,), config.classes),
  }
  params, state = net.init(params_key, batch["images"], is_training=True)

  def loss_fn(params, state, batch):
    logits, state = net.apply(
      training.cast_floating(params, config.dtype),
      state,
      None,
      training.cast_floating(batch["images"], config.dtype),
      is_training=True,
    )
    loss = cross_entropy(logits, batch["labels"]).mean()
    return loss, state

  return training.build_workload(
    training.spec_string("hk-resnet", config, RESNET_PRESETS),
    loss_fn,
    params,
    batch,
    model_state=state,
  )
