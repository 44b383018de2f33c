"""One deadline and one ceiling on resident memory, shared by every stage of a search.

A search that builds a problem, reduces it and solves it checks its `Limits` at points
inside its loops (`Limits.check`); past either limit the check raises `LimitReached`
naming the limit, and the caller returns its best plan so far. Resident memory is the
process's resident set size, read from `/proc/self/statm` (about 10 microseconds; where
there is no /proc, the peak resident size from `resource`).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time

__all__ = ["LimitReached", "Limits", "resident_bytes"]

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class LimitReached(RuntimeError):
  """A search passed its deadline (`limit == "seconds"`) or its memory ceiling
  (`limit == "memory"`)."""

  def __init__(self, limit: str, message: str):
    super().__init__(message)
    self.limit = limit


def resident_bytes() -> int:
  """The process's resident memory in bytes (its peak where /proc is missing)."""
  try:
    with open("/proc/self/statm", "rb") as f:
      return int(f.read().split()[1]) * _PAGE_BYTES
  except OSError:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
  """A deadline and a memory ceiling.

  Attributes:
    deadline: the `time.monotonic()` past which the search stops; None: no deadline.
    max_resident_bytes: the resident memory past which it stops; None: no ceiling.
  """

  deadline: float | None = None
  max_resident_bytes: int | None = None

  @classmethod
  def starting_now(cls, seconds: float | None, max_resident_bytes: int | None) -> Limits:
    """Limits with a deadline `seconds` from now."""
    return cls(None if seconds is None else time.monotonic() + seconds, max_resident_bytes)

  def seconds_left(self) -> float:
    """Seconds to the deadline (inf without one; negative past it)."""
    return float("inf") if self.deadline is None else self.deadline - time.monotonic()

  def check(self, where: str, allocating: int = 0) -> None:
    """Raises `LimitReached` when past the deadline or above the memory ceiling, counting
    `allocating` bytes the caller is about to allocate at once (one array that would
    pass the ceiling before the next check); `where` names the stage for the message."""
    if self.deadline is not None and time.monotonic() > self.deadline:
      raise LimitReached("seconds", f"the time budget ran out while {where}")
    if self.max_resident_bytes is not None:
      rss = resident_bytes()
      if rss + allocating > self.max_resident_bytes:
        planned = f" and {allocating / 2**30:.2f} GiB to allocate" if allocating else ""
        raise LimitReached(
          "memory",
          f"resident memory reached {rss / 2**30:.2f} GiB{planned}, above the ceiling "
          f"of {self.max_resident_bytes / 2**30:.2f} GiB, while {where}",
        )
