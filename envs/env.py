"""`Env`: one program on one mesh, with the static tables held outside the state."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import chex
import jax
import jraph
import numpy as np

from automap_rl import sharding
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from envs import actions, core, observe, pipelines, tables
from envs.config import EnvConfig


@dataclasses.dataclass(frozen=True, eq=False)
class Env:
  """A partitioning environment with pure, jittable, vmappable methods.

  Attributes:
    config: the action space, capacity and objective.
    problem: the program on its mesh.
    targets: the decision targets; action `t * config.max_axes + a` shards `targets[t]`
      over mesh axis `a`, action `num_actions - 1` stops.
    tables: the static arrays (see `envs.tables`), exact-size or bucketed.
    pipelines: the pipeline options (`envs.pipelines.menu`; None: no pipeline), empty
      without them; action `tables.num_moves + k` chooses option k.
  """

  config: EnvConfig
  problem: Problem
  targets: tuple[actions.Target, ...]
  tables: tables.EnvTables
  pipelines: tuple[Pipeline | None, ...] = ()

  @classmethod
  def build(cls, problem: Problem, config: EnvConfig = EnvConfig(), bucket: bool = False) -> Env:
    """Builds the tables; `bucket` pads them to their buckets (see `tables.bucket_sizes`)."""
    targets = actions.targets(problem, config.action_space)
    if not targets:
      raise ValueError(
        f"{problem.program.num_ops}-op program has no {config.action_space} targets."
      )
    t = tables.build_env_tables(problem, config, targets)
    if bucket:
      t = tables.pad(t, tables.bucket_sizes(tables.sizes(t)))
    return cls(config, problem, targets, t, pipelines.menu(problem, config.pipelines))

  @property
  def num_actions(self) -> int:
    return self.tables.num_actions

  @property
  def stop_action(self) -> int:
    return self.num_actions - 1

  def init(self, key: chex.PRNGKey) -> core.State:
    return core.init(self.config, self.tables, key)

  def step(self, state: core.State, action: jax.Array) -> core.State:
    return core.step(self.config, self.tables, state, action)

  def observe(self, state: core.State) -> jraph.GraphsTuple:
    return observe.observe(self.tables, state)

  def action_name(self, action: int) -> str:
    """`shard <target> on <axis>`, a pipeline option or `stop`."""
    if action == self.stop_action:
      return "stop"
    if action >= self.tables.num_moves:
      option = int(action) - self.tables.num_moves
      return (
        pipelines.describe(self.pipelines[option])
        if option < len(self.pipelines)
        else f"padding action {action}"
      )
    target, axis = divmod(int(action), self.config.max_axes)
    axes = self.problem.mesh.axis_names
    if target >= len(self.targets) or axis >= len(axes):
      return f"padding action {action}"
    return f"shard {self.targets[target].name} on {axes[axis]}"

  def decisions(self, state: core.State) -> list[sharding.Decision]:
    """The plan of an (unbatched) state as class decisions, for `Problem.cost` and lowering."""
    dec_class, dec_axis = np.asarray(state.dec_class), np.asarray(state.dec_axis)
    names = self.problem.mesh.axis_names
    return [sharding.Decision(int(c), names[int(a)]) for c, a in zip(dec_class, dec_axis) if c >= 0]

  def pipeline(self, state: core.State) -> Pipeline | None:
    """The pipeline an (unbatched) state chose, None for none (or none chosen yet)."""
    option = int(state.pipeline)
    return self.pipelines[option] if option > 0 else None

  def pipeline_of(self, action_ids: Sequence[int]) -> Pipeline | None:
    """The pipeline an action sequence from the start chooses (its pipeline action), None for
    none."""
    options = [
      int(a) - self.tables.num_moves
      for a in action_ids
      if self.tables.num_moves <= int(a) < self.stop_action
    ]
    return self.pipelines[options[0]] if options and options[0] > 0 else None
