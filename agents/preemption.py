"""Preemption: a run told to stop (SIGTERM, or the platform's notice) stops at an iteration
boundary that every process agrees on.

With one process, a SIGTERM handler notes the signal, and the next boundary is the one.
With several (`jax.distributed`), JAX's preemption service does it: its notifier takes
SIGTERM (or the platform's own notice) in any process, and
`multihost_utils.reached_preemption_sync_point` returns True in every process at the same
step, the first after the largest step any process had reached. Either way the caller
asks `reached(step)` after each iteration, saves the state of that step and exits.
"""

from __future__ import annotations

import signal
import types

import jax
from jax.experimental import multihost_utils


class Preemption:
  """Whether the run is to stop at an iteration boundary. A context manager: the SIGTERM
  handler of a single process is installed on entry and the previous one put back on exit."""

  def __init__(self):
    self.signalled = False
    self._previous = None

  def __enter__(self) -> Preemption:
    if jax.process_count() == 1:
      self._previous = signal.signal(signal.SIGTERM, self._note)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def _note(self, signum: int, frame: types.FrameType | None) -> None:
    self.signalled = True

  def reached(self, step: int) -> bool:
    """Whether every process stops after `step` (every process asks at every step, from
    the same first one)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signalled
