"""Interaction Network (encode-process-decode) on ``jraph.GraphsTuple``.

The batch is ``batch`` graphs of ``n_node`` nodes and ``n_edge`` random
directed edges each, concatenated into one fixed-size graph: nodes
[batch * n_node, node_dim], edges [batch * n_edge, edge_dim], senders and
receivers int32 [batch * n_edge] (global node indices, never crossing graphs),
n_node and n_edge int32 [batch], targets [batch, target_dim].

Presets (``gnn:size=graphcast``) take the processor shapes of published
mesh GNNs, read out per graph as here: ``mgn`` is MeshGraphNets (Pfaff et al.
2021: latent 128, 15 message-passing steps) on meshes of about the
CylinderFlow size (2048 nodes, 12288 directed edges, rounded up);
``graphcast`` is GraphCast's processor (Lam et al. 2023: the 6-times refined
icosahedral multi-mesh of 40962 nodes and 327660 edges, latent 512, 16
steps) in bfloat16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import jraph

from automap_rl.workloads import training


@dataclasses.dataclass(frozen=True)
class GNNConfig:
  """Graph batch and network size.

  Attributes:
    n_node: nodes per graph.
    n_edge: edges per graph.
    node_dim: input node feature dimension.
    edge_dim: input edge feature dimension.
    latent: hidden width of every MLP.
    steps: message-passing steps.
    target_dim: per-graph regression target dimension.
    batch: graphs per batch.
    dtype: compute dtype (float32 parameters are cast to it in the step).
  """

  n_node: int = 32
  n_edge: int = 64
  node_dim: int = 16
  edge_dim: int = 16
  latent: int = 64
  steps: int = 3
  target_dim: int = 8
  batch: int = 16
  dtype: str = "float32"

  def __post_init__(self):
    training.check_dtype(self.dtype)


# Size label -> config fields; input features are mesh node positions (3) and
# edge displacements plus length (4).
PRESETS: dict[str, dict[str, Any]] = {
  "mgn": {
    "n_node": 2048,
    "n_edge": 12288,
    "node_dim": 3,
    "edge_dim": 4,
    "latent": 128,
    "steps": 15,
  },
  "graphcast": {
    "n_node": 40962,
    "n_edge": 327660,
    "node_dim": 3,
    "edge_dim": 4,
    "latent": 512,
    "steps": 16,
    "dtype": "bfloat16",
  },
}


def _concat_mlp(width: int, name: str) -> Callable[..., jax.Array]:
  """Two-layer relu MLP applied to its inputs concatenated on the last axis."""
  mlp = hk.nets.MLP([width, width], activate_final=True, name=name)
  return lambda *features: mlp(jnp.concatenate(features, axis=-1))


def network(graph: jraph.GraphsTuple, config: GNNConfig) -> jax.Array:
  """Per-graph predictions [n_graph, target_dim]."""
  nodes = hk.Linear(config.latent, name="node_encoder")(graph.nodes)
  edges = hk.Linear(config.latent, name="edge_encoder")(graph.edges)
  graph = graph._replace(nodes=nodes, edges=edges)
  for i in range(config.steps):
    update = jraph.InteractionNetwork(
      update_edge_fn=_concat_mlp(config.latent, f"edge_mlp_{i}"),
      update_node_fn=_concat_mlp(config.latent, f"node_mlp_{i}"),
    )(graph)
    graph = graph._replace(nodes=graph.nodes + update.nodes, edges=graph.edges + update.edges)
  n_graph = graph.n_node.shape[0]
  graph_index = jnp.repeat(
    jnp.arange(n_graph), graph.n_node, total_repeat_length=graph.nodes.shape[0]
  )
  pooled = jax.ops.segment_sum(graph.nodes, graph_index, n_graph)
  pooled = pooled / graph.n_node[:, None].astype(pooled.dtype)
  return hk.Linear(config.target_dim, name="decoder")(pooled)


def make_batch(config: GNNConfig, key: jax.Array) -> dict[str, jax.Array]:
  """Random graph batch of fixed size (see module docstring for shapes)."""
  node_key, edge_key, link_key, target_key = jax.random.split(key, 4)
  n_graph, total_edges = config.batch, config.batch * config.n_edge
  local = jax.random.randint(link_key, (2, total_edges), 0, config.n_node)
  offset = jnp.repeat(jnp.arange(n_graph) * config.n_node, config.n_edge)
  senders, receivers = (local + offset).astype(jnp.int32)
  return {
    "nodes": jax.random.normal(node_key, (n_graph * config.n_node, config.node_dim), jnp.float32),
    "edges": jax.random.normal(edge_key, (total_edges, config.edge_dim), jnp.float32),
    "senders": senders,
    "receivers": receivers,
    "n_node": jnp.full((n_graph,), config.n_node, jnp.int32),
    "n_edge": jnp.full((n_graph,), config.n_edge, jnp.int32),
    "targets": jax.random.normal(target_key, (n_graph, config.target_dim), jnp.float32),
  }


def _graph(batch: dict[str, jax.Array]) -> jraph.GraphsTuple:
  return jraph.GraphsTuple(
    nodes=batch["nodes"],
    edges=batch["edges"],
    senders=batch["senders"],
    receivers=batch["receivers"],
    n_node=batch["n_node"],
    n_edge=batch["n_edge"],
    globals=None,
  )


def make(config: GNNConfig, seed: int = 0) -> training.Workload:
  """Builds the GNN training step; loss is per-graph MSE on ``targets``."""
  net = hk.without_apply_rng(hk.transform(lambda graph: network(graph, config)))
  params_key, data_key = training.split_seed(seed)
  batch = make_batch(config, data_key)

  def loss_fn(params, batch):
    graph = _graph(batch)
    graph = graph._replace(
      nodes=training.cast_floating(graph.nodes, config.dtype),
      edges=training.cast_floating(graph.edges, config.dtype),
    )
    predictions = net.apply(training.cast_floating(params, config.dtype), graph)
    return jnp.mean((training.widen(predictions) - batch["targets"]) ** 2)

  params = jax.jit(net.init)(params_key, _graph(batch))
  return training.build_workload(
    training.spec_string("gnn", config, PRESETS), loss_fn, params, batch
  )
