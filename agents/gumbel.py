"""Gumbel MuZero search (mctx) over the partitioning environment, the environment being the model.

`recurrent_fn` steps the environment exactly: the reward is the decrease of the log
objective (`log_reward`: summed over an episode, the log of the replicated plan's cost
over the final plan's, so problems of any size weigh alike), the discount 1 (0 once the
episode has ended), and the prior logits
and value come from the network's head (`agents.network`) on the program's embeddings,
encoded once per search and closed over. Without parameters the prior is uniform over the
legal actions and every value is 0: the uniform-prior Gumbel baseline.

`policy` is the pure, batched search (the environment and the network vmapped over a
mixed batch of programs, mapped over one program's episodes one at a time); `run_search`
wraps it for self-play over a mixed batch of programs; `search` is the agent: it plays
episodes from the replicated plan, one Gumbel search per step from the current state,
taking the action it selects until stop or the end of the episode, then starts over,
until the budget is spent.
Every plan a search tree evaluated is a candidate (read from the tree's nodes), so the
best plan seen at any depth of any tree is kept.

A simulation is one environment step that evaluates a new plan (a node whose plan has more
decisions than its parent's, or another pipeline; stops and steps below an ended episode evaluate
nothing), as
for the other agents. A Gumbel search of `n` simulations evaluates at most `n` plans; the
last search of a budget runs fewer (a traced loop bound, so no recompile).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import mctx
import numpy as np

from agents.base import Budget, Progress, Searcher, SearchResult, Tracker, start
from agents.network import (
  MASKED_LOGIT,
  Embeddings,
  Network,
  NetworkConfig,
  state_features,
  static_graph,
)
from automap_rl.compile_options import SearchJit
from automap_rl.problem import Problem
from envs import Env, EnvConfig, State, core
from envs.tables import EnvTables


@dataclasses.dataclass(frozen=True)
class GumbelSettings:
  """One Gumbel MuZero search (the arguments of mctx's `gumbel_muzero_policy`): the one
  definition the Gumbel agent, the learned agent, self-play and evaluation share, each
  with its own default.

  Attributes:
    num_simulations: simulations per search (one search per step of an episode).
    max_num_considered_actions: root actions sampled (Gumbel top-k) for Sequential
      Halving.
    gumbel_scale: scale of the root's Gumbel noise (0: deterministic given the prior).
  """

  num_simulations: int = 16
  max_num_considered_actions: int = 8
  gumbel_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class GumbelConfig:
  """Gumbel MuZero search.

  Attributes:
    action_space: the environment's action space (`groups`, `arg_dims`, `named_dims`).
    max_decisions: the environment's capacity in class decisions.
    gumbel: the search's settings (simulations, considered actions, noise).
    episodes: episodes searched side by side (one search over all of them).
    network: the network's sizes (used when parameters are given).
    pipelines: the environment's pipeline options (`EnvConfig.pipelines`; 0: none); with
      parameters, the network's (`NetworkConfig.pipelines`).
  """

  action_space: str = "groups"
  max_decisions: int = 256
  gumbel: GumbelSettings = GumbelSettings(num_simulations=32, max_num_considered_actions=16)
  episodes: int = 1
  network: NetworkConfig = NetworkConfig()
  pipelines: int = 0


def _evaluate(
  network: Network,
  params: chex.ArrayTree | None,
  embeddings: Embeddings | None,
  tables: EnvTables,
  state: State,
) -> tuple[jax.Array, jax.Array]:
  """Prior logits f32 [A] and value f32 [] of one state: the network's head, or uniform
  (legal actions 0, illegal `MASKED_LOGIT`, value 0) without parameters."""
  if params is None:
    return jnp.where(state.legal_action_mask, 0.0, MASKED_LOGIT), jnp.float32(0.0)
  return network.head(params, embeddings, state_features(tables, state))


def log_reward(before: State, after: State) -> jax.Array:
  """The search's reward of a step: `log(before.objective / after.objective)`, f32 [...]
  (0 for a stop or a step below an ended episode, which leave the plan as it is)."""
  return jnp.log(before.objective) - jnp.log(after.objective)


def policy(
  params: chex.ArrayTree | None,
  embeddings: Embeddings | None,
  tables: EnvTables,
  states: State,
  key: chex.PRNGKey,
  limit: jax.Array,
  config: GumbelConfig,
  env_config: EnvConfig,
  batched: bool,
) -> mctx.PolicyOutput:
  """One Gumbel MuZero search from each of `states` [B]. Pure.

  Args:
    params: the network's parameters, or None for the uniform prior.
    embeddings: `Network.encode` of each state's program ([B, ...] if `batched`, else one
      shared), or None without parameters.
    tables: the environment's tables, [B, ...] if `batched` (a mixed batch, see
      `envs.programs.batch_tables`), else one program's, shared by all states.
    states: the roots, [B].
    limit: run at most this many of the `config.gumbel.num_simulations` simulations, int32 [].
    batched: whether `tables` and `embeddings` have a leading batch axis.

  Returns:
    mctx's output: `action` int32 [B], `action_weights` f32 [B, A], `search_tree` (its
    node embeddings are the environment states of the nodes).
  """
  network = Network(config.network)
  if batched:  # A mixed batch of programs: vmapped.
    evaluate = jax.vmap(functools.partial(_evaluate, network, params))
    step = jax.vmap(functools.partial(core.step, env_config))
  else:
    # One program's few episodes, one at a time: less than half a vmap's tracing, as fast to run.
    evaluate = lambda e, t, s: jax.lax.map(functools.partial(_evaluate, network, params, e, t), s)
    step = lambda t, s, a: jax.lax.map(lambda x: core.step(env_config, t, *x), (s, a))

  def recurrent_fn(_, key, action, state):
    del key  # The environment is deterministic.
    new = step(tables, state, action)
    logits, value = evaluate(embeddings, tables, new)
    ended = new.terminated | new.truncated
    out = mctx.RecurrentFnOutput(
      reward=log_reward(state, new),
      discount=jnp.where(ended, 0.0, 1.0),
      prior_logits=logits,
      value=jnp.where(ended, 0.0, value),
    )
    return out, new

  def loop(lower, upper, body, init):
    return jax.lax.fori_loop(lower, jnp.minimum(upper, limit), body, init)

  logits, value = evaluate(embeddings, tables, states)
  root = mctx.RootFnOutput(prior_logits=logits, value=value, embedding=states)
  search_key, noise_key = jax.random.split(key)
  noise = root_gumbel(noise_key, logits.shape, None if batched else tables)
  return _gumbel_muzero(
    search_key,
    root,
    recurrent_fn,
    ~states.legal_action_mask,
    noise * config.gumbel.gumbel_scale,
    config.gumbel,
    loop,
  )


def root_gumbel(key: chex.PRNGKey, shape: tuple[int, int], tables: EnvTables | None) -> jax.Array:
  """The root's Gumbel noise, f32 [B, A]. Given one program's `tables`, each of its actions
  draws what it would draw were the tables not padded: the draws of
  `jax.random.gumbel(key, (B, A_own))` (A_own: the program's own action count), placed at
  the padded actions' indices (padding targets shift the pipeline options and stop; their
  own actions, never legal, draw 0). So a bucket's padding does not change a search. With
  `tables` None (a mixed batch, whose rows share one action count), the draws of `(B, A)`.
  """
  if tables is None:
    return jax.random.gumbel(key, shape)
  episodes, num_actions = shape
  real = jnp.sum((tables.target_classes >= 0).any(axis=1))
  padding = tables.num_moves - real * tables.num_axes  # Actions of padding targets.
  action = jnp.arange(num_actions)
  after_moves = action >= tables.num_moves  # Pipeline options and stop.
  own = jnp.where(after_moves, action - padding, action)
  flat = jnp.arange(episodes)[:, None] * (num_actions - padding) + own
  draws = jax.random.gumbel(key, (episodes * num_actions,))[flat]
  return jnp.where(after_moves | (action < tables.num_moves - padding), draws, 0.0)


def _gumbel_muzero(
  key: chex.PRNGKey,
  root: mctx.RootFnOutput,
  recurrent_fn: mctx.RecurrentFn,
  invalid: jax.Array,
  gumbel: jax.Array,
  settings: GumbelSettings,
  loop_fn: mctx.LoopFn,
) -> mctx.PolicyOutput:
  """mctx's Gumbel MuZero policy (`mctx.gumbel_muzero_policy`, its default Q transform and
  depth) with the root's Gumbel noise given, f32 [B, A] (`root_gumbel`), where mctx draws
  it over the arrays' shape. `invalid`: the root's illegal actions, bool [B, A]."""
  qtransform = mctx.qtransform_completed_by_mix_value
  root = root.replace(prior_logits=_masked(root.prior_logits, invalid))
  tree = mctx.search(
    params=None,
    rng_key=key,
    root=root,
    recurrent_fn=recurrent_fn,
    root_action_selection_fn=functools.partial(
      mctx.gumbel_muzero_root_action_selection,
      num_simulations=settings.num_simulations,
      max_num_considered_actions=settings.max_num_considered_actions,
      qtransform=qtransform,
    ),
    interior_action_selection_fn=functools.partial(
      mctx.gumbel_muzero_interior_action_selection, qtransform=qtransform
    ),
    num_simulations=settings.num_simulations,
    invalid_actions=invalid,
    extra_data=mctx.GumbelMuZeroExtraData(root_gumbel=gumbel),
    loop_fn=loop_fn,
  )
  visits = tree.summary().visit_counts
  completed = jax.vmap(qtransform, in_axes=(0, None))(tree, tree.ROOT_INDEX)
  # Sequential Halving's final choice: among the most visited actions, the largest
  # noise + logits + completed Q (a legal action).
  score = jnp.maximum(-1e9, gumbel + root.prior_logits + completed)  # Logits: max 0.
  score = jnp.where(visits == jnp.max(visits, axis=-1, keepdims=True), score, -jnp.inf)
  action = jnp.argmax(jnp.where(invalid, -jnp.inf, score), axis=-1).astype(jnp.int32)
  weights = jax.nn.softmax(_masked(root.prior_logits + completed, invalid))
  return mctx.PolicyOutput(action=action, action_weights=weights, search_tree=tree)


def _masked(logits: jax.Array, invalid: jax.Array) -> jax.Array:
  """`logits` [B, A] less their maximum, the illegal actions' at the lowest float (no mass in
  a softmax, and no NaN where every action is illegal)."""
  logits = logits - jnp.max(logits, axis=-1, keepdims=True)
  return jnp.where(invalid, jnp.finfo(logits.dtype).min, logits)


@functools.partial(jax.jit, static_argnames=("config", "env_config"))
def run_search(
  params: chex.ArrayTree | None,
  tables: EnvTables,
  states: State,
  key: chex.PRNGKey,
  config: GumbelConfig,
  env_config: EnvConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A full Gumbel search from each state of a batch that may mix programs. Pure (jitted).

  Args:
    params: the network's parameters, or None for the uniform prior.
    tables: batched tables [B, ...] (`envs.programs.batch_tables`): row b is `states[b]`'s program.
    states: the roots, [B].
    env_config: the environment's configuration (the one the tables were built for).

  Returns:
    The selected actions int32 [B], the improved policy f32 [B, A] (a training target for
    the logits) and the search's value of each root f32 [B].
  """
  embeddings = None
  if params is not None:
    network = Network(config.network)
    embeddings = jax.vmap(network.encode, in_axes=(None, 0))(
      params, jax.vmap(static_graph)(tables, states)
    )
  out = policy(
    params,
    embeddings,
    tables,
    states,
    key,
    jnp.int32(config.gumbel.num_simulations),
    config,
    env_config,
    batched=True,
  )
  return out.action, out.action_weights, out.search_tree.summary().value


@chex.dataclass(frozen=True)
class _Nodes:
  """What the host reads of the search trees [B, S + 1] (S = num_simulations).

  Attributes:
    objective, step_time: of each node's plan, f32.
    evaluated: whether the node's step evaluated a new plan (a simulation), bool.
    parent, action: the node's parent (-1 for the root and unused nodes) and the action
      from it, int32.
  """

  objective: jax.Array
  step_time: jax.Array
  evaluated: jax.Array
  parent: jax.Array
  action: jax.Array


@functools.partial(SearchJit, calls="many", static_argnames=("config", "env_config"))
def _search_step(
  params,
  embeddings,
  tables: EnvTables,
  states: State,
  key: chex.PRNGKey,
  limit: jax.Array,
  config: GumbelConfig,
  env_config: EnvConfig,
) -> tuple[jax.Array, State, _Nodes]:
  """A search from each state of one program's episodes: the selected actions [B], the
  states they lead to [B] (the selected child is always visited) and the trees' nodes."""
  out = policy(params, embeddings, tables, states, key, limit, config, env_config, batched=False)
  tree = out.search_tree
  nodes = tree.embeddings
  batch = jnp.arange(out.action.shape[0])
  parent = tree.parents
  parent_decisions, parent_pipeline = (
    jnp.take_along_axis(x, jnp.maximum(parent, 0), axis=1)
    for x in (nodes.num_decisions, nodes.pipeline)
  )
  evaluated = (parent >= 0) & (
    (nodes.num_decisions > parent_decisions) | (nodes.pipeline != parent_pipeline)
  )
  chosen = tree.children_index[batch, tree.ROOT_INDEX, out.action]
  after = jax.tree.map(lambda x: x[batch, chosen], nodes)
  return (
    out.action,
    after,
    _Nodes(
      objective=nodes.objective,
      step_time=nodes.step_time,
      evaluated=evaluated,
      parent=parent,
      action=tree.action_from_parent,
    ),
  )


@functools.partial(SearchJit, calls="many", static_argnames="network", keep_unused=True)
def _placeholder(
  network: Network, params: chex.ArrayTree, tables: EnvTables, state: State
) -> Embeddings:
  """Zeros shaped as `encode`'s embeddings of the program and placed as they are (a jit of
  the same arguments, none pruned): what compiling a search needs of them, without the
  encoder's work (XLA drops it)."""
  return jax.tree.map(jnp.zeros_like, network.encode(params, static_graph(tables, state)))


_COMPILER = concurrent.futures.ThreadPoolExecutor(
  max_workers=1, thread_name_prefix="gumbel-compile"
)


def compile_ahead(
  env: Env, config: GumbelConfig, params: chex.ArrayTree | None, root: State, episodes: int
) -> concurrent.futures.Future:
  """Compiles `play`'s search of `episodes` episodes side by side (its starts times
  `config.episodes`) over `env` in a background thread, by a search of no simulations from
  `root` (a host state of `env`) on embeddings of zeros (only their shapes matter), so that
  the caller works meanwhile (a learned agent encodes its program and follows its greedy
  paths while XLA compiles) and `play`'s first search finds it compiled. Wait on the future
  before `play`: a search called while this one compiles would compile it again."""

  def search_nothing() -> None:
    embeddings = (
      None if params is None else _placeholder(Network(config.network), params, env.tables, root)
    )
    states = jax.tree.map(lambda x: np.stack([x] * episodes), root)
    _search_step(
      params,
      embeddings,
      env.tables,
      states,
      jax.random.key(0),
      jnp.int32(0),
      config=config,
      env_config=env.config,
    )

  return _COMPILER.submit(search_nothing)


@functools.partial(SearchJit, calls="many", static_argnames="network")
def encode(network: Network, params: chex.ArrayTree, tables: EnvTables, state: State) -> Embeddings:
  """The embeddings of one program (from any of its states), jitted once per network."""
  return network.encode(params, static_graph(tables, state))


def _path(parent: np.ndarray, action: np.ndarray, node: int) -> list[int]:
  """The actions from the root to `node` of one tree."""
  out = []
  while node > 0:
    out.append(int(action[node]))
    node = int(parent[node])
  return out[::-1]


def search(
  problem: Problem,
  config: GumbelConfig = GumbelConfig(),
  seed: int = 0,
  budget: Budget | int | str = 1000,
  progress: Progress | None = None,
  params: chex.ArrayTree | None = None,
) -> SearchResult:
  """Plays Gumbel MuZero episodes until the budget is spent; returns the best plan any
  search tree evaluated. `params`: the network's (`config.network`), or None for the
  uniform prior. Deterministic for a given seed and a simulations budget."""
  if params is not None and config.pipelines != config.network.pipelines:
    raise ValueError(
      f"pipelines={config.pipelines}: the network reads an environment with "
      f"{config.network.pipelines} pipeline options; give it as many."
    )
  search_, track, _ = start(
    problem, config.action_space, config.max_decisions, budget, progress, config.pipelines
  )
  embeddings = (
    None
    if params is None
    else encode(Network(config.network), params, search_.env.tables, search_.root)
  )
  play([Start(search_, search_.root)], track, config, seed, params, embeddings)
  return track.result()


class Start(NamedTuple):
  """Where a searched episode starts: a state of `searcher`'s environment, reached from its
  root by `actions` (none for the root itself), so that every plan found from it is that
  searcher's plan of `actions` and then the episode's."""

  searcher: Searcher
  state: State
  actions: tuple[int, ...] = ()


def play(
  starts: Sequence[Start],
  track: Tracker,
  config: GumbelConfig,
  seed: int,
  params: chex.ArrayTree | None,
  embeddings: Embeddings | None,
) -> None:
  """Plays Gumbel MuZero episodes until `track`'s budget is spent, offering every plan the
  trees evaluate to `track`: `config.episodes` from each of `starts` (of searchers of one
  environment: the replicated plan's, or ones rooted at a plan made elsewhere,
  `Searcher.rooted_at`), side by side in one batched search, so that they share the
  budget; an episode that ends starts again where it started."""
  starts = [s for s in starts if not (bool(s.state.terminated) or bool(s.state.truncated))]
  if not starts:
    return
  env = starts[0].searcher.env
  owner = [s for s in starts for _ in range(config.episodes)]  # The start of each episode.
  count = len(owner)
  root = jax.tree.map(lambda *xs: np.stack(xs), *[s.state for s in owner])
  states, paths = root, [list(s.actions) for s in owner]
  key = jax.random.key(seed)
  while not track.done:
    limit = min(config.gumbel.num_simulations, track.left // count)
    if limit < 1:
      break
    key, sub = jax.random.split(key)
    actions, after, nodes = jax.device_get(
      _search_step(
        params,
        embeddings,
        env.tables,
        states,
        sub,
        jnp.int32(limit),
        config=config,
        env_config=env.config,
      )
    )
    used = int(nodes.evaluated.sum())
    if used == 0:  # The searches only stop: nothing is left that they would evaluate.
      break
    base = track.simulations
    for e in range(count):
      evaluated = nodes.evaluated[e]
      if evaluated.any():
        best = int(np.argmin(np.where(evaluated, nodes.objective[e], np.inf)))
        at = base + int(nodes.evaluated[:e].sum()) + int(evaluated[: best + 1].sum())
        track.search = owner[e].searcher
        track.offer(
          nodes.objective[e, best],
          nodes.step_time[e, best],
          paths[e] + _path(nodes.parent[e], nodes.action[e], best),
          at,
        )
    track.count(used)
    ended = (actions == env.stop_action) | after.terminated | after.truncated
    states = jax.tree.map(
      lambda r, a: np.where(ended.reshape((-1,) + (1,) * (a.ndim - 1)), r, a), root, after
    )
    paths = [
      list(owner[e].actions) if ended[e] else paths[e] + [int(actions[e])] for e in range(count)
    ]
