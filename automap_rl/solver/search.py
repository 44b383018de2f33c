"""One search of the solver: pricing rounds with crossovers, then the whole MIP or
large-neighbourhood search (the stages `solve` describes), on a reduced problem.

`Search` runs in the calling process or in a forked worker (`supervise`); a `WorkerRole`
sets its price schedule, and an `Outcome` is what it ends with.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from automap_rl.solver.dual import Dual
from automap_rl.solver.forest import ForestMoves
from automap_rl.solver.graph import StrategyGraph
from automap_rl.solver.limits import LimitReached, Limits
from automap_rl.solver.local import GroupPlan, GroupPlanBuilder, Layout
from automap_rl.solver.memory import Memory
from automap_rl.solver.mip import chosen_pair_costs, group_cost, recombine, reoptimize
from automap_rl.solver.reduce import Reduced

if TYPE_CHECKING:
  from automap_rl.solver.supervise import SharedBest

__all__ = ["ROLES", "Outcome", "Problem", "Progress", "Search", "WorkerRole", "next_prices"]

Progress = Callable[[float, float, str], None]

# A problem whose whole MIP has at most this many pair-cost entries is solved
# whole in the polish stage; larger ones get large-neighbourhood search.
_WHOLE_MIP_ENTRIES = 150_000
# The share of the time left after pricing that the whole MIP of a small problem gets (G
# under a loaded machine: a quarter left it 0.2% above its bound, stopped, and the
# neighbourhoods after it found nothing in 20 steps).
_WHOLE_MIP_SHARE = 0.6
# Small problems leave pricing for the whole MIP after this many rounds
# without a better plan.
_SMALL_PATIENCE = 150
# Small problems also build a plan within a usage budget every this many rounds.
_SMALL_BUDGET_EVERY = 16
# The first crossover's time limit, doubled (up to a third of the time left) after each one
# the limit stopped: the LP relaxation of T's first merge (9,448 groups) takes 4-5 s on a
# loaded machine, and stopped early a merge gains nothing.
_CROSSOVER_SECONDS = 4.0
# Crossovers wait until a decoded plan has fitted within the limit, or for this many rounds:
# the first plans of a problem whose limit binds hard (K: 12x over it unpriced; R's first
# budgeted plan at 7.8x the contest's best) are too far from it for a crossover to help, and
# each one takes seconds of the rounds that find a plan that fits.
_CROSSOVER_AFTER = 24
# Switches a repair of a plan over the limit may take before it gives up.
_REPAIR_SWITCHES = 400
# A polish stops after a pass of single switches and two-group moves that gains less than this
# share of the plan's cost (on R, the last six of ten passes gained 0.1% in 5 of 10 s).
_POLISH_MIN_GAIN = 1e-4
# Pricing rounds between two Lagrangian bounds (one pass over the pair costs each).
_BOUND_EVERY = 8
# Prices stop rising at this multiple of the base price (about the cost per unit of
# capacity): memory then outweighs every cost, and a segment no plan fits keeps a finite
# price (rising 1.5x a round, prices overflowed to inf after about 1,750 rounds, and
# `inf - inf` made the dual's messages NaN).
_MAX_PRICE = 1e12
# A crossover merges the best plan with up to this many plans decoded since the last one (the
# cheapest; `Search.crossover` adapts how many, and merges once that many are kept): at 60 s
# on the 2-core machine, one process, load 2-3, R ended at 1.12 of the contest's best with 8
# plans every 8 rounds against 1.18 with one every 2, N at 1.19 against 1.25
# (docs/experiments/iopddl-merges.md).
_MAX_PARENTS = 8
# The plans the first crossover merges with the best (then adapted, `Search.crossover`): under
# a load of 6-7 on the 2 cores, R's first merges of 8 plans (4,000 differing groups each) ran
# past their 4 s limit and gained nothing, and R ended at 1.95 of the contest's best at 60 s
# (1.41 starting from 2).
_FIRST_PARENTS = 2
# A large problem's pricing ends once this many crossovers in a row, and this share of the
# search's time, have passed without a better plan: V (342 groups) found nothing in 42 s of
# pricing after its tenth second, and its neighbourhoods gained 12% in 3 s.
_STALL_CROSSOVERS = 8
_STALL_SHARE = 0.15
# The share of a large problem's time its neighbourhoods get at least (pricing ends earlier
# when it stalls); they begin with forest moves on the best plan (N: 1.077 of the contest's
# best with 5% of 180 s, 1.070 with 25%; R 0.966 either way).
_NEIGHBOURHOOD_SHARE = 0.25
# Forest moves (`forest.ForestMoves.descend`) on a plan stop after this many in a row gain less
# than `_POLISH_MIN_GAIN` each (N: 0.12 s a move; from a plan at 1.12 of the contest's best,
# 1.086 after one move, 1.068 after 15, nothing more in the next 20; R: 0.32 s a move).
_FOREST_PATIENCE = 2


@dataclasses.dataclass(frozen=True)
class WorkerRole:
  """What one search spends its time on.

  Attributes:
    price_rise: factor on a segment's price where the decoded plan breaks the limit.
    price_fall: factor on it where 1% of the segment's capacity is left.
    repair_until_fitted: until a decoded plan fits within the limit, repair every fourth
      decoded plan over it that is cheaper than the best (`GroupPlan.repair`, then descent) until
      one repair succeeds: a plan within the limit in seconds when pricing has none yet
      (short timeouts, busy machines; a repair of M takes seconds, so one is enough), kept
      apart from the line's crossovers, which do not improve repaired plans.
    forest_crossovers: polish each crossover's result with forest moves before offering it.
      On N the line then holds plans that no merge of decoded plans reaches (1.128 of the
      contest's best at its limit to 1.052 with it in one line); on R merges from such plans
      take 4x as long (5.3 s against 1.4 s, 13 crossovers in 100 s against 48) and R ended
      at 1.20 with it in both lines, so one line has it (R 0.965).
  """

  price_rise: float = 1.5
  price_fall: float = 0.8
  repair_until_fitted: bool = False
  forest_crossovers: bool = False


# The searches' roles by worker number (then round robin); the in-process search takes the first.
# A gentler schedule (1.15 / 0.95) decodes cheaper plans within the limit (pricing alone, 250
# rounds: K 1.20 of the contest's best against 1.71, R 1.58 against 3.59) but they fit later,
# and the crossovers that improve M start late: as the first search it left M at 1.35 where
# this one reached 1.005 (60 s, same loaded machine; docs/experiments/iopddl-price-schedule.md).
ROLES = (
  WorkerRole(),
  WorkerRole(price_rise=1.8, price_fall=0.75, repair_until_fitted=True, forest_crossovers=True),
)


def next_prices(
  prices: np.ndarray,
  excess: np.ndarray,
  capacity: np.ndarray,
  base: float,
  role: WorkerRole = WorkerRole(),
) -> np.ndarray:
  """The pricing round's update of the per-segment prices [S]: `role.price_rise` times (at
  least `base`) where the plan's usage `excess` [S] breaks the limit, up to
  `_MAX_PRICE * base`; `role.price_fall` times where 1% of `capacity` [S] is left;
  unchanged elsewhere."""
  rising = np.minimum(np.maximum(prices * role.price_rise, base), _MAX_PRICE * base)
  return np.where(
    excess > 0, rising, np.where(excess < -0.01 * capacity, prices * role.price_fall, prices)
  )


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
  """The views of one problem every search shares (built once, before any worker starts)."""

  graph: StrategyGraph
  reduced: Reduced
  memory: Memory
  layout: Layout
  started: float


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one search, or all of them together, ended with.

  Attributes:
    best: [G] cheapest group plan within the limit, or None.
    best_cost: Its cost (inf without one).
    lower_bound: The highest proven lower bound, or None.
    log: Lines of the search's log.
    stopped_by: The limit that stopped it ("seconds" or "memory"), or None.
    limit_error: The `LimitReached` raised before any plan was found, or None.
  """

  best: np.ndarray | None
  best_cost: float
  lower_bound: float | None
  log: tuple[str, ...]
  stopped_by: str | None
  limit_error: LimitReached | None


class Search:
  """State shared by the stages: the problem views, the best plan, the log.

  In worker number `worker`, `channel` carries each better plan to the supervisor and
  `shared` holds the best plan of all searches, met between pricing rounds once the line has
  a decoded plan within the limit (`meet`) and adopted between neighbourhood steps."""

  def __init__(
    self,
    problem: Problem,
    deadline: float,
    seed: int,
    limits: Limits,
    role: WorkerRole = ROLES[0],
    progress: Progress | None = None,
    channel: multiprocessing.connection.Connection | None = None,
    shared: SharedBest | None = None,
    worker: int = 0,
  ):
    self.graph, self.reduced, self.memory, self.layout = (
      problem.graph,
      problem.reduced,
      problem.memory,
      problem.layout,
    )
    self.started, self.deadline, self.limits = problem.started, deadline, limits
    self.progress, self.channel, self.role = progress, channel, role
    self.shared, self.worker, self.seen_version = shared, worker, 0
    self.stopped_by: str | None = None
    self.limit_error: LimitReached | None = None
    self.rng = np.random.default_rng(seed)
    self.seed = seed
    self.log: list[str] = []
    self.best: np.ndarray | None = (
      None  # the best plan of the line: what crossovers and neighbourhoods improve
    )
    self.best_cost = np.inf
    self.spare: np.ndarray | None = (
      None  # a cheaper plan kept apart from the line (a repaired one), or None
    )
    self.spare_cost = np.inf
    self.lower_bound: float | None = None
    self.crossover_seconds = _CROSSOVER_SECONDS
    self.parents = _FIRST_PARENTS
    self.met: np.ndarray | None = None  # another line's best (or this one's, replaced by it)
    self.small = len(self.reduced.pair_costs) <= _WHOLE_MIP_ENTRIES
    self.forests: ForestMoves | None = None  # built at the first forest move

  def elapsed(self) -> float:
    return time.monotonic() - self.started

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def note(self, line: str) -> None:
    self.log.append(f"{self.elapsed():6.2f}s {line}")

  def bound(self, value: float) -> None:
    """Keeps the highest finite lower bound, and reports it at once in a worker (a worker
    killed at the time limit reports no outcome)."""
    if np.isfinite(value) and (self.lower_bound is None or value > self.lower_bound):
      self.lower_bound = float(value)
      if self.channel is not None:
        self.channel.send(("bound", self.lower_bound))

  def offer(self, choice: np.ndarray, stage: str, line: bool = True) -> bool:
    """Keeps `choice` if it is within the limit and cheaper than the line's best or, kept
    apart from the line (`line=False`), than every plan so far; reports it when it is the
    cheapest so far."""
    if np.any(self.memory.excess(choice) > 0):
      return False
    cost = group_cost(self.reduced, choice)
    cheapest = min(self.best_cost, self.spare_cost)
    if cost >= (self.best_cost if line else cheapest):
      return False
    if line:
      self.best, self.best_cost = np.array(choice), cost
    else:
      self.spare, self.spare_cost = np.array(choice), cost
    if cost < cheapest and self.channel is not None:
      self.channel.send(("plan", np.array(choice), cost, stage))
    elif cost < cheapest and self.progress is not None:
      self.progress(self.elapsed(), cost, stage)
    return True

  def meet(self) -> None:
    """Meets the best plan of all searches once another search has found a newer one: takes it
    if it beats this line's best, and keeps the other of the two for the line's next crossover
    to merge with its best (the two lines price differently, so their best plans differ where
    a merge can mix them)."""
    newer = None if self.shared is None else self.shared.newer(self.seen_version, self.worker)
    if newer is None:
      return
    self.seen_version, choice, cost = newer
    if choice is None or self.best is None:
      return
    if cost < self.best_cost:
      self.met, self.best, self.best_cost = self.best, choice, cost
    else:
      self.met = choice

  def adopt(self) -> None:
    """Takes the best plan of all searches if another search found it and it beats this one's."""
    newer = None if self.shared is None else self.shared.newer(self.seen_version, self.worker)
    if newer is not None:
      self.seen_version, choice, cost = newer
      if cost < self.best_cost:
        self.best, self.best_cost = choice, cost

  def outcome(self) -> Outcome:
    best, cost = (
      (self.spare, self.spare_cost)
      if self.spare_cost < self.best_cost
      else (self.best, self.best_cost)
    )
    return Outcome(
      best=best,
      best_cost=cost,
      lower_bound=self.lower_bound,
      log=tuple(self.log),
      stopped_by=self.stopped_by,
      limit_error=self.limit_error if best is None else None,
    )

  def run_guarded(self, warm: np.ndarray | None) -> None:
    """`run`, turning a `LimitReached` into `stopped_by` (or `limit_error` without a plan)."""
    try:
      self.run(warm)
    except LimitReached as e:
      self.stopped_by = e.limit
      if self.best is None and self.spare is None:
        self.limit_error = e
      self.note(f"stopped: {e}")

  def run(self, warm: np.ndarray | None) -> None:
    if warm is not None and self.offer(warm, "warm start"):
      self.note(f"warm start: {self.best_cost:.6g}")
    small = self.small
    self.price(
      until=self.deadline - (0.55 if small else _NEIGHBOURHOOD_SHARE) * max(self.left(), 0.0),
      patience=_SMALL_PATIENCE if small else None,
      budget_every=_SMALL_BUDGET_EVERY if small else None,
    )
    if (
      self.spare_cost < self.best_cost
    ):  # Pricing is over: the stages after it improve the cheapest plan.
      self.best, self.best_cost = self.spare, self.spare_cost
    if self.best is None:
      return
    self.limits.check("starting the whole MIP")
    if small and self.whole_mip(time_limit=_WHOLE_MIP_SHARE * self.left()):
      return
    self.neighbourhoods()

  def price(self, until: float, patience: int | None, budget_every: int | None) -> None:
    """Pricing rounds until `until`, or until `patience` rounds in a row found nothing better
    (without `patience`: until the line stalls, `_Merges.stalled`). Once `self.parents` plans
    were decoded since the last crossover, the best plan is crossed with them; every
    `budget_every` rounds (and until there is a best plan) a plan is also decoded within a
    usage budget (repaired if it overshoots). Once a decoded plan has fitted, a newer best plan
    of another search is met (`meet`): the next crossover merges it and the line's best, the
    cheaper of the two as its base. Adopted outright instead, such a plan left 7 of 9 of K's
    crossovers without gain (a crossover mixes only the line's own decoded plans), and without
    either the trailing line of N gained nothing after its 35th second of 180."""
    reduced, memory = self.reduced, self.memory
    dual = Dual(reduced, memory)
    prices = np.zeros(memory.num_segments)
    capacity = np.maximum(memory.capacity.astype(np.float64), 1.0)
    merges = _Merges(stall_s=_STALL_SHARE * (self.deadline - self.started))
    rounds = last_better = 0
    fitted = False
    while rounds < 2 or (
      time.monotonic() < until
      and (rounds - last_better < patience if patience is not None else not merges.stalled())
    ):
      self.limits.check("pricing")
      if fitted:
        self.meet()
      best_before = self.best_cost
      dual.set_prices(prices)
      dual.sweep(forward=rounds % 2 == 0)
      if rounds % _BOUND_EVERY == 0:
        self.bound(dual.lower_bound(prices))
      choice = dual.decode()
      cost = group_cost(reduced, choice)
      excess = memory.excess(choice).astype(np.float64)
      if (
        rounds == 0
      ):  # A plan's cost per unit of capacity (a finite one: a first plan may cost inf).
        scale = next((c for c in (cost, self.best_cost) if np.isfinite(c)), 1.0)
        base = max(abs(scale), 1.0) / max(float(capacity.sum()), 1.0)
      fitted = fitted or bool(np.all(excess <= 0))
      if (
        self.role.repair_until_fitted
        and not fitted
        and self.spare is None
        and rounds % 4 == 0
        and cost < self.best_cost
      ):
        self.polish(choice, "pricing, repaired", line=False, pairs=self.small)
      if cost < self.best_cost and np.all(excess <= 0):
        self.polish(choice, "pricing")
      else:
        merges.keep(cost, choice)
      if self.best is None or (budget_every and rounds % budget_every == 0):
        budgeted = dual.decode(GroupPlanBuilder(self.layout).pick)
        self.polish(budgeted, "pricing within budget", pairs=self.small)
      if (
        len(merges.pending) >= self.parents
        and self.best is not None
        and (fitted or rounds >= _CROSSOVER_AFTER)
        and until - time.monotonic() > 0.3
      ):
        merges.count(self.crossover(merges.take(), until))
      if self.best_cost < best_before:
        last_better = rounds
        merges.better()
      prices = next_prices(prices, excess, capacity, base, self.role)
      rounds += 1
    self.note(
      f"pricing: {rounds} rounds, {dual.num_colors} colours, {merges.crossings} crossovers "
      f"({merges.improving} improving), best {self.best_cost:.6g}"
      + (", stalled" if merges.stalled() else "")
    )

  def polish(self, choice: np.ndarray, stage: str, line: bool = True, pairs: bool = True) -> None:
    """Repairs a plan over the limit (`GroupPlan.repair`), then descends with single switches
    and (with `pairs`) two-group moves until neither helps or a pass of both gains less than
    `_POLISH_MIN_GAIN` of the cost, and offers the result (to the line or not). Budgeted and
    repaired plans of large problems skip the two-group moves (a pass over every pair-cost
    entry each: on R, 10 s of such a plan's polish, and the plans are rarely the best for
    long)."""
    plan = GroupPlan(self.layout, choice)
    if np.any(plan.excess() > 0) and not plan.repair(max_switches=_REPAIR_SWITCHES):
      return
    order = self.rng.permutation(self.reduced.num_groups)
    tolerance = 1e-12 * max(float(np.abs(self.reduced.unary).max(initial=1.0)), 1.0)
    cost = group_cost(self.reduced, plan.choice)
    while self.left() > 0 and plan.descend(order, min_gain=tolerance) + (
      plan.descend_pairs(min_gain=tolerance) if pairs else 0
    ):
      before, cost = cost, group_cost(self.reduced, plan.choice)
      if np.isfinite(before) and before - cost < _POLISH_MIN_GAIN * abs(before):
        break
    self.offer(plan.choice, stage, line)

  def crossover(self, others: list[np.ndarray], until: float) -> bool:
    """Re-chooses the groups where any of the `self.parents` first of `others` (cheapest
    first) differs from the best plan, each among the plans' strategies (`recombine`), by
    `until` at the latest; True if that improved the best. A merge its time limit stopped
    doubles the next one's (up to a third of the time left) and halves the plans it merges; one
    done within half its limit doubles them (up to `_MAX_PARENTS`)."""
    started = time.monotonic()
    left = until - started
    time_limit = min(left, self.crossover_seconds)
    result = recombine(
      self.reduced,
      self.memory,
      self.best,
      ([] if self.met is None else [self.met]) + others[: self.parents],
      time_limit=time_limit,
      seed=self.seed + len(self.log),
    )
    self.met = None
    took = time.monotonic() - started
    improved = self.offer(
      self.forest(result.choice) if self.role.forest_crossovers else result.choice, "crossover"
    )
    if took >= 0.9 * time_limit:
      self.crossover_seconds = min(2 * self.crossover_seconds, max(left / 3, _CROSSOVER_SECONDS))
      self.parents = max(self.parents // 2, 1)
    elif took < 0.5 * time_limit:
      self.parents = min(2 * self.parents, _MAX_PARENTS)
    return improved

  def forest(self, choice: np.ndarray) -> np.ndarray:
    """`choice` ([G], within the limit) after forest moves (`forest.ForestMoves`)."""
    if self.forests is None:
      self.forests = ForestMoves(self.layout)
    return self.forests.descend(
      choice, self.rng, _FOREST_PATIENCE, _POLISH_MIN_GAIN, until=self.deadline
    )

  def whole_mip(self, time_limit: float) -> bool:
    """The whole problem as one MIP, from the best plan; True if optimal."""
    time_limit = min(time_limit, self.left() - 1.0)
    if time_limit <= 0.5:
      return False
    everything = np.ones(self.reduced.num_groups, bool)
    result = reoptimize(
      self.reduced, self.memory, self.best, everything, time_limit=time_limit, seed=self.seed
    )
    self.offer(result.choice, "whole MIP")
    self.bound(result.bound)
    self.note(
      f"whole MIP: {'optimal' if result.optimal else 'stopped'}, best {self.best_cost:.6g}, "
      f"bound {result.bound:.6g}"
    )
    return result.optimal

  def neighbourhoods(self) -> None:
    """Large-neighbourhood search: re-solves groups around a tight segment, or a ball in the
    pair graph around a group drawn by its cost in the best plan (N: a few hundred of its
    21,213 pairs carry all of a plan's pair cost; docs/experiments/iopddl-forests.md), growing
    the neighbourhood while steps end optimal and shrinking it when they time out; each
    better plan is polished by forest moves."""
    reduced, memory = self.reduced, self.memory
    neighbours = self.layout.neighbours
    size, steps, improved = 100, 0, 0
    self.offer(self.forest(self.best), "neighbourhood")
    while self.left() > 1.0:
      self.limits.check("searching neighbourhoods")
      self.adopt()
      if steps % 2 == 0:
        free = self._around_tight_segment(size, neighbours)
      else:
        free = self._ball(size, neighbours, np.maximum(self._incident_costs(), 0.0))
      limit = min(self.left() - 0.5, 3.0)
      result = reoptimize(
        reduced, memory, self.best, free, time_limit=limit, seed=self.seed + steps
      )
      if group_cost(reduced, result.choice) < self.best_cost and self.offer(
        self.forest(result.choice), "neighbourhood"
      ):
        improved += 1
      size = (
        min(int(size * 1.25), reduced.num_groups) if result.optimal else max(int(size * 0.7), 20)
      )
      steps += 1
    self.note(f"neighbourhoods: {steps} steps, {improved} improving, best {self.best_cost:.6g}")

  def _around_tight_segment(self, size: int, neighbours: list[list[int]]) -> np.ndarray:
    memory = self.memory
    free = np.zeros(self.reduced.num_groups, bool)
    slack = -memory.excess(self.best)
    if not len(slack):
      return self._ball(size, neighbours)
    tight = np.argsort(slack, kind="stable")[:64]
    segment = int(self.rng.choice(tight))
    live = np.unique(
      memory.member_group[(memory.member_first <= segment) & (memory.member_last > segment)]
    )
    picked = self.rng.permutation(live)[: max(size // 2, 1)]
    free[picked] = True
    count = len(picked)
    for g in picked.tolist():
      for h in neighbours[g]:
        if count >= size:
          return free
        count += not free[h]
        free[h] = True
    return free

  def _ball(
    self, size: int, neighbours: list[list[int]], weights: np.ndarray | None = None
  ) -> np.ndarray:
    """[G] bool: `size` groups breadth-first around a centre drawn with probability
    proportional to `weights` ([G] >= 0; uniform without them or when they are all 0)."""
    free = np.zeros(self.reduced.num_groups, bool)
    total = 0.0 if weights is None else float(weights.sum())
    centre = (
      self.rng.choice(self.reduced.num_groups, p=weights / total)
      if total > 0
      else self.rng.integers(self.reduced.num_groups)
    )
    queue = [int(centre)]
    free[queue[0]] = True
    count, head = 1, 0
    while head < len(queue) and count < size:
      g = queue[head]
      head += 1
      for h in self.rng.permutation(neighbours[g]).tolist() if neighbours[g] else []:
        if not free[h] and count < size:
          free[h] = True
          count += 1
          queue.append(h)
    return free

  def _incident_costs(self) -> np.ndarray:
    """[G] each group's cost in the best plan: its unary cost plus the costs of its pairs."""
    reduced, choice = self.reduced, self.best
    pair = chosen_pair_costs(reduced, choice)
    unary = reduced.unary[reduced.offsets[:-1] + choice]
    return unary + np.bincount(
      reduced.pairs.ravel(), weights=np.repeat(pair, 2), minlength=reduced.num_groups
    )


class _Merges:
  """The plans a line's next crossover merges with its best, and whether its crossovers have
  stalled: `_STALL_CROSSOVERS` in a row, and `stall_s` seconds, without a better plan."""

  def __init__(self, stall_s: float):
    self.stall_s = stall_s
    self.pending: list[tuple[float, np.ndarray]] = []
    self.crossings = self.improving = self.since_better = 0
    self.better_at = time.monotonic()

  def keep(self, cost: float, choice: np.ndarray) -> None:
    """Keeps a decoded plan for the next crossover (the cheapest `_MAX_PARENTS` of them, while
    crossovers wait for a plan within the limit)."""
    self.pending.append((cost, choice))
    self.pending.sort(key=lambda entry: entry[0])
    del self.pending[_MAX_PARENTS:]

  def take(self) -> list[np.ndarray]:
    plans = [choice for _, choice in self.pending]
    self.pending = []
    return plans

  def count(self, improved: bool) -> None:
    self.crossings += 1
    self.improving += improved
    self.since_better += 1

  def better(self) -> None:
    self.since_better, self.better_at = 0, time.monotonic()

  def stalled(self) -> bool:
    return (
      self.since_better >= _STALL_CROSSOVERS and time.monotonic() - self.better_at >= self.stall_s
    )
