"""Searches in forked worker processes: one per seed, sharing their best plans.

`supervise` starts the workers, keeps the best plan and lower bound each reports as it
finds them, and kills those still running at the hard deadline (a HiGHS call that overruns
its time limit cannot overrun the solve) or once one has proven the best plan optimal.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import time

import numpy as np

from automap_rl.solver.limits import LimitReached, Limits
from automap_rl.solver.search import ROLES, Outcome, Problem, Progress, Search, WorkerRole

__all__ = ["SharedBest", "supervise"]


def supervise(
  problem: Problem,
  warm: np.ndarray | None,
  deadline: float,
  limits: Limits,
  seeds: list[int],
  hard_deadline: float,
  progress: Progress | None,
) -> Outcome:
  """Runs one search per seed in a forked process; publishes each new best plan to the
  other searches (`SharedBest`); keeps the best plan and lower bound each search reports
  as it finds them; kills the searches still running at `hard_deadline`, or once a search
  has proven the best plan optimal (its lower bound reaches the plan's cost). Ties between
  searches go to the lower-numbered one, so the result does not depend on which
  message arrives first."""
  context = multiprocessing.get_context("fork")
  shared = SharedBest(context, problem.reduced.num_groups)
  channels, processes = [], []
  for worker, seed in enumerate(seeds):
    here, there = context.Pipe(duplex=False)
    role = ROLES[worker % len(ROLES)]
    process = context.Process(
      target=_search_in_child,
      args=(problem, warm, deadline, seed, role, limits, there, shared, worker),
      name=f"iopddl-search-{worker}",
      daemon=True,
    )
    process.start()
    there.close()
    channels.append(here)
    processes.append(process)
  tally = _Tally(problem.started, shared, progress, best_key=(np.inf, len(seeds)))
  running = dict(enumerate(channels))
  while running and not tally.proven and time.monotonic() < hard_deadline:
    for channel in multiprocessing.connection.wait(
      list(running.values()), timeout=hard_deadline - time.monotonic()
    ):
      worker = channels.index(channel)
      try:
        message = channel.recv()
      except (EOFError, OSError):
        tally.logs.append(
          f"worker {worker}: ended without a report (exit code {processes[worker].exitcode})"
        )
        del running[worker]
        continue
      if tally.receive(worker, message):
        del running[worker]
  for worker in running:
    processes[worker].kill()
    tally.killed(worker)
  for process in processes:
    process.join()
  for channel in channels:
    channel.close()
  return tally.outcome()


@dataclasses.dataclass
class _Tally:
  """What the supervisor has heard from the workers so far."""

  started: float
  shared: SharedBest
  progress: Progress | None
  best_key: tuple[float, int]
  best: np.ndarray | None = None
  bounds: list[float] = dataclasses.field(default_factory=list)
  logs: list[str] = dataclasses.field(default_factory=list)
  stopped: list[str] = dataclasses.field(default_factory=list)
  errors: list[LimitReached] = dataclasses.field(default_factory=list)
  proven: bool = False

  def receive(self, worker: int, message: tuple) -> bool:
    """Takes one message of `worker` ("bound", "plan" or "done"); True if it was its last."""
    if message[0] == "bound":
      self.bounds.append(message[1])
    elif message[0] == "plan":
      _, choice, cost, stage = message
      if (cost, worker) < self.best_key:
        self.best, self.best_key = choice, (cost, worker)
        self.shared.publish(choice, cost, worker)
        if self.progress is not None:
          self.progress(time.monotonic() - self.started, cost, f"{stage}, worker {worker}")
    else:
      outcome: Outcome = message[1]
      if outcome.lower_bound is not None:
        self.bounds.append(outcome.lower_bound)
      self.logs += [f"worker {worker}: {line}" for line in outcome.log]
      self.stopped += [outcome.stopped_by] if outcome.stopped_by else []
      self.errors += [outcome.limit_error] if outcome.limit_error else []
      cost = self.best_key[0]
      self.proven = bool(self.bounds) and cost <= max(self.bounds) + 1e-9 * abs(cost)
      return True
    return False

  def killed(self, worker: int) -> None:
    if self.proven:
      self.logs.append(f"worker {worker}: stopped, another worker proved the plan optimal")
    else:
      self.logs.append(f"worker {worker}: killed at the time limit")
      self.stopped.append("seconds")

  def outcome(self) -> Outcome:
    return Outcome(
      best=self.best,
      best_cost=self.best_key[0],
      lower_bound=max(self.bounds, default=None),
      log=tuple(self.logs),
      stopped_by=self.stopped[0] if self.stopped else None,
      limit_error=self.errors[0] if self.errors else None,
    )


class SharedBest:
  """The best plan any search has found, in shared memory: the supervisor writes it, the
  searches read it between steps. Unlike a pipe, which a search busy in a long step
  does not drain (a full one blocked the supervisor's send, and with it the timeout), a
  write never waits on a reader."""

  def __init__(self, context: multiprocessing.context.BaseContext, num_groups: int):
    self.lock = context.Lock()
    self.version = context.RawValue("q", 0)
    self.source = context.RawValue("q", -1)
    self.cost = context.RawValue("d", np.inf)
    self.plan = context.RawArray("q", max(num_groups, 1))
    self.num_groups = num_groups

  def publish(self, choice: np.ndarray, cost: float, worker: int) -> None:
    with self.lock:
      np.frombuffer(self.plan, np.int64)[: self.num_groups] = choice
      self.cost.value, self.source.value = cost, worker
      self.version.value += 1

  def newer(self, version: int, worker: int) -> tuple[int, np.ndarray, float] | None:
    """(version, [G] plan, cost) if a plan newer than `version` came from another worker, else
    None."""
    if self.version.value == version:
      return None
    with self.lock:
      if self.source.value == worker:
        return self.version.value, None, np.inf
      return (
        self.version.value,
        np.frombuffer(self.plan, np.int64)[: self.num_groups].copy(),
        self.cost.value,
      )


def _search_in_child(
  problem: Problem,
  warm: np.ndarray | None,
  deadline: float,
  seed: int,
  role: WorkerRole,
  limits: Limits,
  channel: multiprocessing.connection.Connection,
  shared: SharedBest,
  worker: int,
) -> None:
  """A worker process: one search that reports each better plan and its outcome through
  `channel`."""
  search = Search(
    problem, deadline, seed, limits, role=role, channel=channel, shared=shared, worker=worker
  )
  search.run_guarded(warm)
  channel.send(("done", search.outcome()))
  channel.close()
