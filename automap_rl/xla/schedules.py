"""Pipeline schedules as tick tables: what each stage runs in each iteration of one loop.

Each stage runs its operations in its schedule's order (`stage_orders`): F(m, c) runs chunk
c's layers forward on microbatch m and keeps its residuals; B(m, c) runs them backward;
on the last chunk the forward, the head, the loss and the backward run as one FB(m, c)
(its residuals never wait). Chunk c (of S V, V per stage) runs on stage c mod S. Orders:

* `gpipe`: every forward (microbatch-major), then every backward in reverse.
* `1f1b`: S - s - 1 warm-up forwards on stage s, then one forward, one backward
  (PipeDream-Flush, Megatron-LM), then the remaining backwards.
* `interleaved`: Megatron-LM's interleaved 1F1B: forward k runs chunk (k // S) mod V of
  microbatch (k // (S V)) S + k mod S, backward k the same microbatch's chunk
  V - 1 - (k // S) mod V; 2 (S - s - 1) + (V - 1) S warm-up forwards.

`tick_table` runs the orders in lockstep: in tick t each stage runs its next operation if
what it reads arrived by tick t - 1 (an activation from the stage before, a gradient
from the stage after: one `ppermute` a tick each way), else idles. Received values, and
residuals, wait in buffer slots the table assigns (slot 0 of the activation and gradient
buffers is a scratch slot that ticks receiving nothing write). The residual buffer has one
slot per residual set a stage holds at once: every tick writes the slot it names (`save`),
a forward its residuals, any other operation what that slot holds (a backward the slot
it reads), so that no tick needs a scratch slot of residuals.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap_rl.pipeline import Pipeline

__all__ = ["IDLE", "FORWARD", "BACKWARD", "FORWARD_BACKWARD", "Ticks", "stage_orders", "tick_table"]

IDLE, FORWARD, BACKWARD, FORWARD_BACKWARD = 0, 1, 2, 3
Op = tuple[int, int, int]  # (kind, microbatch, global chunk)


def stage_orders(pipeline: Pipeline) -> list[list[Op]]:
  """Each stage's operations in its schedule's order (module docstring)."""
  s_count, m_count, v_count = pipeline.stages, pipeline.microbatches, pipeline.chunks
  last = s_count * v_count - 1
  orders = []
  for s in range(s_count):
    if pipeline.schedule == "interleaved":
      group = lambda k: (k // (s_count * v_count)) * s_count + k % s_count
      forwards = [
        (group(k), ((k // s_count) % v_count) * s_count + s) for k in range(m_count * v_count)
      ]
      backwards = [
        (group(k), (v_count - 1 - (k // s_count) % v_count) * s_count + s)
        for k in range(m_count * v_count)
      ]
      warm = min(2 * (s_count - s - 1) + (v_count - 1) * s_count, len(forwards))
    else:
      forwards = [(m, s) for m in range(m_count)]
      backwards = list(forwards)
      warm = len(forwards) if pipeline.schedule == "gpipe" else min(s_count - s - 1, m_count)
    if pipeline.schedule == "gpipe":
      backwards = backwards[::-1]
    ops: list[Op] = [(FORWARD, m, c) for m, c in forwards[:warm]]
    steady = len(forwards) - warm
    for (fm, fc), (bm, bc) in zip(forwards[warm:], backwards[:steady]):
      ops += [(FORWARD, fm, fc), (BACKWARD, bm, bc)]
    ops += [(BACKWARD, m, c) for m, c in backwards[steady:]]
    merged = []
    for kind, m, c in ops:  # The last chunk's forward and backward run as one.
      if c == last:
        if kind == FORWARD:
          merged.append((FORWARD_BACKWARD, m, c))
      else:
        merged.append((kind, m, c))
    orders.append(merged)
  return orders


@dataclasses.dataclass(frozen=True)
class Ticks:
  """A schedule's tick table, int32 arrays [T, S] (T ticks, S stages).

  Attributes:
    kind: IDLE, FORWARD, BACKWARD or FORWARD_BACKWARD.
    micro: the microbatch it runs on.
    chunk: the stage's local chunk (global chunk // S).
    first: whether the chunk is global chunk 0 (its input is the embedded microbatch).
    read_act: the activation buffer slot a forward reads its input from.
    store_act: the slot the activation received at the end of the tick before is stored in.
    read_grad: the gradient buffer slot a backward reads its output's gradient from.
    store_grad: the slot the gradient received at the end of the tick before is stored in.
    save: the residual slot the tick writes: a forward's residuals, else what the slot
      holds (a backward's, the slot it reads).
    load: the residual slot a backward reads.
    slots: (activation, gradient, residual) buffer sizes, the first two with their
      scratch slot 0; the residual buffer's the most residual sets a stage holds (at
      least 1).
  """

  kind: np.ndarray
  micro: np.ndarray
  chunk: np.ndarray
  first: np.ndarray
  read_act: np.ndarray
  store_act: np.ndarray
  read_grad: np.ndarray
  store_grad: np.ndarray
  save: np.ndarray
  load: np.ndarray
  slots: tuple[int, int, int]

  @property
  def ticks(self) -> int:
    """T, the loop's iterations."""
    return int(self.kind.shape[0])

  def in_flight(self) -> np.ndarray:
    """The most residual sets a stage holds at once, int [S]."""
    s_count = self.kind.shape[1]
    out = np.zeros(s_count, int)
    for s in range(s_count):
      held = peak = 0
      for k in self.kind[:, s]:
        held += int(k == FORWARD) - int(k == BACKWARD)
        peak = max(peak, held)
      out[s] = peak
    return out


def _run(pipeline: Pipeline) -> list[list[Op | None]]:
  """The operations each stage runs in each tick (None: idle), [T][S]."""
  s_count, last = pipeline.stages, pipeline.stages * pipeline.chunks - 1
  orders, position = stage_orders(pipeline), [0] * pipeline.stages
  done: dict[tuple[int, int, int], int] = {}  # (kind, m, c) -> tick; FB counts as both.
  ticks: list[list[Op | None]] = []
  total = sum(len(o) for o in orders)
  while sum(position) < total:
    t, row = len(ticks), []
    for s in range(s_count):
      op = orders[s][position[s]] if position[s] < len(orders[s]) else None
      if op is not None:
        kind, m, c = op
        needs = (FORWARD, m, c - 1) if kind in (FORWARD, FORWARD_BACKWARD) else (BACKWARD, m, c + 1)
        if (kind != BACKWARD and c == 0) or done.get(needs, t) < t:
          position[s] += 1
        else:
          op = None
      row.append(op)
    for op in row:
      if op is not None:
        kind, m, c = op
        done[(FORWARD if kind != BACKWARD else BACKWARD, m, c)] = t
        if kind == FORWARD_BACKWARD:
          done[(BACKWARD, m, c)] = t
    if all(op is None for op in row):
      raise RuntimeError(f"the {pipeline.schedule} schedule deadlocks at tick {t} ({pipeline})")
    ticks.append(row)
  assert last >= 0
  return ticks


class _Slots:
  """Buffer slots of one stage, `first`, `first` + 1, ...: taken when a value arrives,
  freed when read."""

  def __init__(self, first: int = 1):
    self.free: list[int] = []
    self.first, self.count = first, 0
    self.held: dict[tuple[int, int], int] = {}

  def take(self, key: tuple[int, int]) -> int:
    if not self.free:
      self.free.append(self.first + self.count)
      self.count += 1
    self.held[key] = self.free.pop()
    return self.held[key]

  def release(self, key: tuple[int, int]) -> int:
    slot = self.held.pop(key)
    self.free.append(slot)
    return slot


def tick_table(pipeline: Pipeline) -> Ticks:
  """The tick table of `pipeline`'s schedule (module docstring)."""
  run = _run(pipeline)
  s_count, last = pipeline.stages, pipeline.stages * pipeline.chunks - 1
  t_count = len(run)
  table = {
    name: np.zeros((t_count, s_count), np.int32)
    for name in ("kind", "micro", "chunk", "first", "read_act", "store_act", "read_grad")
    + ("store_grad", "save", "load")
  }
  acts, grads = ([_Slots() for _ in range(s_count)] for _ in range(2))
  saved = [_Slots(first=0) for _ in range(s_count)]
  for t, row in enumerate(run):
    if t > 0:  # What the tick before sent arrives now.
      for s, op in enumerate(run[t - 1]):
        if op is None:
          continue
        kind, m, c = op
        if kind == FORWARD:
          to = (s + 1) % s_count
          table["store_act"][t, to] = acts[to].take((m, c + 1))
        if kind in (BACKWARD, FORWARD_BACKWARD) and c > 0:
          to = (s - 1) % s_count
          table["store_grad"][t, to] = grads[to].take((m, c - 1))
    for s, op in enumerate(row):
      if op is None:
        continue
      kind, m, c = op
      for name, value in (("kind", kind), ("micro", m), ("chunk", c // s_count), ("first", c == 0)):
        table[name][t, s] = value
      if kind in (FORWARD, FORWARD_BACKWARD) and c > 0:
        table["read_act"][t, s] = acts[s].release((m, c))
      if kind == FORWARD:
        table["save"][t, s] = saved[s].take((m, c))
      if kind == BACKWARD:
        table["load"][t, s] = table["save"][t, s] = saved[s].release((m, c))
        if c < last:
          table["read_grad"][t, s] = grads[s].release((m, c))
  counts = (
    1 + max(slots.count for slots in acts),
    1 + max(slots.count for slots in grads),
    max(1, *(slots.count for slots in saved)),
  )
  return Ticks(**table, slots=counts)
