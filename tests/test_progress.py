"""Phases that report nothing themselves still show their clock every second.

The ticker runs on a clock the test moves by hand, so the counts are exact whatever the
load on the machine."""

from __future__ import annotations

import threading

from experiments import progress


class FakeClock:
  """A `progress.Wait` on which time passes only in `advance`. The ticker's waits follow
  one another without a gap (a refresh takes no time): the n-th ends at the sum of the
  first n intervals."""

  def __init__(self):
    self.now = 0.0
    self.due = 0.0  # When the ticker's current wait ends.
    self.idle = False  # The ticker is waiting for a time still to come.
    self.stopped = False  # The ticker saw the end of the block and returned.
    self.condition = threading.Condition()

  def wait(self, stop: threading.Event, interval: float) -> bool:
    with self.condition:
      self.due += interval
      while self.now < self.due and not stop.is_set():
        self.idle = True
        self.condition.notify_all()
        self.condition.wait(0.01)  # Also looks at `stop`, which is set outside the condition.
      self.idle = False
      self.stopped = self.now < self.due
      return self.stopped

  def advance(self, seconds: float) -> None:
    """Moves time on, and returns once the ticker has made every refresh now due."""
    with self.condition:
      self.now += seconds
      self.idle = False
      self.condition.notify_all()
      assert self.condition.wait_for(lambda: self.idle, timeout=60)


def test_ticking_refreshes_every_interval_until_the_block_ends():
  clock, calls = FakeClock(), []
  with progress.ticking(lambda: calls.append(clock.now), interval=0.25, wait=clock.wait):
    clock.advance(0.125)
    assert calls == []
    clock.advance(0.125)
    assert calls == [0.25]
    clock.advance(0.625)  # To 0.875: the ticks at 0.5 and 0.75.
    assert calls == [0.25, 0.875, 0.875]
    clock.advance(0.0)
    assert len(calls) == 3
  assert clock.stopped and len(calls) == 3  # Stopped with the block, no tick after it.


def test_ticking_with_the_real_clock_stops_with_the_block():
  calls = []
  with progress.ticking(lambda: calls.append(None), interval=3600.0):
    pass  # Returns at once: the ticker's wait ends when the block does, not after an hour.
  assert calls == []


def test_phase_leaves_its_label_and_time_on_stderr(capsys):
  def draws(ticks: int) -> int:
    clock = FakeClock()
    with progress.phase("compiling the plan", wait=clock.wait):
      for _ in range(ticks):
        clock.advance(1.0)
    return capsys.readouterr().err.count("compiling the plan: ")

  untouched = draws(0)
  assert untouched >= 1  # The first draw.
  assert draws(2) == untouched + 2  # One more each second.
