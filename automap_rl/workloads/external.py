"""Training steps around models that other people wrote: the ``external`` split.

Each family here wraps one whole model that ships inside a package from the package
index, built from a config with random weights (nothing is downloaded), into the zoo's
AdamW training step (:func:`automap_rl.workloads.training.build_workload`). The model
code is the package's own; this module only builds it, feeds it a random batch and
puts a loss on its output. Versions are those ``pyproject.toml`` pins (the
``external`` extra for ``transformers``):

* ``hf-gpt2``, ``hf-bert``, ``hf-vit``, ``hf-bart``: Hugging Face ``transformers``
  4.57.6, its Flax (linen) models ``FlaxGPT2LMHeadModel``, ``FlaxBertForMaskedLM``,
  ``FlaxViTForImageClassification`` and ``FlaxBartForConditionalGeneration``
  (``transformers`` 5 dropped Flax; its Flax T5 calls ``jnp.clip(a_max=...)``, which
  JAX 0.10 no longer takes, so T5 is left out). Dropout is off (``train=False``); the
  weights get gradients all the same.
* ``hk-resnet``: ``dm-haiku`` 0.0.17, ``hk.nets.ResNet`` in its ResNet-18 to 200
  configurations (``hk.nets.ResNet.CONFIGS``), with batch-norm statistics as state.
* ``jraph-gcn``, ``jraph-gat``: ``jraph`` 0.0.6.dev0, ``jraph.GraphConvolution``
  (Kipf and Welling 2017) and ``jraph.GAT`` (Velickovic et al. 2018) layers, node
  classification on one large graph; the layers' update and attention functions are
  Haiku ``hk.Linear`` as in jraph's examples.
* ``eqx-mlp``: ``equinox`` 0.13.8, ``eqx.nn.MLP``.

Spec strings as the zoo's: ``hf-gpt2:size=medium,batch=32``. The ``transformers``
families need the ``external`` extra (``pip install -e '.[external]'``); the others use
packages the project depends on anyway.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import jraph
import optax

from automap_rl.workloads import training

# --- Hugging Face transformers (Flax) ------------------------------------------------


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


def _tokens(key: jax.Array, shape: tuple[int, ...], vocab: int) -> jax.Array:
  """Random token ids, int32 ``shape``."""
  return jax.random.randint(key, shape, 0, vocab, jnp.int32)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Softmax cross-entropy of ``logits`` [..., classes] against int ``labels`` [...],
  in at least float32, per position [...]."""
  return optax.softmax_cross_entropy_with_integer_labels(training.widen(logits), labels)


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
    return _cross_entropy(
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
    lambda key: {"tokens": _tokens(key, (config.batch, config.seq + 1), config.vocab)},
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
      "tokens": _tokens(tokens_key, shape, config.vocab),
      "labels": _tokens(labels_key, shape, config.vocab),
      "weights": jax.random.bernoulli(mask_key, 0.15, shape).astype(jnp.float32),
    }

  def loss(model, params, batch):
    losses = _cross_entropy(
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
      "labels": _tokens(labels_key, (config.batch,), config.classes),
    }

  def loss(model, params, batch):
    return _cross_entropy(
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
      "inputs": _tokens(inputs_key, (config.batch, config.source_len), config.vocab),
      "targets": _tokens(targets_key, (config.batch, config.target_len + 1), config.vocab),
    }

  def loss(model, params, batch):
    targets = batch["targets"]
    logits = model(
      batch["inputs"], decoder_input_ids=targets[:, :-1], params=params, train=False
    ).logits
    return _cross_entropy(logits, targets[:, 1:]).mean()

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


# --- dm-haiku ---------------------------------------------------------------------


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
    "labels": _tokens(labels_key, (config.batch,), config.classes),
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
    loss = _cross_entropy(logits, batch["labels"]).mean()
    return loss, state

  return training.build_workload(
    training.spec_string("hk-resnet", config, RESNET_PRESETS),
    loss_fn,
    params,
    batch,
    model_state=state,
  )


# --- jraph ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GCNConfig:
  """A GCN node classifier on one graph: jraph layers of ``hidden`` features.

  Attributes:
    n_node: nodes of the graph.
    n_edge: directed edges (random senders and receivers).
    features: input features per node.
    hidden: features per node between layers.
    layers: graph layers; a linear read-out follows the last.
    classes: node classes.
    dtype: compute dtype (parameters stay float32).
  """

  n_node: int = 64
  n_edge: int = 256
  features: int = 16
  hidden: int = 16
  layers: int = 2
  classes: int = 8
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class GATConfig(GCNConfig):
  """A GAT node classifier: :class:`GCNConfig`'s fields, ``hidden`` per head.

  Attributes:
    heads: attention heads.
  """

  heads: int = 2


# Open Graph Benchmark node-property graphs (Hu et al. 2020): ogbn-arxiv and
# ogbn-products, node and edge counts rounded up to multiples of 64.
_ARXIV = {"n_node": 169344, "n_edge": 1166336, "features": 128, "classes": 40, "dtype": "bfloat16"}
_PRODUCTS = {
  "n_node": 2449408,
  "n_edge": 61859200,
  "features": 100,
  "classes": 47,
  "dtype": "bfloat16",
}
GCN_PRESETS: dict[str, dict[str, Any]] = {
  "arxiv": {**_ARXIV, "hidden": 256, "layers": 3},
  "products": {**_PRODUCTS, "hidden": 256, "layers": 3},
}
# GAT as in OGB's leaderboards: 3 layers of 3 heads x 256 on arxiv, 4 heads x 128 on products.
GAT_PRESETS: dict[str, dict[str, Any]] = {
  "arxiv": {**_ARXIV, "hidden": 256, "heads": 3, "layers": 3},
  "products": {**_PRODUCTS, "hidden": 128, "heads": 4, "layers": 3},
}


def _gcn_layer(config: GCNConfig, width: int) -> Callable[[jraph.GraphsTuple], jraph.GraphsTuple]:
  """``jraph.GraphConvolution`` with self edges and symmetric normalization:
  nodes [n_node, *] -> [n_node, width]."""
  return jraph.GraphConvolution(hk.Linear(width), add_self_edges=True)


def _gat_layer(config: GATConfig, width: int) -> Callable[[jraph.GraphsTuple], jraph.GraphsTuple]:
  """``jraph.GAT`` with ``config.heads`` heads of ``width`` features, one logit per
  head from the sender's and receiver's features: nodes [n_node, *] ->
  [n_node, heads * width]."""
  heads = config.heads

  def query(nodes: jax.Array) -> jax.Array:  # [n, *] -> [n, heads, width]
    return hk.Linear(heads * width)(nodes).reshape(nodes.shape[0], heads, width)

  def logit(sent: jax.Array, received: jax.Array, edges: Any) -> jax.Array:  # -> [e, heads, 1]
    return jax.nn.leaky_relu(hk.Linear(1)(jnp.concatenate([sent, received], axis=-1)), 0.2)

  def update(nodes: jax.Array) -> jax.Array:  # [n, heads, width] -> [n, heads * width]
    return nodes.reshape(nodes.shape[0], heads * width)

  return jraph.GAT(query, logit, update)


def _make_graph(
  config: GCNConfig,
  name: str,
  presets: Mapping[str, Mapping[str, Any]],
  layer: Callable[[Any, int], Callable[[jraph.GraphsTuple], jraph.GraphsTuple]],
  seed: int,
) -> training.Workload:
  """The node-classification step of a stack of ``layer``s (relu between them).

  Batch: ``nodes`` float32 [n_node, features], ``senders`` and ``receivers`` int32
  [n_edge], ``labels`` int32 [n_node]; softmax cross-entropy over every node.
  """

  def forward(batch: Mapping[str, jax.Array]) -> jax.Array:
    graph = jraph.GraphsTuple(
      nodes=batch["nodes"],
      edges=None,
      senders=batch["senders"],
      receivers=batch["receivers"],
      n_node=jnp.array([config.n_node]),
      n_edge=jnp.array([config.n_edge]),
      globals=None,
    )
    for i in range(config.layers):
      graph = layer(config, config.hidden)(graph)
      graph = graph._replace(
        nodes=jax.nn.relu(graph.nodes) if i < config.layers - 1 else graph.nodes
      )
    return hk.Linear(config.classes)(graph.nodes)

  net = hk.without_apply_rng(hk.transform(forward))
  params_key, data_key = training.split_seed(seed)
  nodes_key, senders_key, receivers_key, labels_key = jax.random.split(data_key, 4)
  batch = {
    "nodes": jax.random.normal(nodes_key, (config.n_node, config.features), jnp.float32),
    "senders": _tokens(senders_key, (config.n_edge,), config.n_node),
    "receivers": _tokens(receivers_key, (config.n_edge,), config.n_node),
    "labels": _tokens(labels_key, (config.n_node,), config.classes),
  }
  params = net.init(params_key, batch)

  def loss_fn(params, batch):
    inputs = {**batch, "nodes": training.cast_floating(batch["nodes"], config.dtype)}
    logits = net.apply(training.cast_floating(params, config.dtype), inputs)
    return _cross_entropy(logits, batch["labels"]).mean()

  return training.build_workload(
    training.spec_string(name, config, presets), loss_fn, params, batch
  )


def make_gcn(config: GCNConfig, seed: int = 0) -> training.Workload:
  """A GCN node classifier (``jraph.GraphConvolution`` layers); batch as
  :func:`_make_graph`."""
  return _make_graph(config, "jraph-gcn", GCN_PRESETS, _gcn_layer, seed)


def make_gat(config: GATConfig, seed: int = 0) -> training.Workload:
  """A GAT node classifier (``jraph.GAT`` layers); batch as :func:`_make_graph`."""
  return _make_graph(config, "jraph-gat", GAT_PRESETS, _gat_layer, seed)


# --- equinox ----------------------------------------------------------------------


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
    "labels": _tokens(labels_key, (config.batch,), config.classes),
  }

  def loss_fn(params, batch):
    mlp = eqx.combine(training.cast_floating(params, config.dtype), static)
    logits = jax.vmap(mlp)(training.cast_floating(batch["inputs"], config.dtype))
    return _cross_entropy(logits, batch["labels"]).mean()

  return training.build_workload(
    training.spec_string("eqx-mlp", config, MLP_PRESETS), loss_fn, params, batch
  )


# --- the registry -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
  """An external family: its step builder, config class, presets and source.

  Attributes:
    make: ``make(config, seed) -> Workload``.
    config: the frozen config dataclass.
    presets: size label -> config fields.
    source: the package, its version and the model it ships.

  Every config's defaults are a reduced-size copy of its presets' structure: its arrays
  build, compile and run in seconds on CPU.
  """

  make: Callable[[Any, int], training.Workload]
  config: type
  presets: Mapping[str, Mapping[str, Any]]
  source: str


FAMILIES: dict[str, Family] = {
  "hf-gpt2": Family(
    make_gpt2, HFGPT2Config, GPT2_PRESETS, "transformers 4.57.6: FlaxGPT2LMHeadModel"
  ),
  "hf-bert": Family(
    make_bert, HFBertConfig, BERT_PRESETS, "transformers 4.57.6: FlaxBertForMaskedLM"
  ),
  "hf-vit": Family(
    make_vit, HFViTConfig, VIT_PRESETS, "transformers 4.57.6: FlaxViTForImageClassification"
  ),
  "hf-bart": Family(
    make_bart, HFBartConfig, BART_PRESETS, "transformers 4.57.6: FlaxBartForConditionalGeneration"
  ),
  "hk-resnet": Family(
    make_resnet, HKResNetConfig, RESNET_PRESETS, "dm-haiku 0.0.17: hk.nets.ResNet"
  ),
  "jraph-gcn": Family(make_gcn, GCNConfig, GCN_PRESETS, "jraph 0.0.6.dev0: jraph.GraphConvolution"),
  "jraph-gat": Family(make_gat, GATConfig, GAT_PRESETS, "jraph 0.0.6.dev0: jraph.GAT"),
  "eqx-mlp": Family(make_mlp, EqxMLPConfig, MLP_PRESETS, "equinox 0.13.8: eqx.nn.MLP"),
}
