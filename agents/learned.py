"""The `learned` agent: a trained policy/value network, alone (greedy) or guiding Gumbel MuZero.

It loads a policy directory (`agents.checkpoint`: `network.json` and `params/`, as
`automap-rl train` writes into its run directory's `policy/`); by default the small one
shipped with the package (`DEFAULT_CHECKPOINT`, trained by `automap-rl train --preset
small`). With `search` it runs `agents.gumbel.search` with the network's prior and value;
without, it follows the network's most likely action from the replicated plan until it
stops, then `LearnedConfig.past_stop` steps further by its most likely other actions (one
network call and one plan evaluation per step; as for every agent, the best plan on the
path is kept, so going on never makes it worse): the policy often ranks stop first at a
plan that its next actions still improve, an expert's plan above all. With search, it
follows that path first and searches with the budget. The greedy path is not search: it
always completes, whatever the budget (`SearchResult.greedy_steps` counts its plans), so
no budget gives a worse plan than it.
A greedy path also starts from each expert's plan that fits (`LearnedConfig.from_expert`):
plans the groups action space may not reach (an expert shards single dimensions where
a group shards many), which the policy then refines; `SearchResult.start` says when the
plan came from an expert's. An expert's plan with more class decisions than the
environment holds (ZeRO-3 over every parameter of a deep ResNet) is a candidate without a
path, so the result is never worse than an expert plan that fits. The search starts where
the best greedy paths found their best plans before going on past the network's stop
(`LearnedConfig.search_starts` of them, side by side on one budget), so the budget refines
the policy's best plans rather than replay their first moves; plans past the stop take
more decisions, which only narrows what a search from them reaches. XLA compiles that
search in the background while the program is encoded and the greedy paths run
(`gumbel.compile_ahead`), so a first call on a new model overlaps the two compiles.
With pipeline options, a greedy path starts from each option (a handful), so the choice
of a pipeline is compared on whole plans rather than taken from the first logit alone.
From each start, paths also begin with the network's 2nd to `LearnedConfig.first_moves`-th
most likely intra-op decision: the order of decisions matters (a group sharded over one
axis first, then another, shards other dims than the other way round), and a plan whose
first decision the network ranks second is out of reach of its own path and of a search
below that path's best plan (on a wide MLP, `data` before `model` on the weights). Its
environment offers the pipeline options the policy was trained with (`NetworkConfig.pipelines`),
so its plans may pipeline a layer stack.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import chex
import jax
import jax.numpy as jnp

from agents import checkpoint, gumbel
from agents.base import Budget, Progress, Searcher, SearchResult, Tracker, plan_objective, start
from agents.gumbel import GumbelConfig, GumbelSettings
from agents.network import Embeddings, Network, state_features
from automap_rl import tactics
from automap_rl.compile_options import SearchJit
from automap_rl.problem import Problem
from envs import Env, EnvConfig, State, core
from envs.tables import EnvTables

DEFAULT_CHECKPOINT = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "checkpoints", "medium"
)


@dataclasses.dataclass(frozen=True)
class LearnedConfig:
  """The learned agent.

  Attributes:
    checkpoint: a policy directory or a training run directory; None: the shipped one.
    search: guide Gumbel MuZero with the network (True) or only follow its policy greedily
      (False).
    greedy_first: with `search`, first follow the policy greedily to the end of its path
      (its plans are candidates; outside the budget), then search with the budget: at
      small budgets a search plays only a few moves of an episode, while the policy's path
      reaches a whole plan. False searches only, and a small budget may then end worse
      than the greedy path.
    action_space: the environment's action space (the one the network was trained on).
    max_decisions: the environment's capacity in class decisions.
    from_expert: also start from each expert's plan that fits (`tactics.expert_plans`): a
      greedy path runs from each as from the replicated plan. The result's `start` names
      the expert when its plan came from there.
    search_starts: the search plays episodes from this many starts, the best plans first,
      side by side, sharing the budget: the state of each greedy path's best plan (with
      `greedy_first`), else the starts themselves (the replicated plan, the experts').
    past_stop: a greedy path goes on this many steps after the network first ranks stop
      first, each step the most likely action other than stop (then it stops where the
      network does).
    first_moves: greedy paths from each start begin with each of the network's this many
      most likely intra-op decisions (1: its most likely only), so that a plan whose first
      decision the network ranks below another (a group sharded over one axis before
      another, which then shards other dims) is reached.
    gumbel: the Gumbel searches' settings (`agents.gumbel.GumbelSettings`).
  """

  checkpoint: str | None = None
  search: bool = True
  greedy_first: bool = True
  action_space: str = "groups"
  max_decisions: int = 256
  from_expert: bool = True
  search_starts: int = 2
  past_stop: int = 8
  first_moves: int = 4
  gumbel: GumbelSettings = GumbelSettings(max_num_considered_actions=4)

  def __post_init__(self):
    if self.search_starts < 1:
      raise ValueError(f"search_starts={self.search_starts}: the search needs at least one start.")
    if self.first_moves < 1:
      raise ValueError(f"first_moves={self.first_moves}: a start needs at least one greedy path.")
    if self.past_stop < 0:
      raise ValueError(
        f"past_stop={self.past_stop}: a greedy path cannot go a negative number of steps on."
      )


_POLICIES: dict[str, tuple[Network, chex.ArrayTree]] = {}


def policy_path(path: str | None) -> str:
  """The policy directory of `path` (a policy or run directory; None: `DEFAULT_CHECKPOINT`).

  Raises:
    ValueError: it holds no policy (for the default: none was shipped with this copy).
  """
  return checkpoint.policy_dir(DEFAULT_CHECKPOINT if path is None else path)


def load_network(path: str | None) -> Network:
  """The network of a policy (or run) directory, `DEFAULT_CHECKPOINT` for None (its sizes
  and the pipeline options it acts on, `NetworkConfig.pipelines`)."""
  return Network(checkpoint.read_network(policy_path(path)))


def searched_env(problem: Problem, config: LearnedConfig = LearnedConfig()) -> Env:
  """The bucket-padded environment the learned agent searches on `problem` (its
  `Searcher`'s). Problems whose environment tables and `Problem.bucketed` have one
  `automap_rl.buckets.key` share every compile of the learned search."""
  pipelines = load_network(config.checkpoint).config.pipelines
  search_, _, _ = start(problem, config.action_space, config.max_decisions, 1, None, pipelines)
  return search_.env


def load_policy(path: str | None, tables: EnvTables, root: State) -> tuple[Network, chex.ArrayTree]:
  """The network and parameters of a policy (or run) directory, `DEFAULT_CHECKPOINT` for
  None; loaded once per directory. `tables` and `root`, of any program, give the shapes
  the parameters are restored onto."""
  where = policy_path(path)
  if where not in _POLICIES:
    network = load_network(where)
    target = jax.eval_shape(network.init, jax.random.key(0), tables, root)
    _POLICIES[where] = (network, checkpoint.load_params(where, target))
  return _POLICIES[where]


@chex.dataclass(frozen=True)
class GreedyPath:
  """A greedy path, padded to L = `max_decisions + 1` steps (the longest episode: a
  pipeline option, then actions that each add at least one class decision).

  Attributes:
    actions: the path's actions, then -1 (the stop that ends the path is not recorded),
      int32 [L].
    objective, step_time: the plan after each action, f32 [L].
    best: the state of the best plan before the path goes on past the network's stop (the
      start's when no step improves on it): where a search starts. Plans past the stop
      are candidates, not starts: their extra decisions can only narrow what a search
      from them reaches.
    best_length: the actions from the start to `best`, int32 [].
  """

  actions: jax.Array
  objective: jax.Array
  step_time: jax.Array
  best: State
  best_length: jax.Array


@functools.partial(SearchJit, calls="many", static_argnames=("network", "env_config"))
def greedy_path(
  network: Network,
  env_config: EnvConfig,
  params: chex.ArrayTree,
  embeddings: Embeddings,
  tables: EnvTables,
  state: State,
  first: jax.Array,
  rank: jax.Array,
  past_stop: jax.Array,
) -> GreedyPath:
  """The network's greedy path from `state`: `first` where it is not negative (int32 []),
  then, where `rank` (int32 []) is positive, the `rank`-th most likely action other than
  stop (0: the most likely; where fewer are legal, the most likely), then the most likely
  action at each state, until the network stops or the episode ends; from the first state
  where stop is the most likely, `past_stop` (int32 []) more steps take the most likely
  action other than stop where one is legal.
  One `lax.while_loop`: a path is one call and one copy to the host (a copy of each state
  would cost more than its step); one compile serves every start of a problem."""
  size = env_config.max_decisions + 1
  stop = state.legal_action_mask.shape[0] - 1
  path = GreedyPath(
    actions=jnp.full(size, -1, jnp.int32),
    objective=jnp.zeros(size, jnp.float32),
    step_time=jnp.zeros(size, jnp.float32),
    best=state,
    best_length=jnp.int32(0),
  )

  def going(carry):
    i, _, state, _ = carry
    return (i < size) & ~(state.terminated | state.truncated)

  def advance(carry):
    i, past, state, path = carry  # past: steps since stop was first the most likely.
    logits, _ = network.head(params, embeddings, state_features(tables, state))
    likeliest = jnp.argmax(logits)
    others = state.legal_action_mask.at[stop].set(False)
    other_logits = jnp.where(others, logits, -jnp.inf)
    forced = (i == 0) & (first >= 0)
    diverted = (i == (first >= 0)) & (rank > 0) & (others.sum() > rank)
    go_on = ~forced & ~diverted & (likeliest == stop) & (past < past_stop) & others.any()
    action = jnp.where(go_on, jnp.argmax(other_logits), likeliest)
    action = jax.lax.cond(
      diverted, lambda: jnp.argsort(-other_logits)[rank], lambda: action
    )  # Once a path: no sort per step.
    action = jnp.where(forced, first, action).astype(jnp.int32)
    past = jnp.where(go_on | (past > 0), past + 1, past)
    state = core.step(env_config, tables, state, action)
    better = (past == 0) & (state.objective < path.best.objective)  # On the network's own path.
    path = GreedyPath(
      actions=path.actions.at[i].set(jnp.where(action == stop, -1, action)),
      objective=path.objective.at[i].set(state.objective),
      step_time=path.step_time.at[i].set(state.step_time),
      best=jax.tree.map(lambda new, old: jnp.where(better, new, old), state, path.best),
      best_length=jnp.where(better, i + 1, path.best_length),
    )
    return i + 1, past, state, path

  return jax.lax.while_loop(going, advance, (jnp.int32(0), jnp.int32(0), state, path))[3]


def path_firsts(search_: Searcher, first_moves: int) -> list[tuple[int, int]]:
  """How each greedy path `follow` takes from `search_`'s root begins, as `greedy_path`'s
  `(first, rank)`: from each pipeline option where the root has chosen none yet (else the
  policy's own first action, -1), the policy's most likely next action; and, with no
  pipeline, also its 2nd to `first_moves`-th most likely intra-op decision."""
  if search_.env.pipelines and int(search_.root.pipeline) < 0:
    options = [int(a) for a in search_.legal(search_.root)]
    no_pipeline = search_.env.tables.num_moves  # Option 0 (`envs.pipelines.menu`).
    return [(a, 0) for a in options] + [
      (no_pipeline, rank) for rank in range(1, first_moves) if no_pipeline in options
    ]
  return [(-1, rank) for rank in range(first_moves)]


def follow(
  network: Network,
  params: chex.ArrayTree,
  embeddings: Embeddings,
  search_: Searcher,
  track: Tracker,
  past_stop: int,
  first_moves: int,
) -> list[gumbel.Start]:
  """Follows the network's most likely action from `search_`'s root until it stops (and
  `past_stop` steps on, as `greedy_path`) or the episode ends, offering each plan on the
  path to `track` (counted as `greedy_steps`, outside its budget); and again from each of
  its 2nd to `first_moves`-th most likely first intra-op decisions (`path_firsts`). With
  pipeline options the root's actions are those few options: a path is followed from
  each, so the policy's intra-op plan under every pipeline choice (no pipeline included)
  is a candidate. Returns where each path found its best plan before going on past the
  network's stop (`GreedyPath.best`)."""
  env = search_.env
  bests = []
  for first, rank in path_firsts(search_, first_moves):
    path = jax.device_get(
      greedy_path(
        network,
        env.config,
        params,
        embeddings,
        env.tables,
        search_.root,
        jnp.int32(first),
        jnp.int32(rank),
        jnp.int32(past_stop),
      )
    )
    actions = path.actions[path.actions >= 0].tolist()  # A stop ends the path: -1 only after it.
    for i in range(len(actions)):
      track.offer(float(path.objective[i]), float(path.step_time[i]), actions[: i + 1])
    track.greedy_steps += len(actions)
    bests.append(gumbel.Start(search_, path.best, tuple(actions[: int(path.best_length)])))
  return bests


def search(
  problem: Problem,
  config: LearnedConfig = LearnedConfig(),
  seed: int = 0,
  budget: Budget | int | str = 1000,
  progress: Progress | None = None,
) -> SearchResult:
  """The learned agent (see the module docstring). Deterministic for a given seed and a
  simulations budget."""
  pipelines = load_network(config.checkpoint).config.pipelines
  search_, track, _ = start(
    problem, config.action_space, config.max_decisions, budget, progress, pipelines
  )
  network, params = load_policy(config.checkpoint, search_.env.tables, search_.root)
  roots = [search_]
  if config.from_expert:  # The experts' plans are priced to find the best one: no simulation.
    for expert in (e for e in tactics.expert_plans(problem) if e.fits and e.decisions):
      root = search_.rooted_at(expert.name, expert.decisions, expert.cost)
      if root is not None:
        roots.append(root)
      else:  # Too many decisions to search from; still a candidate plan.
        track.search = search_.holding(expert.name, expert.decisions)
        track.offer(plan_objective(problem, expert.cost), float(expert.cost.step_time), [])
  search_config = GumbelConfig(
    action_space=config.action_space,
    max_decisions=config.max_decisions,
    gumbel=config.gumbel,
    network=network.config,
    pipelines=pipelines,
  )
  greedy = not config.search or config.greedy_first
  if (
    config.search
  ):  # XLA compiles the search while the program is encoded and the greedy paths run.
    paths = (
      sum(len(path_firsts(root, config.first_moves)) for root in roots) if greedy else len(roots)
    )
    compiled = gumbel.compile_ahead(
      search_.env,
      search_config,
      params,
      search_.root,
      min(config.search_starts, paths) * search_config.episodes,
    )
  embeddings = gumbel.encode(network, params, search_.env.tables, search_.root)
  starts = []
  for root in roots:  # Each start's own plan is a candidate.
    track.search = root
    track.offer(float(root.root.objective), float(root.root.step_time), [])
    if greedy:
      starts += follow(
        network, params, embeddings, root, track, config.past_stop, config.first_moves
      )
    else:
      starts.append(gumbel.Start(root, root.root))
  if config.search:
    compiled.result()
    best = sorted(starts, key=lambda s: float(s.state.objective))[: config.search_starts]
    gumbel.play(best, track, search_config, seed, params, embeddings)
  return track.result()
