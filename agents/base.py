"""What every search agent shares: budgets, results, traces and the jitted environment calls.

An agent is a frozen config dataclass plus `search(problem, config, seed, budget)`, which
returns a `SearchResult`. Agents search over the pure environment of `envs` (actions are
targets x mesh axes, plus stop); the objective is the environment's: simulated step time
(with the memory-overflow penalty) relative to the replicated plan, lower is better.

A *simulation* is one evaluation of a plan by the simulator (one environment step that
changes the plan), counted the same way for every agent, so agents compare at equal
budgets. Every plan an agent visits is a candidate: stopping is implicit (the best plan
seen on any path, at any depth, is kept).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from automap_rl import simulator
from automap_rl.batching import next_power_of_two
from automap_rl.compile_options import SearchJit
from automap_rl.pipeline import Pipeline
from automap_rl.problem import Problem
from automap_rl.sharding import Decision
from envs import Env, EnvConfig, State, core
from envs.tables import BASE_STEP_TIME, EnvTables, replicated_base
from envs.tables import objective as env_objective

Progress = Callable[[int, float], None]  # (simulations so far, best step time so far in s).


@dataclasses.dataclass(frozen=True)
class Budget:
  """How much an agent may search: simulator evaluations and/or wall-clock seconds.

  The search ends when either limit is reached. The simulation limit is never exceeded;
  the seconds limit is checked between batches (and includes building the environment
  and compiling its functions). Only a simulations budget is reproducible.
  """

  simulations: int | None = None
  seconds: float | None = None

  def __post_init__(self):
    if self.simulations is None and self.seconds is None:
      raise ValueError("A budget needs simulations or seconds.")
    if self.simulations is not None and self.simulations < 1:
      raise ValueError(
        f"a budget of {self.simulations} simulations searches nothing; give at least 1 "
        "(or use an expert tactic)."
      )
    if self.seconds is not None and not self.seconds > 0:
      raise ValueError(f"a budget of {self.seconds} seconds searches nothing; give more than 0.")

  @classmethod
  def of(cls, budget: Budget | int | str) -> Budget:
    """A `Budget` from one with explicit units (`Simulations(2000)`, `Seconds(30)`), an
    integer (simulations, numpy integers included) or a string (`"2000"`, `"30s"`). A float
    is refused: `500.0` could mean either unit."""
    if isinstance(budget, Budget):
      return budget
    if isinstance(budget, str):
      try:
        return (
          cls(seconds=float(budget[:-1])) if budget.endswith("s") else cls(simulations=int(budget))
        )
      except ValueError as e:
        if "searches nothing" in str(e):
          raise
        raise ValueError(
          f"bad budget {budget!r}: expected simulator evaluations (2000) or seconds (30s)."
        ) from None
    if isinstance(budget, (int, np.integer)) and not isinstance(budget, (bool, np.bool_)):
      return cls(simulations=int(budget))
    raise TypeError(
      f"a budget of {budget!r} ({type(budget).__name__}) has no unit: pass Simulations(n), "
      "Seconds(s), an int (simulations) or a string ('2000', '30s')."
    )

  def after(self, seconds: float) -> Budget | None:
    """What is left of this budget after `seconds` of work before the search: the same
    simulations, `seconds` fewer seconds; None when that leaves no seconds. A budget's
    seconds count from the start of the call it is given to: a caller that traces and
    builds the problem before running an agent (`agents.partition`) gives the agent what
    is left, so one deadline, set when that call started, bounds all of it."""
    if self.seconds is None:
      return self
    left = self.seconds - seconds
    return dataclasses.replace(self, seconds=left) if left > 0 else None

  def left(self, simulations: int) -> int:
    """Simulations still allowed (a large number when only seconds bound the search)."""
    return (1 << 40) if self.simulations is None else max(self.simulations - simulations, 0)

  def done(self, simulations: int, elapsed: float) -> bool:
    return self.left(simulations) <= 0 or (self.seconds is not None and elapsed >= self.seconds)


def Simulations(count: int) -> Budget:  # noqa: N802 (reads as a unit: budget=Simulations(2000))
  """A budget of `count` simulator evaluations (reproducible for a seed)."""
  return Budget(simulations=int(count))


def Seconds(seconds: float) -> Budget:  # noqa: N802 (reads as a unit: budget=Seconds(30))
  """A budget of `seconds` of wall-clock time (environment building included)."""
  return Budget(seconds=float(seconds))


@dataclasses.dataclass(frozen=True)
class TracePoint:
  """The best plan so far, after `simulations` evaluations and `seconds` of search."""

  simulations: int
  seconds: float
  step_time: float
  objective: float


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """What a search found.

  Attributes:
    decisions: the best plan, one `Decision` per action (targets as the environment
      names them: `ArgDim`, `Group` or named-dimension id).
    cost: the simulator's cost of the plan (`Problem.plan_cost`).
    trace: the best plan's step time after each improvement (first point: replicated).
    simulations: simulator evaluations used.
    seconds: wall-clock seconds, environment build and compiles included.
    actions: the plan as readable actions (`shard group 8 (batch/inputs:0, x1) on data`).
    action_ids: the plan as the environment's encoded actions (`target * max_axes + axis`),
      how plans travel between agents, training and evaluation: replaying them through
      the same environment from `start` reproduces the plan.
    objective: the environment objective of the plan (1.0 is the replicated plan).
    setup_seconds: of `seconds`, how many went to building the environment and compiling.
    pipeline: the plan's pipeline stages (`decisions` apply inside every stage; `cost` is
      then `Problem.plan_cost(decisions, pipeline)`), or None.
    stopped_by: the limit that ended the search early (`simulations`, `seconds` or,
      for an agent with a memory ceiling, `memory`), or None when the agent does not say
      or searched its whole space.
    lower_bound: a proven lower bound on the step time (seconds) of every plan in the
      space the agent searched, for agents that prove one (the ILP: its strategy graph's
      plans, priced without collective combining), else None.
    greedy_steps: plans evaluated on a policy's greedy path (`agents.learned`), outside
      the budget: that path always completes, and the budget buys search beyond it.
    start: the expert tactic whose plan the actions refine (`Searcher.rooted_at`;
      `decisions` begin with its plan), None when they start from the replicated plan.
  """

  decisions: list[Decision]
  cost: simulator.Cost
  trace: list[TracePoint]
  simulations: int
  seconds: float
  actions: list[str]
  objective: float
  setup_seconds: float = 0.0
  action_ids: tuple[int, ...] = ()
  pipeline: Pipeline | None = None
  stopped_by: str | None = None
  lower_bound: float | None = None
  greedy_steps: int = 0
  start: str | None = None

  @property
  def step_time(self) -> float:
    return float(self.cost.step_time)

  def trace_dicts(self) -> list[dict]:
    return [dataclasses.asdict(p) for p in self.trace]


def env_config(
  problem: Problem, action_space: str, max_decisions: int, pipelines: int = 0
) -> EnvConfig:
  """The environment an agent searches: exactly the mesh's axes (no padded actions), and
  `pipelines` pipeline options (`EnvConfig.pipelines`)."""
  return EnvConfig(
    action_space=action_space,
    max_decisions=max_decisions,
    max_axes=len(problem.mesh.axis_sizes),
    objective="time",
    pipelines=pipelines,
  )


def plan_objective(problem: Problem, cost: simulator.Cost) -> float:
  """The environment's objective of a plan's cost (1.0 is the replicated plan), for agents
  that price plans outside the environment."""
  config = env_config(problem, "named_dims", 1)
  if (
    problem not in _REPLICATED_BASES
  ):  # The replicated plan simulated once per problem, not per plan priced.
    _REPLICATED_BASES[problem] = replicated_base(config, problem)
  return float(env_objective(config, cost, _REPLICATED_BASES[problem], problem.tables.hbm_bytes))


_REPLICATED_BASES: weakref.WeakKeyDictionary[Problem, np.ndarray] = weakref.WeakKeyDictionary()


def rollout(
  config: EnvConfig,
  tables: EnvTables,
  depth: int,
  stop_probability: float,
  state: State,
  key: jax.Array,
  limit: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """A uniformly random episode of at most `min(depth, limit)` steps from `state` of the
  environment of `config` and `tables`. Pure.

  After its first step the episode stops with probability `stop_probability` per step
  (and when no action but stop is legal).

  Returns:
    actions int32 [depth], objectives f32 [depth], step times f32 [depth] after each
    step, and `evaluated` bool [depth]: whether that step evaluated a new plan (counts
    as a simulation; after a stop nothing changes).
  """

  def body(carry, index):
    state, key, alive = carry
    key, pick, coin = jax.random.split(key, 3)
    legal = state.legal_action_mask.at[-1].set(False)
    action = jax.random.categorical(pick, jnp.where(legal, 0.0, -jnp.inf)).astype(jnp.int32)
    stop = (
      ~alive
      | ~legal.any()
      | (index >= limit)
      | (state.terminated | state.truncated)
      | ((index > 0) & (jax.random.uniform(coin) < stop_probability))
    )
    action = jnp.where(stop, tables.num_actions - 1, action)
    new = core.step(config, tables, state, action)
    return (new, key, alive & ~stop), (action, new.objective, new.step_time, ~stop)

  _, out = jax.lax.scan(body, (state, key, jnp.bool_(True)), jnp.arange(depth))
  return out


@functools.partial(SearchJit, calls="many", static_argnames=("config", "depth", "stop_probability"))
def _rollouts(
  config: EnvConfig,
  tables: EnvTables,
  depth: int,
  stop_probability: float,
  state: State,
  keys: jax.Array,
  limits: jax.Array,
):
  """`rollout` from `state` with each of `keys` [R] and `limits` [R]."""
  one = functools.partial(rollout, config, tables, depth, stop_probability, state)
  return jax.vmap(one)(keys, limits)


_init = SearchJit(core.init, "few", static_argnames="config")


@functools.partial(SearchJit, calls="many", static_argnames="config")
def _children(config: EnvConfig, tables: EnvTables, state: State, actions: jax.Array) -> State:
  """The states after each of `actions` [N] from `state`, [N]."""
  return jax.vmap(functools.partial(core.step, config, tables, state))(actions)


_from_plan = SearchJit(core.from_plan, "few", static_argnames="config")


def plan_state(
  problem: Problem,
  config: EnvConfig,
  tables: EnvTables,
  decisions: Sequence[Decision],
  cost: simulator.Cost,
) -> State | None:
  """The environment state (host arrays) of the intra-op plan `decisions` of `problem`,
  priced at `cost` (`Problem.cost`), on `tables`: the problem's own or its row of a suite's
  bucket-padded tables (the plan's masks are padded to theirs). None when the plan takes
  more class decisions than the environment holds (`config.max_decisions`)."""
  dec_class, dec_axis = problem.encode(decisions)
  size = config.max_decisions
  if len(dec_class) > size:
    return None
  resolution = problem.resolution(decisions)
  pad = lambda x: np.concatenate([x, np.full(size - len(x), -1, np.int32)])
  value_mask, op_mask = (
    np.pad(m, [(0, want - have) for have, want in zip(m.shape, like.shape)])
    for m, like in (
      (resolution.value_mask, tables.value_class),
      (resolution.op_mask, tables.op_class),
    )
  )
  return jax.device_get(
    _from_plan(config, tables, pad(dec_class), pad(dec_axis), value_mask, op_mask, cost)
  )


class Searcher:
  """An `Env` over a problem with the jitted calls agents need, built once per
  (problem, environment config) and cached (see `searcher`).

  Host-side states are numpy pytrees (`State` of numpy arrays); every call takes and
  returns them, so a search tree holds plain numpy. Searches start at `root`: the
  replicated plan, or a plan made elsewhere (`rooted_at`), whose decisions (`prefix`)
  then begin every plan found.
  """

  prefix: tuple[Decision, ...] = ()
  start: str | None = None

  def __init__(self, problem: Problem, config: EnvConfig):
    self.problem = problem
    self.env = Env.build(problem, config, bucket=True)
    self.root: State = jax.device_get(_init(config, self.env.tables, jax.random.key(0)))
    self.chunk = min(next_power_of_two(self.env.num_actions - 1, 8), 32)

  @property
  def num_actions(self) -> int:
    return self.env.num_actions

  @property
  def base_step_time(self) -> float:
    return float(self.env.tables.base[BASE_STEP_TIME])

  def children(self, state: State, actions: Sequence[int]) -> State:
    """The states after each of `actions` from `state`, batched (numpy). Evaluated in
    vmapped chunks of one fixed size (`chunk`, so one compile); padding takes the stop
    action and is dropped."""
    n, size = len(actions), self.chunk
    padded = np.full(-(-n // size) * size, self.env.stop_action, np.int32)
    padded[:n] = actions
    config, tables = self.env.config, self.env.tables
    parts = [
      jax.device_get(_children(config, tables, state, padded[i : i + size]))
      for i in range(0, len(padded), size)
    ]
    return jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *parts)

  def rollouts(
    self, state: State, keys: jax.Array, limits: np.ndarray, depth: int, stop_probability: float
  ):
    """`len(keys)` random episodes from `state` (see `rollout`), as numpy arrays [R, depth]."""
    limits = jnp.asarray(limits, jnp.int32)
    return jax.device_get(
      _rollouts(self.env.config, self.env.tables, depth, stop_probability, state, keys, limits)
    )

  def rooted_at(
    self, name: str, decisions: Sequence[Decision], cost: simulator.Cost
  ) -> Searcher | None:
    """This searcher with its root at the intra-op plan `decisions` (an expert tactic's,
    called `name`, of cost `cost`: `Problem.cost`), so that a search refines that plan
    rather than build one from the replicated plan: the plan of actions from it is
    `decisions` and then theirs. None when the plan takes more class decisions than the
    environment holds."""
    root = plan_state(self.problem, self.env.config, self.env.tables, decisions, cost)
    if root is None:
      return None
    view = self.holding(name, decisions)
    view.root = root
    return view

  def holding(self, name: str, decisions: Sequence[Decision]) -> Searcher:
    """This searcher with the plan of no actions `decisions` (an expert tactic's, called
    `name`) but its root unchanged: for a plan `rooted_at` cannot hold (more class
    decisions than the environment does), offered as a candidate and never searched from."""
    view = copy.copy(self)
    view.prefix, view.start = tuple(decisions), name
    return view

  def decisions(self, actions: Sequence[int]) -> list[Decision]:
    """The intra-op plan of an action sequence from the root: `prefix`, then one
    `Decision(target, axis)` per intra-op action (a pipeline action is `pipeline`'s)."""
    axes = self.problem.mesh.axis_names
    out = list(self.prefix)
    for a in actions:
      if int(a) < self.env.tables.num_moves:
        target, axis = divmod(int(a), self.env.config.max_axes)
        out.append(Decision(self.env.targets[target].target, axes[axis]))
    return out

  def pipeline(self, actions: Sequence[int]) -> Pipeline | None:
    """The pipeline an action sequence chooses, None for none (`Env.pipeline_of`)."""
    return self.env.pipeline_of(actions)

  def cost(self, actions: Sequence[int]) -> simulator.Cost | simulator.PipelineCost:
    """The simulator's cost of the plan an action sequence reaches (`Problem.plan_cost`)."""
    return self.problem.plan_cost(self.decisions(actions), self.pipeline(actions))

  def legal(self, state: State) -> np.ndarray:
    """Legal actions of a host state, stop excluded, int32."""
    if bool(state.terminated) or bool(state.truncated):
      return np.zeros(0, np.int32)
    return np.flatnonzero(np.asarray(state.legal_action_mask)[:-1]).astype(np.int32)


@functools.lru_cache(maxsize=16)
def searcher(problem: Problem, config: EnvConfig) -> Searcher:
  """The cached `Searcher` of a problem (problems hash by identity)."""
  return Searcher(problem, config)


def release() -> None:
  """Drops every cached searcher and jax's compiled executables: a loop over many problems
  (a benchmark over the task suite) calls it between problems to keep its memory flat."""
  searcher.cache_clear()
  jax.clear_caches()


class Tracker:
  """Keeps the best action sequence, the simulation count, the clock and the trace.

  Offered action sequences start at `search`'s root; an agent that searches from several
  roots (`Searcher.rooted_at`) sets `search` to each before offering its plans, and the
  best plan keeps the searcher it came from."""

  def __init__(self, search: Searcher, budget: Budget, start: float, progress: Progress | None):
    self.search, self.budget, self.start, self.progress = search, budget, start, progress
    self.best_search = search
    self.simulations = 0
    self.greedy_steps = (
      0  # Plans of a greedy path, outside the budget (`SearchResult.greedy_steps`).
    )
    self.best_objective = 1.0
    self.best_step_time = search.base_step_time
    self.best_actions: list[int] = []
    self.setup_seconds = time.perf_counter() - start
    self.trace = [TracePoint(0, self.elapsed, self.best_step_time, 1.0)]

  @property
  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  @property
  def left(self) -> int:
    return self.budget.left(self.simulations)

  @property
  def done(self) -> bool:
    return self.budget.done(self.simulations, self.elapsed)

  def count(self, simulations: int) -> None:
    self.simulations += int(simulations)
    if self.progress is not None:
      self.progress(self.simulations, self.best_step_time)

  def offer(
    self,
    objective: float,
    step_time: float,
    actions: Sequence[int],
    simulations_at: int | None = None,
  ) -> bool:
    """Records a plan if it is the best so far (ties keep the shorter/earlier plan)."""
    if not objective < self.best_objective - 1e-7 * abs(self.best_objective):
      return False
    self.best_objective, self.best_step_time = float(objective), float(step_time)
    self.best_actions = [int(a) for a in actions]
    self.best_search = self.search
    at = self.simulations if simulations_at is None else simulations_at
    self.trace.append(TracePoint(at, self.elapsed, self.best_step_time, self.best_objective))
    return True

  def result(self) -> SearchResult:
    search = self.best_search
    decisions = search.decisions(self.best_actions)
    cost = search.cost(self.best_actions)
    names = [search.env.action_name(a) for a in self.best_actions]
    if search.start is not None:
      names.insert(0, f"start from the {search.start} plan")
    seconds = self.elapsed
    self.trace.append(
      TracePoint(self.simulations, seconds, self.best_step_time, self.best_objective)
    )
    return SearchResult(
      decisions=decisions,
      cost=cost,
      trace=self.trace,
      simulations=self.simulations,
      seconds=seconds,
      actions=names,
      objective=self.best_objective,
      setup_seconds=self.setup_seconds,
      action_ids=tuple(self.best_actions),
      pipeline=search.pipeline(self.best_actions),
      greedy_steps=self.greedy_steps,
      start=search.start,
    )


def start(
  problem: Problem,
  action_space: str,
  max_decisions: int,
  budget,
  progress: Progress | None,
  pipelines: int = 0,
) -> tuple[Searcher, Tracker, Budget]:
  """Builds (or reuses) the searcher and starts the clock; the common prologue of agents."""
  t0 = time.perf_counter()
  budget = Budget.of(budget)
  search = searcher(problem, env_config(problem, action_space, max_decisions, pipelines))
  return search, Tracker(search, budget, t0, progress), budget


def row(batch, i: int):
  """Entry `i` of a batched pytree."""
  return jax.tree.map(lambda x: x[i], batch)


def value(objective: float) -> float:
  """Search value of a plan: -log(objective), 0 for the replicated plan, higher is better."""
  return -math.log(max(float(objective), 1e-30))
