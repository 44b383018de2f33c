"""The ``hf-*`` families: Hugging Face ``transformers`` 4.57.6 Flax (linen) models,
``FlaxGPT2LMHeadModel``, ``FlaxBertForMaskedLM``, ``FlaxViTForImageClassification`` and
``FlaxBartForConditionalGeneration``, built from configs with random weights."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from automap_rl.workloads import training
from automap_rl.workloads.external.common import cross_entropy, random_ids


def _transformers() -> Any:
  """The ``transformers`` package, or a one-line error saying how to install it."""
  try:
    module = importlib.import_module("transformers")
  except ModuleNotFoundError:
    raise ValueError(
      "the hf-* workloads need transformers 4.x with its Flax models: pip install -e '.[external]'"
    ) from None
  if not hasattr(module, "FlaxGPT2LMHeadModel"):
    raise ValueError(
      f"transformers {module.__version__} has no Flax models (dropped in 5.0): "
      "pip install -e '.[external]' (it pins 4.57.6)"
    )
  return module


@dataclasses.dataclass(frozen=True)
class HFConfig:
  """The fields every ``transformers`` family has.

  Attributes:
    layers: transformer layers (an encoder-decoder has as many of each).
    d_model: residual width.
    heads: attention heads; must divide ``d_model``.
    batch: examples per batch.
    dtype: compute dtype (the model's ``dtype``; parameters stay float32).
  """

  layers: int = 2
  d_model: int = 64
  heads: int = 4
  batch: int = 8
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)
    if self.d_model % self.heads:
      raise ValueError(f"heads={self.heads} must divide d_model={self.d_model}")


def _hf_workload(
  name: str,
  config: HFConfig,
  presets: Mapping[str, Mapping[str, Any]],
  class_name: str,
  hf_config: Callable[[Any], Any],
  input_shape: tuple[int, ...],
  make_batch: Callable[[jax.Array], dict[str, jax.Array]],
  loss: Callable[[Any, Any, dict[str, jax.Array]], jax.Array],
  seed: int,
) -> training.Workload:
  """The training step of a ``transformers`` Flax model.

  Args:
    name: the family.
    config: its size; ``config.dtype`` is the model's compute dtype.
    presets: the family's presets, for the workload's name.
    class_name: the model class in ``transformers``, e.g. ``"FlaxGPT2LMHeadModel"``.
    hf_config: ``transformers`` module -> the model's ``PretrainedConfig``.
    input_shape: the inputs ``init_weights`` builds the parameters from.
    make_batch: data key -> the batch.
    loss: ``(model, params, batch) -> loss []``.
    seed: parameters and batch seed.

  The model is built with ``_do_init=False`` and its parameters (a nested dict, float32)
  by ``init_weights``, so that under ``jax.eval_shape`` nothing is allocated.
  """
  hf = _transformers()
  params_key, data_key = training.split_seed(seed)
  model = getattr(hf, class_name)(
    hf_config(hf), input_shape=input_shape, dtype=jnp.dtype(config.dtype), _do_init=False
  )
  params = model.init_weights(params_key, input_shape)
  return training.build_workload(
    training.spec_string(name, config, presets),
    lambda params, batch: loss(model, params, batch),
    params,
    make_batch(data_key),
  )


@dataclasses.dataclass(frozen=True)
class HFGPT2Config(HFConfig):
  """``FlaxGPT2LMHeadModel`` size (``transformers.GPT2Config``): :class:`HFConfig`'s fields and

  Attributes:
    seq: tokens per sequence (also ``n_positions``).
    vocab: vocabulary size (GPT-2's BPE: 50257).
  """

  seq: int = 32
  vocab: int = 128


_GPT2 = {"seq": 1024, "vocab": 50257, "dtype": "bfloat16"}
# GPT-2's four sizes (Radford et al. 2019, Table 2).
GPT2_PRESETS: dict[str, dict[str, Any]] = {
  "small": {"layers": 12, "d_model": 768, "heads": 12, **_GPT2},
  "medium": {"layers": 24, "d_model": 1024, "heads": 16, **_GPT2},
  "large": {"layers": 36, "d_model": 1280, "heads": 20, **_GPT2},
  "xl": {"layers": 48, "d_model": 1600, "heads": 25, **_GPT2},
}


def make_gpt2(config: HFGPT2Config, seed: int = 0) -> training.Workload:
  """GPT-2 language modelling.

  Batch: ``tokens`` int32 [batch, seq + 1]; the loss is next-token softmax
  cross-entropy of the logits [batch, seq, vocab].
  """

  def loss(model, params, batch):
    tokens = batch["tokens"]
    return cross_entropy(
      model(tokens[:, :-1], params=params, train=False).logits, tokens[:, 1:]
    ).mean()

  return _hf_workload(
    "hf-gpt2",
    config,
    GPT2_PRESETS,
    "FlaxGPT2LMHeadModel",
    lambda hf: hf.GPT2Config(
      vocab_size=config.vocab,
      n_positions=config.seq,
      n_embd=config.d_model,
      n_layer=config.layers,
      n_head=config.heads,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
    ),
    (1, config.seq),
    lambda key: {"tokens": random_ids(key, (config.batch, config.seq + 1), config.vocab)},
    loss,
    seed,
  )


@dataclasses.dataclass(frozen=True)
class HFBertConfig(HFConfig):
  """``FlaxBertForMaskedLM`` size (``transformers.BertConfig``): :class:`HFConfig`'s fields and

  Attributes:
    d_ff: feed-forward width (``intermediate_size``).
    seq: tokens per sequence (also ``max_position_embeddings``).
    vocab: vocabulary size (BERT's WordPiece: 30522).
  """

  d_ff: int = 128
  seq: int = 32
  vocab: int = 128


_BERT = {"seq": 512, "vocab": 30522, "dtype": "bfloat16"}
# BERT-Base and BERT-Large (Devlin et al. 2019, section 3).
BERT_PRESETS: dict[str, dict[str, Any]] = {
  "base": {"layers": 12, "d_model": 768, "heads": 12, "d_ff": 3072, **_BERT},
  "large": {"layers": 24, "d_model": 1024, "heads": 16, "d_ff": 4096, **_BERT},
}


def make_bert(config: HFBertConfig, seed: int = 0) -> training.Workload:
  """BERT masked language modelling.

  Batch: ``tokens`` and ``labels`` int32 [batch, seq], ``weights`` float32 [batch, seq]
  (1 at the 15% of positions whose token is predicted); the loss is the weighted mean
  softmax cross-entropy of the logits [batch, seq, vocab].
  """
  shape = (config.batch, config.seq)

  def make_batch(key):
    tokens_key, labels_key, mask_key = jax.random.split(key, 3)
    return {
      "tokens": random_ids(tokens_key, shape, config.vocab),
      "labels": random_ids(labels_key, shape, config.vocab),
      "weights": jax.random.bernoulli(mask_key, 0.15, shape).astype(jnp.float32),
    }

  def loss(model, params, batch):
    losses = cross_entropy(
      model(batch["tokens"], params=params, train=False).logits, batch["labels"]
    )
    return (losses * batch["weights"]).sum() / jnp.maximum(batch["weights"].sum(), 1.0)

  return _hf_workload(
    "hf-bert",
    config,
    BERT_PRESETS,
    "FlaxBertForMaskedLM",
    lambda hf: hf.BertConfig(
      vocab_size=config.vocab,
      hidden_size=config.d_model,
      num_hidden_layers=config.layers,
      num_attention_heads=config.heads,
      intermediate_size=config.d_ff,
      max_position_embeddings=config.seq,
      hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0,
    ),
    (1, config.seq),
    make_batch,
    loss,
    seed,
  )


@dataclasses.dataclass(frozen=True)
class HFViTConfig(HFConfig):
  """``FlaxViTForImageClassification`` size (``transformers.ViTConfig``): :class:`HFConfig`'s
  fields and

  Attributes:
    mlp_dim: MLP width (``intermediate_size``).
    patch: patch height and width; must divide ``image_size``.
    image_size: input height and width.
    classes: output classes.
  """

  mlp_dim: int = 128
  patch: int = 4
  image_size: int = 16
  classes: int = 10

  def __post_init__(self):
    super().__post_init__()
    if self.image_size % self.patch:
      raise ValueError(f"patch={self.patch} must divide image_size={self.image_size}")


_IMAGENET = {"image_size": 224, "classes": 1000, "dtype": "bfloat16"}
# ViT-B/16, L/16 and H/14 (Dosovitskiy et al. 2021, Table 1).
VIT_PRESETS: dict[str, dict[str, Any]] = {
  "b16": {"layers": 12, "d_model": 768, "heads": 12, "mlp_dim": 3072, "patch": 16, **_IMAGENET},
  "l16": {"layers": 24, "d_model": 1024, "heads": 16, "mlp_dim": 4096, "patch": 16, **_IMAGENET},
  "h14": {"layers": 32, "d_model": 1280, "heads": 16, "mlp_dim": 5120, "patch": 14, **_IMAGENET},
}


def make_vit(config: HFViTConfig, seed: int = 0) -> training.Workload:
  """ViT image classification.

  Batch: ``images`` float32 [batch, 3, image_size, image_size] (channels first, as
  ``transformers`` takes them), ``labels`` int32 [batch]; softmax cross-entropy.
  """
  size = config.image_size

  def make_batch(key):
    images_key, labels_key = jax.random.split(key)
    return {
      "images": jax.random.normal(images_key, (config.batch, 3, size, size), jnp.float32),
      "labels": random_ids(labels_key, (config.batch,), config.classes),
    }

  def loss(model, params, batch):
    return cross_entropy(
      model(batch["images"], params=params, train=False).logits, batch["labels"]
    ).mean()

  return _hf_workload(
    "hf-vit",
    config,
    VIT_PRESETS,
    "FlaxViTForImageClassification",
    lambda hf: hf.ViTConfig(
      image_size=size,
      patch_size=config.patch,
      num_channels=3,
      hidden_size=config.d_model,
      num_hidden_layers=config.layers,
      num_attention_heads=config.heads,
      intermediate_size=config.mlp_dim,
      hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0,
      num_labels=config.classes,
    ),
    (1, size, size, 3),
    make_batch,
    loss,
    seed,
  )


@dataclasses.dataclass(frozen=True)
class HFBartConfig(HFConfig):
  """``FlaxBartForConditionalGeneration`` size (``transformers.BartConfig``): :class:`HFConfig`'s
  fields (``layers`` encoder and as many decoder layers) and

  Attributes:
    d_ff: feed-forward width.
    source_len: encoder tokens per example.
    target_len: decoder tokens per example.
    vocab: vocabulary size (BART's BPE: 50265).
  """

  d_ff: int = 128
  source_len: int = 32
  target_len: int = 16
  vocab: int = 128


# BART-Base and BART-Large (Lewis et al. 2020, section 2.1) at the summarization
# lengths of CNN/DailyMail (1024 source tokens, targets cut to 128).
_BART = {"source_len": 1024, "target_len": 128, "vocab": 50265, "dtype": "bfloat16"}
BART_PRESETS: dict[str, dict[str, Any]] = {
  "base": {"layers": 6, "d_model": 768, "heads": 12, "d_ff": 3072, **_BART},
  "large": {"layers": 12, "d_model": 1024, "heads": 16, "d_ff": 4096, **_BART},
}


def make_bart(config: HFBartConfig, seed: int = 0) -> training.Workload:
  """BART sequence-to-sequence training with teacher forcing.

  Batch: ``inputs`` int32 [batch, source_len], ``targets`` int32 [batch,
  target_len + 1] (the decoder reads ``targets[:, :-1]`` and predicts
  ``targets[:, 1:]``); softmax cross-entropy of the logits [batch, target_len, vocab].
  """

  def make_batch(key):
    inputs_key, targets_key = jax.random.split(key)
    return {
      "inputs": random_ids(inputs_key, (config.batch, config.source_len), config.vocab),
      "targets": random_ids(targets_key, (config.batch, config.target_len + 1), config.vocab),
    }

  def loss(model, params, batch):
    targets = batch["targets"]
    logits = model(
      batch["inputs"], decoder_input_ids=targets[:, :-1], params=params, train=False
    ).logits
    return cross_entropy(logits, targets[:, 1:]).mean()

  return _hf_workload(
    "hf-bart",
    config,
    BART_PRESETS,
    "FlaxBartForConditionalGeneration",
    lambda hf: hf.BartConfig(
      vocab_size=config.vocab,
      d_model=config.d_model,
      encoder_layers=config.layers,
      decoder_layers=config.layers,
      encoder_attention_heads=config.heads,
      decoder_attention_heads=config.heads,
      encoder_ffn_dim=config.d_ff,
      decoder_ffn_dim=config.d_ff,
      max_position_embeddings=max(config.source_len, config.target_len),
      dropout=0.0,
      attention_dropout=0.0,
      activation_dropout=0.0,
    ),
    (1, config.source_len),
    make_batch,
    loss,
    seed,
  )
