"""Imitation of teacher plans: the samples a training run learns from before self-play.

Two teachers. A teacher plan (a train case's best-known plan, found by long searches) is replayed in
the
self-play environment from the case's root state as the actions that reach it: the
pipeline option that matches its pipeline (none: the first option), one action per
decision, then `stop`. Each step gives one sample whose policy target is the teacher's
action (one-hot) and whose value target is `log(objective now / objective of the teacher's
plan)`, the targets self-play gives its own episodes (`agents.selfplay.Samples`). An action
the environment does not allow there (a decision an earlier one already covers, a
dimension that no longer divides) is left out; the episode's step limit cuts long plans.

A climb (`climb_samples`) teaches what to do at the experts' plans, where the learned
agent starts greedy paths: from each expert plan of a case that fits and that the
environment holds, every legal action is priced by the environment (a one-step lookahead
on the simulator), the best one taken while it lowers the objective, then `stop`; each
step is a sample whose policy target is that action and whose value target is
`log(objective now / objective where the climb ends)`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from agents import base
from agents.network import state_features
from agents.selfplay import Samples, Suite
from automap_rl import sharding, tactics
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from envs import EnvConfig, actions, core, pipelines
from envs.tables import EnvTables


def teacher_actions(
  problem: Problem,
  config: EnvConfig,
  tables: EnvTables,
  decisions: Sequence[sharding.Decision],
  pipeline: Pipeline | None,
) -> list[int] | None:
  """The action ids that take `config`'s environment (its `tables` as the suite holds them,
  padded) from the root to the plan `decisions` + `pipeline`, `stop` last; None when the
  environment cannot choose that pipeline."""
  menu = pipelines.menu(problem, config.pipelines)
  out = []
  if menu:
    if pipeline not in menu:
      return None
    out.append(tables.num_moves + menu.index(pipeline))
  elif pipeline is not None:
    return None
  index = {
    frozenset(t.classes): i for i, t in enumerate(actions.targets(problem, config.action_space))
  }
  axes = problem.mesh.axis_names
  for decision in decisions:
    target = index.get(
      frozenset(sharding.classes_of(decision.target, problem.program, problem.named))
    )
    if target is not None and decision.axis in axes:
      out.append(target * config.max_axes + axes.index(decision.axis))
  return out + [tables.num_actions - 1]


def teacher_plans(
  problems: Sequence[Problem],
  plans: Sequence[tuple[list[sharding.Decision], Pipeline | None] | None],
  suite: Suite,
  config: EnvConfig,
) -> list[tuple[int, list[int]]]:
  """(suite index, `teacher_actions`) of each problem of `suite` whose plan (`plans`, None:
  none) the environment can reach."""
  out = []
  for i, (problem, plan) in enumerate(zip(problems, plans, strict=True)):
    if plan is not None:
      actions = teacher_actions(
        problem, config, jax.tree.map(lambda x, i=i: x[i], suite.tables), *plan
      )
      if actions is not None:
        out.append((i, actions))
  return out


@functools.partial(jax.jit, static_argnames="config")
def _replay(
  config: EnvConfig, tables: EnvTables, root: core.State, action_ids: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, chex.ArrayTree]:
  """Steps `action_ids` (int32 [L], -1 padding) from `root`, skipping illegal ones: per
  step whether it was taken (bool [L]), the objective before it (f32 [L]), the objective
  after the last (f32 []) and the state features before it ([L, ...])."""

  def body(state: core.State, action: jax.Array):
    taken = (
      (action >= 0)
      & state.legal_action_mask[jnp.maximum(action, 0)]
      & ~(state.terminated | state.truncated)
    )
    after = core.step(config, tables, state, jnp.maximum(action, 0))
    record = (taken, state.objective, state_features(tables, state))
    return jax.tree.map(lambda new, old: jnp.where(taken, new, old), after, state), record

  last, (taken, objective, features) = jax.lax.scan(body, root, action_ids)
  return taken, objective, last.objective, features


def teacher_samples(
  suite: Suite, config: EnvConfig, plans: Sequence[tuple[int, Sequence[int]]]
) -> Samples:
  """The samples of replaying each (suite index, `teacher_actions`) of `plans` from its
  root, the steps the environment took, in order: leaves [N, ...] (numpy)."""
  length = max(len(a) for _, a in plans)
  rows = []
  for p, action_ids in plans:
    tables, root = (
      jax.tree.map(lambda x: x[p], suite.tables),
      jax.tree.map(lambda x: x[p], suite.roots),
    )
    padded = jnp.asarray(list(action_ids) + [-1] * (length - len(action_ids)), jnp.int32)
    taken, objective, final, features = jax.device_get(_replay(config, tables, root, padded))
    policy = np.eye(tables.num_actions, dtype=np.float32)[np.maximum(np.asarray(padded), 0)]
    sample = Samples(
      problem=np.full(length, p, np.int32),
      features=features,
      policy=policy,
      value=(np.log(objective) - np.log(final)).astype(np.float32),
    )
    rows.append(jax.tree.map(lambda x, taken=taken: np.asarray(x)[taken], sample))
  return jax.tree.map(lambda *x: np.concatenate(x), *rows)


# A climb's step must lower the objective by more than this fraction: float noise is not a
# refinement.
CLIMB_TOLERANCE = 1e-4


@functools.partial(jax.jit, static_argnames="config")
def _climb(
  config: EnvConfig, tables: EnvTables, start: core.State
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, chex.ArrayTree]:
  """Climbs from `start` for `config.max_steps` steps: per step whether the climb was still
  going (bool [L]), its action (the best legal one by the stepped objective, or `stop` when
  none lowers it; int32 [L]), the objective before it (f32 [L]), the objective where the
  climb ends (f32 []) and the state features before it ([L, ...])."""
  stop = tables.num_actions - 1
  every = jnp.arange(tables.num_actions, dtype=jnp.int32)

  def body(carry: tuple[core.State, jax.Array], _):
    state, going = carry
    going = going & ~(state.terminated | state.truncated)
    children = jax.vmap(lambda a: core.step(config, tables, state, a))(every)
    priced = jnp.where(state.legal_action_mask & (every != stop), children.objective, jnp.inf)
    best = jnp.argmin(priced)
    improves = priced[best] < state.objective * (1 - CLIMB_TOLERANCE)
    record = (
      going,
      jnp.where(improves, best, stop),
      state.objective,
      state_features(tables, state),
    )
    child = jax.tree.map(lambda x: x[best], children)
    moved = going & improves
    return (jax.tree.map(lambda new, old: jnp.where(moved, new, old), child, state), moved), record

  (last, _), (going, action, objective, features) = jax.lax.scan(
    body, (start, jnp.bool_(True)), None, length=config.max_steps
  )
  return going, action, objective, last.objective, features


def climb_samples(
  problems: Sequence[Problem], suite: Suite, config: EnvConfig
) -> tuple[Samples, int]:
  """The samples of a climb (`_climb`) from each expert plan that fits of each of
  `problems` (the suite's, in order) that `config`'s environment holds: leaves [N, ...]
  (numpy), and how many climbs there were. `config.max_steps` bounds each climb."""
  if config.max_steps is None:
    raise ValueError("climb_samples needs an environment with max_steps")
  rows, climbs = [], 0
  for p, problem in enumerate(problems):
    tables = jax.tree.map(lambda x, p=p: x[p], suite.tables)
    for expert in tactics.expert_plans(problem):
      if not expert.fits or not expert.decisions:
        continue
      start = base.plan_state(problem, config, tables, expert.decisions, expert.cost)
      if start is None:
        continue
      going, action, objective, final, features = jax.device_get(_climb(config, tables, start))
      climbs += 1
      policy = np.eye(tables.num_actions, dtype=np.float32)[action]
      sample = Samples(
        problem=np.full(len(action), p, np.int32),
        features=features,
        policy=policy,
        value=(np.log(objective) - np.log(final)).astype(np.float32),
      )
      rows.append(jax.tree.map(lambda x, going=going: np.asarray(x)[going], sample))
  if not rows:
    raise ValueError(
      "no expert plan of the suite's problems fits and is held by the environment: nothing to "
      "climb from"
    )
  return jax.tree.map(lambda *x: np.concatenate(x), *rows), climbs
