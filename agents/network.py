"""The policy/value network: a graph network that encodes a program once and a cheap head per state.

The observation (`envs.observe`) mixes columns that never change during an episode (what
the program is: sizes, roles, op kinds, coverage; the mesh) with columns that follow the
decisions (which axes shard each node, reduction factors sharded, legal actions, the
objective). `observation` splits it in two:

* `static_graph` -> `encode(params, graph) -> Embeddings`: `rounds` rounds of message
  passing over the whole graph, run once per episode (or per search root);
* `StateFeatures` -> `head(params, embeddings, features) -> (logits [A], value [])`: a
  narrow state vector per node (one layer over the 4 state features of each (node, axis),
  biased by projections of the node's and the axis's embeddings that `encode` caches,
  averaged over the real axes); each target combines its embedding, its own state vector
  and the mean of those of the signatures it covers (one [T, N] x [N, Hs] product); small
  MLPs over the T targets and a pooled summary give a logit per (target, axis), the stop
  logit and the value. Nothing of width H runs over all N nodes per state.

Parameters depend on no size: not on the number of nodes, edges or targets (messages are
degree-normalised segment sums, pooling is a mean over real nodes), and not even on the
number of mesh axes (each axis is embedded from its size and bandwidth, per-axis node
features go through one shared layer and are averaged over the real axes, and the logit of
`(target, axis)` comes from one shared layer). Padded nodes (`real` column 0) and padded
edges (self-loops on the padding node) never reach a real node, so bucket-padded tables
give a program's logits and value up to float reassociation.

Flax linen rather than Haiku: Haiku is in maintenance mode, linen's `apply(..., method=)`
gives the encode/head split over one parameter tree, and its parameters are plain nested
dicts that optax and orbax take as they are.

Policy: one logit per action (`target * X + axis`, then the P pipeline options, then stop),
`MASKED_LOGIT` where the action is illegal. With pipeline options (`EnvConfig.pipelines`,
`NetworkConfig.pipelines`) the observation's pipeline columns (each node's stage position,
the chosen pipeline's S and M) are state features, and each option's logit comes from its
S, M and stage axis (that axis's embedding) beside the state's summary; the parameters are
the same with and without options, so one policy reads either environment. Value: the expected sum
of the search's future rewards, each the
decrease of the log objective (`agents.gumbel.log_reward`), i.e. `log(objective now /
objective of the final plan)`: size-free (a ratio), negative when continuing makes the
plan worse. Being in the rewards' units, `reward + value` is a consistent Q-value inside a
search, and with the exactly known `log(best expert / objective now)` it gives the
training return `log(best expert / final plan)` (`agents.selfplay`).
"""

from __future__ import annotations

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph

from envs.core import State
from envs.observe import global_features, node_features, observe
from envs.pipelines import PipelineOptions
from envs.tables import EnvTables

MASKED_LOGIT = -1e9  # Logit of an illegal action.
DYNAMIC_GLOBALS = (
  4  # Last global columns that follow the state: objective, capacity used, time, memory.
)
PIPELINE_GLOBALS = (
  3  # With pipeline options, after those: a pipeline is chosen, its log2 S / 4, log2 M / 8.
)
OPTION_FEATURES = 4  # Per pipeline option: real, pipelines, log2 S / 4, log2 M / 8.


@chex.dataclass(frozen=True)
class StateFeatures:
  """What the head reads of one state (N nodes, X axes, P pipeline options, A actions).

  Attributes:
    axes: per node and axis, (sharded on the axis, reduction sharded on it for ops / the
      action is legal for targets), f32 [N, X, 2].
    shards: per node, log shard count / log device count, f32 [N].
    stage: per node, its mean stage position under the chosen pipeline (0 without one), f32 [N].
    globals: objective, capacity used, step time and peak memory relative to the
      replicated plan, then a pipeline is chosen, its log2 S / 4 and log2 M / 8 (0 without
      pipeline options), f32 [7].
    options: per pipeline option: real, pipelines (not "no pipeline"), log2 S / 4,
      log2 M / 8, f32 [P, 4] (P = 0 without options).
    option_axis: each option's stage axis (-1: none), int32 [P].
    legal: the legal action mask, bool [A].
  """

  axes: jax.Array
  shards: jax.Array
  stage: jax.Array
  globals: jax.Array
  options: jax.Array
  option_axis: jax.Array
  legal: jax.Array


@chex.dataclass(frozen=True)
class Embeddings:
  """The encoder's output for one program (H = width, E edges).

  Attributes:
    nodes: node embeddings, f32 [N, H].
    graph: mean of the real nodes' embeddings, f32 [H].
    axes: mesh axis embeddings, f32 [X, H]; axis_valid: real axes, bool [X].
    real: real nodes, f32 [N]; targets: real target nodes, f32 [N].
    node_bias, axis_bias: each node's and each axis's term in the head's per-(node, axis)
      state layer, f32 [N, Hs] and [X, Hs] (Hs = `NetworkConfig.state_width`).
    senders, receivers: the edges, int32 [E].
    cover: per edge, its weight in the mean over the signatures its target covers (0 for
      edges that are not coverage edges), f32 [E].
  """

  nodes: jax.Array
  graph: jax.Array
  axes: jax.Array
  axis_valid: jax.Array
  real: jax.Array
  targets: jax.Array
  node_bias: jax.Array
  axis_bias: jax.Array
  senders: jax.Array
  receivers: jax.Array
  cover: jax.Array


def split(
  graph: jraph.GraphsTuple, legal: jax.Array, num_axes: int, options: PipelineOptions | None = None
) -> tuple[jraph.GraphsTuple, StateFeatures]:
  """Splits an observation (`envs.observe`, one graph) into its static graph and its state features.

  The static graph keeps the node columns before the per-axis ones, every edge, and the
  mesh's global features [1, 2X + 2]; the rest is `StateFeatures`. `options`: the
  environment's pipeline options (`EnvTables.pipeline`), whose observation has the
  pipeline columns; None without.
  """
  x, piped = num_axes, options is not None
  static_columns = node_features(x) - (2 * x + 1)
  nodes = graph.nodes
  chex.assert_shape(nodes, (None, node_features(x, piped)))
  num_globals = global_features(x) - DYNAMIC_GLOBALS
  if piped:
    stage, dynamic = nodes[:, -1], graph.globals[0, num_globals:]
    option_features = jnp.stack(
      [
        options.valid,
        options.axis >= 0,
        jnp.log2(options.stages) / 4.0,
        jnp.log2(options.microbatches) / 8.0,
      ],
      axis=1,
    ).astype(jnp.float32)
    option_axis = options.axis
  else:
    stage = jnp.zeros(nodes.shape[0], jnp.float32)
    dynamic = jnp.concatenate(
      [graph.globals[0, num_globals:], jnp.zeros(PIPELINE_GLOBALS, jnp.float32)]
    )
    option_features, option_axis = (
      jnp.zeros((0, OPTION_FEATURES), jnp.float32),
      jnp.zeros(0, jnp.int32),
    )
  per_axis = nodes[:, static_columns : static_columns + 2 * x + 1]
  features = StateFeatures(
    axes=jnp.stack([per_axis[:, :x], per_axis[:, x : 2 * x]], axis=-1),
    shards=per_axis[:, -1],
    stage=stage,
    globals=dynamic,
    options=option_features,
    option_axis=option_axis,
    legal=legal,
  )
  return graph._replace(
    nodes=nodes[:, :static_columns], globals=graph.globals[:, :num_globals]
  ), features


def observation(tables: EnvTables, state: State) -> tuple[jraph.GraphsTuple, StateFeatures]:
  """The static graph and the state features of `state` (unbatched; `jax.vmap` it). Pure.

  Under `jit`, a caller that uses only one half computes only that half (the other's
  columns are dead code)."""
  return split(observe(tables, state), state.legal_action_mask, tables.num_axes, tables.pipeline)


def static_graph(tables: EnvTables, state: State) -> jraph.GraphsTuple:
  """The encoder's input: the same for every state of an episode."""
  return observation(tables, state)[0]


def state_features(tables: EnvTables, state: State) -> StateFeatures:
  """The head's input for `state`."""
  return observation(tables, state)[1]


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
  """Sizes of the network.

  Attributes:
    width: H, the width of every embedding and hidden layer.
    rounds: message-passing rounds of the encoder.
    state_width: Hs, the width of the head's per-(node, axis) state layer.
    output_scale: initial scale of the logit and value layers (small: a near-uniform prior
      and a near-zero value before training).
    pipelines: P, the pipeline options of the environment the network reads and acts in
      (`EnvConfig.pipelines`; 0: none). The observation and the actions depend on it, the
      parameters do not; the agents that load a policy offer as many.
  """

  width: int = 64
  rounds: int = 4
  state_width: int = 32
  output_scale: float = 0.01
  pipelines: int = 0


def _mean(x: jax.Array, weights: jax.Array) -> jax.Array:
  """Weighted mean over the leading axis: x [N, ...], weights [N] -> [...]."""
  w = weights.reshape(weights.shape + (1,) * (x.ndim - 1))
  return (x * w).sum(axis=0) / jnp.maximum(weights.sum(), 1.0)


def _aggregate(messages: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """Degree-normalised segment sum of per-edge messages [E, H] into nodes [N, H]."""
  return jax.ops.segment_sum(messages, index, num_segments=inverse.shape[0]) * inverse[:, None]


class _Round(nn.Module):
  """One encoder round: messages both ways along every edge, a global mean, a residual MLP."""

  width: int

  @nn.compact
  def __call__(
    self,
    h: jax.Array,
    edges: jax.Array,
    senders: jax.Array,
    receivers: jax.Array,
    inverse_in: jax.Array,
    inverse_out: jax.Array,
    real: jax.Array,
  ) -> jax.Array:
    forward = nn.relu(nn.Dense(self.width)(h)[senders] + nn.Dense(self.width)(edges))
    backward = nn.relu(nn.Dense(self.width)(h)[receivers] + nn.Dense(self.width)(edges))
    context = jnp.broadcast_to(_mean(h, real), h.shape)
    inputs = jnp.concatenate(
      [
        h,
        _aggregate(forward, receivers, inverse_in),
        _aggregate(backward, senders, inverse_out),
        context,
      ],
      axis=1,
    )
    update = nn.Dense(self.width)(nn.gelu(nn.Dense(self.width)(inputs)))
    return nn.LayerNorm()(h + update)


class PolicyValueNet(nn.Module):
  """The network (see the module docstring); `encode` and `head` share one parameter tree."""

  config: NetworkConfig

  def setup(self):
    h = self.config.width
    out = nn.initializers.variance_scaling(self.config.output_scale, "fan_in", "truncated_normal")
    self.axis_in = nn.Dense(h)
    self.axis_out = nn.Dense(h)
    self.node_in = nn.Dense(h)
    self.node_norm = nn.LayerNorm()
    self.rounds = [_Round(h) for _ in range(self.config.rounds)]
    self.state_axes = nn.Dense(self.config.state_width)
    self.state_nodes = nn.Dense(self.config.state_width)
    self.state_mesh = nn.Dense(self.config.state_width, use_bias=False)
    self.target_update = nn.Dense(h)
    self.target_norm = nn.LayerNorm()
    self.move_target = nn.Dense(h)
    self.move_axis = nn.Dense(h)
    self.move_logit = nn.Dense(1, kernel_init=out)
    self.summary = nn.Dense(h)
    self.option_in = nn.Dense(h)
    self.option_summary = nn.Dense(h, use_bias=False)
    self.option_logit = nn.Dense(1, kernel_init=out)
    self.stop_logit = nn.Dense(1, kernel_init=out)
    self.value = nn.Dense(1, kernel_init=out)

  def encode(self, graph: jraph.GraphsTuple) -> Embeddings:
    """Embeds one program from its static graph (`static_graph`): nodes [N, S], edges
    [E, 4], globals [1, 2X + 2] (log2 axis sizes / 4 [X], link bandwidths [X], devices, HBM)."""
    chex.assert_rank([graph.nodes, graph.edges, graph.globals], 2)
    nodes, senders, receivers = graph.nodes, graph.senders, graph.receivers
    n = nodes.shape[0]
    x = (graph.globals.shape[1] - 2) // 2
    axis_features = jnp.stack([graph.globals[0, :x], graph.globals[0, x : 2 * x]], axis=1)  # [X, 2]
    axis_valid = axis_features[:, 0] > 0  # Padded axes have size 1.
    axes = self.axis_out(nn.gelu(self.axis_in(axis_features)))  # [X, H]
    mesh = jnp.concatenate([_mean(axes, axis_valid.astype(jnp.float32)), graph.globals[0, 2 * x :]])
    ones = jnp.ones(senders.shape, jnp.float32)
    in_degree = jax.ops.segment_sum(ones, receivers, num_segments=n)
    out_degree = jax.ops.segment_sum(ones, senders, num_segments=n)
    degrees = jnp.stack([jnp.log1p(in_degree), jnp.log1p(out_degree)], axis=1) / 4.0
    inputs = jnp.concatenate([nodes, degrees, jnp.broadcast_to(mesh, (n, mesh.shape[0]))], axis=1)
    real = nodes[:, 0]
    inverse_in, inverse_out = 1.0 / jnp.maximum(in_degree, 1.0), 1.0 / jnp.maximum(out_degree, 1.0)
    h = self.node_norm(self.node_in(inputs))
    for round_ in self.rounds:
      h = round_(h, graph.edges, senders, receivers, inverse_in, inverse_out, real)
    return Embeddings(
      nodes=h,
      graph=_mean(h, real),
      axes=axes,
      axis_valid=axis_valid,
      real=real,
      targets=nodes[:, 3],
      node_bias=self.state_nodes(h),
      axis_bias=self.state_mesh(axes),
      senders=senders,
      receivers=receivers,
      cover=graph.edges[:, 2] * inverse_out[senders],
    )

  def head(self, embeddings: Embeddings, features: StateFeatures) -> tuple[jax.Array, jax.Array]:
    """Logits f32 [A] (illegal: `MASKED_LOGIT`) and value f32 [] of one state."""
    e = embeddings
    n, x = features.axes.shape[:2]
    chex.assert_shape(e.nodes, (n, None))
    num_options = features.options.shape[0]
    num_targets = (features.legal.shape[0] - 1 - num_options) // x
    valid = e.axis_valid.astype(jnp.float32)
    inputs = jnp.concatenate(
      [
        features.axes,
        jnp.broadcast_to(features.shards[:, None, None], (n, x, 1)),
        jnp.broadcast_to(features.stage[:, None, None], (n, x, 1)),
      ],
      axis=2,
    )
    per_axis = nn.relu(
      self.state_axes(inputs) + e.axis_bias[None] + e.node_bias[:, None]
    )  # [N, X, Hs]
    state = (per_axis * valid[None, :, None]).sum(axis=1) / jnp.maximum(valid.sum(), 1.0)  # [N, Hs]

    # Each target reads its own state and the mean state of the signatures it covers (a
    # [T, N] x [N, Hs] product; the matrix comes from static data, so under `vmap` over
    # states it is built once, not per state).
    rows = slice(n - 1 - num_targets, n - 1)
    target_of = jnp.where(e.cover > 0, e.senders - rows.start, num_targets)
    cover = jnp.zeros((num_targets, n)).at[target_of, e.receivers].add(e.cover, mode="drop")
    context = jnp.broadcast_to(features.globals, (num_targets, features.globals.shape[0]))
    targets = self.target_norm(
      e.nodes[rows]
      + self.target_update(jnp.concatenate([state[rows], cover @ state, context], axis=1))
    )  # [T, H]

    move = nn.gelu(
      self.move_target(targets)[:, None]
      + self.move_axis(
        jnp.concatenate(
          [features.axes[rows], jnp.broadcast_to(e.axes, (num_targets, x, e.axes.shape[1]))], axis=2
        )
      )
    )
    summary = nn.gelu(
      self.summary(
        jnp.concatenate(
          [_mean(state, e.real), _mean(targets, e.targets[rows]), e.graph, features.globals]
        )
      )
    )
    # Each pipeline option: its S and M, and the embedding of its stage axis (0 for none).
    stage_axis = jnp.where(
      (features.option_axis >= 0)[:, None], e.axes[jnp.maximum(features.option_axis, 0)], 0.0
    )
    option = nn.gelu(
      self.option_in(jnp.concatenate([features.options, stage_axis], axis=1))
      + self.option_summary(summary)
    )  # [P, H]
    logits = jnp.concatenate(
      [
        self.move_logit(move).reshape(-1),
        self.option_logit(option).reshape(-1),
        self.stop_logit(summary),
      ]
    )
    value = self.value(summary)[0]
    return jnp.where(features.legal, logits, MASKED_LOGIT), value

  def __call__(
    self, graph: jraph.GraphsTuple, features: StateFeatures
  ) -> tuple[jax.Array, jax.Array]:
    return self.head(self.encode(graph), features)


@dataclasses.dataclass(frozen=True)
class Network:
  """The network's pure functions for one `NetworkConfig` (hashable: a static jit argument)."""

  config: NetworkConfig = NetworkConfig()

  @property
  def module(self) -> PolicyValueNet:
    return PolicyValueNet(self.config)

  def init(self, key: chex.PRNGKey, tables: EnvTables, state: State) -> chex.ArrayTree:
    """Fresh parameters (their shapes do not depend on the program used here)."""
    graph, features = observation(tables, state)
    return jax.jit(self.module.init)(key, graph, features)

  def encode(self, params: chex.ArrayTree, graph: jraph.GraphsTuple) -> Embeddings:
    """Embeddings of one program (see `PolicyValueNet.encode`)."""
    return self.module.apply(params, graph, method=PolicyValueNet.encode)

  def head(
    self, params: chex.ArrayTree, embeddings: Embeddings, features: StateFeatures
  ) -> tuple[jax.Array, jax.Array]:
    """Logits f32 [A] and value f32 [] of one state (see `PolicyValueNet.head`)."""
    return self.module.apply(params, embeddings, features, method=PolicyValueNet.head)

  def apply(
    self, params: chex.ArrayTree, tables: EnvTables, state: State
  ) -> tuple[jax.Array, jax.Array]:
    """Encode and head in one: logits f32 [A] and value f32 [] of `state`."""
    return self.module.apply(params, *observation(tables, state))
