"""Exact re-optimisation of a set of groups as a mixed-integer program (HiGHS).

The groups in `free` are re-chosen optimally while all others keep their
strategy. The model is the standard one for pairwise costs (as in Alpa's
intra-op pass): a binary x[g, s] per free group strategy with one-hot rows,
a continuous y[s, t] per allowed entry of a cost matrix between two free groups
tied to x by marginal rows (sum_t y[s, t] = x[g, s], sum_s y[s, t] = x[h, t]),
costs towards fixed groups folded into x's costs, and one usage row per
segment of time. Segment rows are added lazily: a solution that breaks the
limit somewhere brings that segment's row in and the model is solved again.
`recombine` merges plans with the same model's LP relaxation, rounded, and the MIP
only over the groups the relaxation leaves fractional. Every HiGHS call stops at its
deadline through interrupt callbacks as well as its time limit.

Why HiGHS (highspy) and not OR-tools CP-SAT: the sub-problems are one-hot
choices whose LP relaxation (the local polytope plus usage rows) is nearly
tight on these graphs, so an LP-based branch and bound mostly ends at the
root, and rows can be added to a solved model. Costs reach 1e12 and usages
1e10, which HiGHS takes as floats while CP-SAT would need them scaled to
integers (losing exactness or blowing up its propagation). HiGHS also
accepts the current plan as a start, reports a dual bound, is deterministic
for a seed with one thread, and is one small MIT-licensed wheel, where
OR-tools is a large dependency.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import highspy
import numpy as np
import scipy.sparse

from automap_rl.solver.memory import Memory
from automap_rl.solver.reduce import Reduced

__all__ = ["SubResult", "group_cost", "recombine", "reoptimize"]

# Divides the usage rows (see `_Model.usage_rows`): 1 + 1/pi.
_NON_INTEGRAL_FACTOR = 1.3183098861837907
# How a HiGHS run that stopped on the clock ends: at its time limit or by `_interrupt_at`.
_STOPPED = (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt)


@dataclasses.dataclass(frozen=True)
class SubResult:
  """Outcome of one re-optimisation.

  Attributes:
    choice: [G] group strategies (the input plan when nothing better was found).
    cost: Its cost.
    bound: Lower bound on the cost of any feasible plan that agrees with the
      input outside the free groups and uses allowed strategies (-inf when
      HiGHS proved none).
    optimal: Whether `choice` is proven optimal for the sub-problem.
  """

  choice: np.ndarray
  cost: float
  bound: float
  optimal: bool


def chosen_pair_costs(reduced: Reduced, choice: np.ndarray) -> np.ndarray:
  """[P] each pair's cost under the group plan `choice` ([G])."""
  g, h = reduced.pairs[:, 0], reduced.pairs[:, 1]
  return reduced.pair_costs[reduced.pair_offsets[:-1] + choice[g] * reduced.counts[h] + choice[h]]


def group_cost(reduced: Reduced, choice: np.ndarray) -> float:
  """Cost of a group plan: chosen unary costs plus chosen pair costs."""
  pair = chosen_pair_costs(reduced, choice)
  return float(reduced.unary[reduced.offsets[:-1] + choice].sum() + pair.sum())


def reoptimize(
  reduced: Reduced,
  memory: Memory,
  choice: np.ndarray,
  free: np.ndarray,
  *,
  time_limit: float,
  seed: int,
  allowed: np.ndarray | None = None,
  gap: float = 1e-7,
) -> SubResult:
  """Re-chooses the `free` groups ([G] bool) optimally; never returns worse.

  `allowed` ([V] bool), if given, restricts the free groups to some of their
  strategies (it must allow the current ones). `choice` must be within the
  limit; the result is too, and costs no more.
  """
  deadline = time.monotonic() + time_limit
  model = _Model(reduced, memory, choice, free, allowed)
  cost = group_cost(reduced, choice)
  scale = model.cost_scale()
  highs = _new_highs(seed, gap, deadline)
  highs.passModel(model.lp(scale))
  rows = model.initial_segments()
  _add_usage_rows(highs, model, rows)
  start = highspy.HighsSolution()
  start.col_value = model.start_values()
  columns = np.concatenate(
    [model.x_cost, model.y_cost]
  )  # Banned (infinite) columns are 0 in the start.
  constant = cost - float(np.dot(np.where(np.isfinite(columns), columns, 0.0), start.col_value))
  best, best_cost, bound, optimal = choice, cost, -np.inf, False
  while time.monotonic() < deadline:
    highs.setOptionValue("time_limit", max(deadline - time.monotonic(), 0.01))
    highs.setSolution(start)
    highs.run()
    info = highs.getInfo()
    if info.primal_solution_status != 2:
      break
    candidate = model.decode(np.asarray(highs.getSolution().col_value))
    excess = memory.excess(candidate)
    if np.any(excess > 0):
      new = np.setdiff1d(np.flatnonzero(excess > 0), rows)
      if not len(new) or highs.getModelStatus() in _STOPPED:
        break
      rows = np.union1d(rows, new)
      _add_usage_rows(highs, model, new)
      continue
    candidate_cost = group_cost(reduced, candidate)
    if candidate_cost < best_cost:
      best, best_cost = candidate, candidate_cost
    optimal = highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
    if np.isfinite(info.mip_dual_bound):
      bound = constant + info.mip_dual_bound * scale
    break
  return SubResult(choice=best, cost=best_cost, bound=bound, optimal=optimal)


def recombine(
  reduced: Reduced,
  memory: Memory,
  choice: np.ndarray,
  others: Sequence[np.ndarray],
  *,
  time_limit: float,
  seed: int,
) -> SubResult:
  """Re-chooses each group where any of `others` (each [G]) differs from `choice` ([G], within
  the limit) among those plans' strategies: the LP relaxation (with the usage rows its rounded
  plans break), rounded (to the larger share, or where that breaks the limit, each group it
  leaves fractional to its lightest strategy in use, which keeps every row of the LP), then
  the fractional groups re-chosen exactly (`reoptimize`) when the rounded plan fits, else
  every differing group by the MIP. Never returns worse than `choice`.

  On these merges the relaxation is nearly integral (R's first: 13 fractional groups of
  4,458) and its rounding as cheap as the MIP's best, while the MIP's cut separation at the
  root, which HiGHS does not interrupt, ran for 11-25 s past a 4 s limit.
  """
  deadline = time.monotonic() + time_limit
  free = np.zeros(reduced.num_groups, bool)
  allowed = np.zeros(len(reduced.unary), bool)
  for plan in (choice, *others):
    free |= plan != choice
    allowed[reduced.offsets[:-1] + plan] = True
  cost = group_cost(reduced, choice)
  unchanged = SubResult(choice=choice, cost=cost, bound=-np.inf, optimal=False)
  if not free.any():
    return unchanged
  model = _Model(reduced, memory, choice, free, allowed)
  highs = _new_highs(seed, 0.0, deadline)
  relaxation = model.lp(model.cost_scale())
  relaxation.integrality_ = []
  highs.passModel(relaxation)
  rows = model.initial_segments()
  _add_usage_rows(highs, model, rows)
  weight = _usage_weight(reduced, memory)
  while time.monotonic() < deadline:
    highs.setOptionValue("time_limit", max(deadline - time.monotonic(), 0.01))
    highs.run()
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
      return unchanged
    x = np.asarray(highs.getSolution().col_value)[: model.num_x]
    rounded = model.decode(x)
    if np.any(memory.excess(rounded) > 0):
      rounded = model.decode(_lightest_used(model, x, weight))
    new = np.setdiff1d(np.flatnonzero(memory.excess(rounded) > 0), rows)
    if len(new):
      rows = np.union1d(rows, new)
      _add_usage_rows(highs, model, new)
      continue
    fractional = np.zeros(reduced.num_groups, bool)
    fractional[model.x_group[(x > 1e-6) & (x < 1 - 1e-6)]] = True
    fits = not np.any(memory.excess(rounded) > 0)
    result = reoptimize(
      reduced,
      memory,
      rounded if fits else choice,
      fractional & free if fits else free,
      time_limit=max(deadline - time.monotonic(), 0.01),
      seed=seed,
      allowed=allowed,
    )
    return result if result.cost < cost else unchanged
  return unchanged


def _usage_weight(reduced: Reduced, memory: Memory) -> np.ndarray:
  """[V] each group strategy's usage summed over its members and the segments each spans."""
  member = np.repeat(np.arange(len(memory.member_group)), np.diff(memory.member_offsets))
  var = (
    reduced.offsets[memory.member_group[member]]
    + np.arange(len(member))
    - memory.member_offsets[member]
  )
  span = (memory.member_last - memory.member_first)[member]
  return np.bincount(var, weights=memory.member_usage * span, minlength=len(reduced.unary))


def _lightest_used(model: _Model, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
  """[num_x] one-hot x: each free group at the strategy of least `weight` ([V]) among those
  with a positive share in the LP solution `x` ([num_x])."""
  key = np.where(x > 1e-6, weight[model.x_var], np.inf)
  starts = np.flatnonzero(np.r_[True, model.x_group[1:] != model.x_group[:-1]])
  lengths = np.diff(np.r_[starts, len(key)])
  hits = np.flatnonzero(key == np.repeat(np.minimum.reduceat(key, starts), lengths))
  rounded = np.zeros(len(x))
  rounded[hits[np.searchsorted(hits, starts)]] = 1.0
  return rounded


def _new_highs(seed: int, gap: float, deadline: float) -> highspy.Highs:
  """A quiet one-thread HiGHS that stops at `deadline` (monotonic seconds) wherever its simplex
  or branch and bound asks for interrupts (its own time limit is set per run)."""
  highs = highspy.Highs()
  # Presolve stays off: with dense usage rows, HiGHS's root probing after it
  # can run for tens of seconds without looking at the time limit. Every model starts
  # from a plan within the limit, so the feasibility jump (2 s on R's merges) is skipped.
  for name, value in (
    ("output_flag", False),
    ("random_seed", int(seed) % 2**31),
    ("threads", 1),
    ("mip_rel_gap", gap),
    ("mip_abs_gap", 0.0),
    ("presolve", "off"),
    ("mip_detect_symmetry", False),
    ("mip_heuristic_run_feasibility_jump", False),
  ):
    highs.setOptionValue(name, value)

  def stop(event: highspy.highs.HighsCallbackEvent) -> None:
    if time.monotonic() > deadline:
      event.interrupt()

  highs.cbMipInterrupt.subscribe(stop)
  highs.cbSimplexInterrupt.subscribe(stop)
  return highs


def _add_usage_rows(highs: highspy.Highs, model: _Model, segments: np.ndarray) -> None:
  matrix, upper = model.usage_rows(segments)
  if matrix.shape[0]:
    lower = np.full(matrix.shape[0], -highs.getInfinity())
    highs.addRows(
      matrix.shape[0],
      lower,
      upper,
      matrix.nnz,
      matrix.indptr[:-1].astype(np.int32),
      matrix.indices.astype(np.int32),
      matrix.data,
    )


class _Model:
  """Columns and rows of one sub-problem: x per allowed strategy of a free
  group, then y per allowed cost entry between two free groups."""

  def __init__(
    self,
    reduced: Reduced,
    memory: Memory,
    choice: np.ndarray,
    free: np.ndarray,
    allowed: np.ndarray | None,
  ):
    self.reduced, self.memory, self.choice, self.free = reduced, memory, choice, free
    counts, offsets = reduced.counts, reduced.offsets
    var_group = reduced.var_group
    usable = free[var_group] if allowed is None else free[var_group] & allowed
    self.x_var = np.flatnonzero(usable)
    self.x_group = var_group[self.x_var]
    self.column = np.full(offsets[-1], -1)
    self.column[self.x_var] = np.arange(len(self.x_var))
    x_cost = reduced.unary[self.x_var].copy()

    g, h = reduced.pairs[:, 0], reduced.pairs[:, 1]
    k_h = counts[h]
    # Pairs with one free end: a cost per strategy of the free end.
    for free_side in (0, 1):
      pairs = np.flatnonzero(
        free[reduced.pairs[:, free_side]] & ~free[reduced.pairs[:, 1 - free_side]]
      )
      mine = reduced.pairs[pairs, free_side]
      k = counts[mine]
      p = np.repeat(pairs, k)
      s = _local_index(k)
      fixed = choice[reduced.pairs[p, 1 - free_side]]
      entry = reduced.pair_offsets[p] + (
        s * k_h[p] + fixed if free_side == 0 else fixed * k_h[p] + s
      )
      column = self.column[offsets[reduced.pairs[p, free_side]] + s]
      used = column >= 0
      np.add.at(x_cost, column[used], reduced.pair_costs[entry[used]])
    self.x_cost = x_cost

    # Pairs with both ends free: one y per entry whose two strategies are columns.
    pairs = np.flatnonzero(free[g] & free[h])
    sizes = counts[g[pairs]] * k_h[pairs]
    p = np.repeat(pairs, sizes)
    k = _local_index(sizes)
    row_var, col_var = offsets[g[p]] + k // k_h[p], offsets[h[p]] + k % k_h[p]
    cost = reduced.pair_costs[reduced.pair_offsets[p] + k]
    keep = (self.column[row_var] >= 0) & (self.column[col_var] >= 0) & np.isfinite(cost)
    self.y_pair, self.y_cost = p[keep], cost[keep]
    self.y_x = (self.column[row_var[keep]], self.column[col_var[keep]])

  def cost_scale(self) -> float:
    """A power of two near the median non-zero cost, so costs are ~1."""
    costs = np.abs(np.concatenate([self.x_cost, self.y_cost]))
    costs = costs[np.isfinite(costs) & (costs > 0)]
    return float(2.0 ** np.round(np.log2(np.median(costs)))) if len(costs) else 1.0

  @property
  def num_x(self) -> int:
    return len(self.x_var)

  def lp(self, scale: float) -> highspy.HighsLp:
    nx, ny = self.num_x, len(self.y_cost)
    cost = np.concatenate([self.x_cost, self.y_cost]) / scale
    upper = np.ones(nx + ny)
    banned = ~np.isfinite(cost)
    cost[banned], upper[banned] = 0.0, 0.0
    # One-hot rows, then for each (pair, x column) a marginal row sum y - x = 0.
    groups, one_hot = np.unique(self.x_group, return_inverse=True)
    rows, cols, vals = [one_hot], [np.arange(nx)], [np.ones(nx)]
    num_rows = len(groups)
    for side in (0, 1):
      keys, y_rows = np.unique(self.y_pair * nx + self.y_x[side], return_inverse=True)
      rows += [num_rows + y_rows, num_rows + np.arange(len(keys))]
      cols += [nx + np.arange(ny), keys % nx]
      vals += [np.ones(ny), -np.ones(len(keys))]
      num_rows += len(keys)
    matrix = scipy.sparse.csr_matrix(
      (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
      shape=(num_rows, nx + ny),
    )
    bounds = np.zeros(num_rows)
    bounds[: len(groups)] = 1.0

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = nx + ny, num_rows
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(nx + ny), upper
    lp.row_lower_, lp.row_upper_ = bounds, bounds
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = nx + ny, num_rows
    lp.a_matrix_.start_ = matrix.indptr.astype(np.int32)
    lp.a_matrix_.index_ = matrix.indices.astype(np.int32)
    lp.a_matrix_.value_ = matrix.data
    lp.integrality_ = [highspy.HighsVarType.kInteger] * nx + [highspy.HighsVarType.kContinuous] * ny
    return lp

  def start_values(self) -> np.ndarray:
    """Column values of the input plan."""
    offsets = self.reduced.offsets
    x = np.zeros(self.num_x)
    current = self.column[offsets[self.x_group] + self.choice[self.x_group]]
    if np.any(current < 0):
      raise ValueError("reoptimize: `allowed` must allow the current strategies")
    x[current] = 1.0
    y = (x[self.y_x[0]] > 0.5) & (x[self.y_x[1]] > 0.5)
    return np.concatenate([x, y.astype(np.float64)])

  def decode(self, values: np.ndarray) -> np.ndarray:
    """[G] plan: the input plan with the free groups' strategies from x."""
    choice = self.choice.copy()
    chosen = values[: self.num_x] > 0.5
    choice[self.x_group[chosen]] = self.x_var[chosen] - self.reduced.offsets[self.x_group[chosen]]
    return choice

  def initial_segments(self) -> np.ndarray:
    """Segments where the free groups could break the limit and that are
    already tight: the slack of the input plan is below the free members'
    largest possible increase and among the tightest 1%."""
    memory = self.memory
    usage = memory.member_usages(self.choice)
    offsets = memory.member_offsets
    if not len(usage):
      return np.zeros(0, np.int64)
    high = np.maximum.reduceat(memory.member_usage, offsets[:-1])
    swing = memory.profile_of(np.where(self.free[memory.member_group], high - usage, 0))
    slack = memory.capacity - memory.profile_of(usage)
    breakable = np.flatnonzero(swing > slack)
    return breakable[slack[breakable] <= np.quantile(slack, 0.01)] if len(breakable) else breakable

  def usage_rows(self, segments: np.ndarray) -> tuple[scipy.sparse.csr_matrix, np.ndarray]:
    """Rows sum usage * x <= capacity - fixed usage, scaled down by a power of two."""
    memory, reduced = self.memory, self.reduced
    segments = np.sort(segments)
    free_member = self.free[memory.member_group]
    usage = np.where(free_member, 0, memory.member_usages(self.choice))
    upper = (memory.capacity - memory.profile_of(usage))[segments].astype(np.float64)
    members = np.flatnonzero(free_member)
    lo = np.searchsorted(segments, memory.member_first[members])
    hi = np.searchsorted(segments, memory.member_last[members])
    n = hi - lo
    pm = np.repeat(members, n)
    row = np.repeat(lo, n) + _local_index(n)
    k = reduced.counts[memory.member_group[pm]]
    em, er = np.repeat(pm, k), np.repeat(row, k)
    s = _local_index(k)
    col = self.column[reduced.offsets[memory.member_group[em]] + s]
    val = memory.member_usage[memory.member_offsets[em] + s].astype(np.float64)
    used = col >= 0
    matrix = scipy.sparse.csr_matrix(
      (val[used], (er[used], col[used])), shape=(len(segments), self.num_x)
    )
    # The factor is no power of two and no simple fraction, so HiGHS cannot scale the rows
    # back to integers: its root mod-k separation takes rows it can, and on dense usage
    # rows it ran for minutes without looking at the time limit (K: over 100 s in a call
    # given 4 s). Integer usages are at most half a unit from breaking a row, far above
    # the rounding of the division and HiGHS's tolerance of 1e-6.
    scale = max(float(np.abs(memory.capacity).max(initial=1)) / 1e6, 1.0) * _NON_INTEGRAL_FACTOR
    slack = 0.5 if memory.capacity.dtype.kind == "i" else 0.0
    return matrix / scale, (upper + slack) / scale


def _local_index(lengths: np.ndarray) -> np.ndarray:
  """Concatenation of arange(n) for each n in lengths."""
  return np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
