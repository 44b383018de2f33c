"""The ``jraph-gcn`` and ``jraph-gat`` families: ``jraph`` 0.0.6.dev0's
``jraph.GraphConvolution`` and ``jraph.GAT`` layers (with Haiku ``hk.Linear`` update and
attention functions, as in jraph's examples), node classification on one large graph."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import jraph

from automap_rl.workloads import training
from automap_rl.workloads.external.common import cross_entropy, random_ids


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
    "senders": random_ids(senders_key, (config.n_edge,), config.n_node),
    "receivers": random_ids(receivers_key, (config.n_edge,), config.n_node),
    "labels": random_ids(labels_key, (config.n_node,), config.classes),
  }
  params = net.init(params_key, batch)

  def loss_fn(params, batch):
    inputs = {**batch, "nodes": training.cast_floating(batch["nodes"], config.dtype)}
    logits = net.apply(training.cast_floating(params, config.dtype), inputs)
    return cross_entropy(logits, batch["labels"]).mean()

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
