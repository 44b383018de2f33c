"""Progress for phases that report nothing themselves (tracing, compiling, checking
numerics): a line that counts the seconds, refreshed every second, so a command is never
silent for long."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from tqdm import tqdm

Wait = Callable[[threading.Event, float], bool]  # (stop, interval) -> whether `stop` was set.


@contextlib.contextmanager
def ticking(
  refresh: Callable[[], None], interval: float = 1.0, wait: Wait = threading.Event.wait
) -> Iterator[None]:
  """Calls `refresh()` every `interval` seconds on a background thread while the block runs.

  `wait(stop, interval)` is the clock: it returns False when `interval` has passed, True as
  soon as the block has ended (`stop` set). The default is `stop.wait(interval)`, real
  time; the tests pass a clock of their own."""
  stop = threading.Event()

  def tick() -> None:
    while not wait(stop, interval):
      refresh()

  thread = threading.Thread(target=tick, daemon=True)
  thread.start()
  try:
    yield
  finally:
    stop.set()
    thread.join()


@contextlib.contextmanager
def phase(
  label: str, enabled: bool = True, leave: bool = True, wait: Wait = threading.Event.wait
) -> Iterator[None]:
  """Shows `label` with the seconds spent in it, refreshed every second, and leaves the
  final time on its line (or clears the line, `leave=False`). `wait`: as in `ticking`."""
  bar = tqdm(
    desc=label, bar_format="{desc}: {elapsed}", disable=not enabled, dynamic_ncols=True, leave=leave
  )
  with ticking(bar.refresh, wait=wait):
    try:
      yield
    finally:
      bar.close()
