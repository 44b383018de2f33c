"""Self-play: the training problems laid out for batched search, episodes played by Gumbel
MuZero from the network, and the training targets they give.

Return. An episode's return is `log(best expert cost / final plan cost)` (costs are the
environment's objective: step time, times the memory penalty when the plan overflows the
device): 0 when the plan ties the best expert tactic, positive when it beats it, and the
same for a 2-layer toy and a 70B model that are improved by the same factor. It splits
exactly into the part already earned at step t, `log(best / objective_t)`, known from the
state, and the part to come, `log(objective_t / objective_final)` = the sum of the
search's future rewards (`agents.gumbel.log_reward`). The value head learns the second
(it needs no knowledge of the experts), so search values and training targets agree.

Memory. Plans that do not fit in device memory are penalised, not masked: the
environment's objective multiplies the step time by `1 + memory_penalty * overflow`.
Fitting is no property of an action: the replicated start of a large model does not fit
and only sharding decisions make it fit, so a mask would forbid the very paths that lead
to good plans. The penalty keeps every path open, ranks an overflowing plan behind one that
fits at equal speed, and the best expert is scored by the same objective.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from agents import base, gumbel
from agents.gumbel import GumbelConfig
from agents.network import Network, StateFeatures, state_features, static_graph
from automap_rl import tactics
from automap_rl.problem import Problem
from automap_rl.workloads.suite import Case
from envs import EnvConfig, State, core
from envs.programs import batch_tables
from envs.tables import EnvTables
from envs.tables import objective as env_objective


@chex.dataclass(frozen=True)
class Suite:
  """P training problems laid out for batched self-play.

  Attributes:
    tables: the problems' tables, bucket-padded to common sizes and stacked, [P, ...].
    roots: each problem's initial (replicated) state, [P].
    expert_roots: each problem's expert start (`expert_start`), [P]; its replicated
      state in a suite built without expert starts.
    best: each problem's best expert objective (the environment's objective of the best
      applicable tactic, relative to the replicated plan), f32 [P].
  """

  tables: EnvTables
  roots: State
  expert_roots: State
  best: jax.Array

  @property
  def size(self) -> int:
    return self.best.shape[0]


def _row(tree: chex.ArrayTree, index: jax.Array) -> chex.ArrayTree:
  return jax.tree.map(lambda x: x[index], tree)


def expert_objective(
  problem: Problem, env_config: EnvConfig, tables: EnvTables, expert: tactics.Expert | None = None
) -> float:
  """The environment's objective of the problem's best expert (`tactics.best_expert_plan`,
  or `expert` when the caller has it), relative to the replicated plan."""
  cost = (expert or tactics.best_expert_plan(problem)).cost
  return float(env_objective(env_config, cost, np.asarray(tables.base), problem.tables.hbm_bytes))


@functools.cache
def case_problem(case: Case) -> Problem:
  """The problem of a task-suite case (its abstract workload traced on its mesh), built once."""
  return Problem.build(case.make_workload(abstract=True).trace(), case.make_mesh())


def expert_start(
  problem: Problem,
  env_config: EnvConfig,
  tables: EnvTables,
  root: State,
  experts: Sequence[tactics.Expert],
) -> State:
  """The state of the problem's best expert plan that the environment holds (the first of
  `experts`, `tactics.expert_plans` in the yardstick's order; `agents.base.plan_state` on
  the problem's row of the suite's `tables`), else `root`: self-play started there learns
  to refine the experts' plans, which the learned agent also starts from."""
  for expert in experts:
    state = (
      base.plan_state(problem, env_config, tables, expert.decisions, expert.cost)
      if expert.decisions
      else root
    )
    if state is not None:
      return state
  return root


@functools.lru_cache(maxsize=4)
def build_suite(
  problems: tuple[Problem, ...], env_config: EnvConfig, expert_starts: bool = False
) -> Suite:
  """The suite of `problems` under `env_config` (whose `max_axes` must cover every mesh),
  with each problem's expert start (`expert_start`, one compile of its plan's resolution
  per problem) if `expert_starts`; the last few are kept, so runs in one process share
  their set-up."""
  tables, _ = batch_tables(problems, env_config)
  roots = jax.jit(jax.vmap(functools.partial(core.init, env_config), in_axes=(0, None)))(
    tables, jax.random.key(0)
  )
  host_tables, host_roots = jax.device_get(
    (tables, roots)
  )  # Rows read in numpy: no compile per leaf shape.
  best, starts = [], []
  for i, problem in enumerate(problems):
    table, root, experts = _row(host_tables, i), _row(host_roots, i), tactics.expert_plans(problem)
    best.append(expert_objective(problem, env_config, table, experts[0]))
    if expert_starts:
      starts.append(expert_start(problem, env_config, table, root, experts))
  expert_roots = (
    jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *starts) if expert_starts else roots
  )
  return Suite(
    tables=tables, roots=roots, expert_roots=expert_roots, best=jnp.asarray(best, jnp.float32)
  )


@chex.dataclass(frozen=True)
class Samples:
  """Training samples (leading axes [...], e.g. [L, B] from an episode, [N] in replay).

  Attributes:
    problem: the suite index of the sample's program, int32.
    features: the head's input for the searched state (`agents.network.StateFeatures`).
    policy: the search's improved policy (mctx's `action_weights`), the policy target, f32 [..., A].
    value: the value target, `log(objective now / objective of the episode's final plan)`, f32.
  """

  problem: jax.Array
  features: StateFeatures
  policy: jax.Array
  value: jax.Array


@chex.dataclass(frozen=True)
class Episodes:
  """B self-play episodes of L steps.

  Attributes:
    samples: one per step and episode, [L, B].
    active: whether the step searched a live state (an episode that has ended only
      repeats its last state), bool [L, B].
    final: the objective of each episode's final plan, f32 [B].
    steps: actions each episode took before ending (or L), int32 [B].
  """

  samples: Samples
  active: jax.Array
  final: jax.Array
  steps: jax.Array


def episode_keys(key: chex.PRNGKey, length: int, episodes: int) -> jax.Array:
  """The search keys of `episodes` (B) episodes of `length` (L) steps, [L, B]: step l's key
  split B ways, so episode b's noise does not depend on which episodes share its batch."""
  return jax.vmap(lambda step_key: jax.random.split(step_key, episodes))(
    jax.random.split(key, length)
  )


def play(
  params: chex.ArrayTree,
  suite: Suite,
  problems: jax.Array,
  from_expert: jax.Array,
  keys: jax.Array,
  config: GumbelConfig,
  env_config: EnvConfig,
) -> Episodes:
  """Plays one episode per entry of `problems` (suite indices, int32 [B]) for L steps from
  the problem's replicated plan, or its expert start where `from_expert` (bool [B]), each
  step a Gumbel MuZero search from the network (`params`) that picks the action (its root
  noise explores), with `keys` [L, B] (`episode_keys`). Pure; jit it with the configs static.

  Each episode searches alone (vmapped over the episodes) with its own keys: episode b
  plays the same whether the B episodes run on one device or are split over many, and a
  split batch needs no communication between devices.

  The programs are encoded once per episode; the environment (`env_config`, the one the
  suite's tables were built for) should truncate episodes at L steps (its
  `max_steps`) so that the search and the targets see the same horizon.
  """
  chex.assert_rank(problems, 1)
  network = Network(config.network)
  tables, roots = _row(suite.tables, problems), _row(suite.roots, problems)
  embeddings = jax.vmap(network.encode, in_axes=(None, 0))(
    params, jax.vmap(static_graph)(tables, roots)
  )
  starts = jax.tree.map(
    lambda expert, replicated: jnp.where(
      from_expert.reshape(from_expert.shape + (1,) * (expert.ndim - 1)), expert, replicated
    ),
    _row(suite.expert_roots, problems),
    roots,
  )
  features = jax.vmap(state_features)
  limit = jnp.int32(config.gumbel.num_simulations)

  def search(
    embedding, table: EnvTables, state: State, key: chex.PRNGKey
  ) -> tuple[State, jax.Array]:
    """One episode's search (an mctx batch of one: the episode draws its noise from its own
    key): the state it selects, the improved policy f32 [A]."""
    one = functools.partial(jax.tree.map, lambda x: x[None])
    out = gumbel.policy(
      params, one(embedding), one(table), one(state), key, limit, config, env_config, batched=True
    )
    # The selected child is always visited: its state is in the tree (no second environment step to
    # compile).
    tree = out.search_tree
    chosen = tree.children_index[0, tree.ROOT_INDEX, out.action[0]]
    return jax.tree.map(lambda x: x[0, chosen], tree.embeddings), out.action_weights[0]

  def body(states: State, step_keys: jax.Array):
    after, policy = jax.vmap(search)(embeddings, tables, states, step_keys)
    record = (
      features(tables, states),
      policy,
      ~(states.terminated | states.truncated),
      states.objective,
    )
    return after, record

  chex.assert_shape(keys, (None, problems.shape[0]))
  last, (observed, policy, active, objective) = jax.lax.scan(body, starts, keys)
  value = jnp.log(objective) - jnp.log(last.objective)[None]
  samples = Samples(
    problem=jnp.broadcast_to(problems, active.shape), features=observed, policy=policy, value=value
  )
  return Episodes(
    samples=samples, active=active, final=last.objective, steps=active.sum(axis=0, dtype=jnp.int32)
  )


def score(suite: Suite, problems: jax.Array, objective: jax.Array) -> jax.Array:
  """The return of plans of objective `objective` f32 [B] on `problems` int32 [B]:
  `log(best expert / plan)`, f32 [B] (positive: better than every expert)."""
  return jnp.log(suite.best[problems]) - jnp.log(objective)
