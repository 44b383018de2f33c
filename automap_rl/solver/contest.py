"""The IOPDDL contest's own facts and scoring: time limits, public and withheld instances, the
published results of every team, and points as the contest gave them.

The contest (ASPLOS/EuroSys 2025) ran 25 instances, A to Y, each with its own time limit
(`CONTEST_TIMEOUTS`, from the benchmark table of the public `google/iopddl` repository); five
were public before the contest (`PUBLIC`), the other twenty withheld, and the final scores
are points on the withheld ones: (best team's cost) / (team's cost) per instance, summed. The
published results (`misc/iopddl_final_results.csv` of the contest's repository: one row per
team, one column per instance, empty where a team had no plan) give every team's cost;
`ContestResults` reads them and scores a new set of costs as one more team would have been
scored (the best cost of an instance is then the lower of the contest's best and ours, so
beating the contest's best earns exactly 1 and lowers every team's points there).
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CONTEST_TIMEOUTS", "PUBLIC", "ContestResults", "load_results"]

# Seconds per instance in the contest (loading and solving, on 8 cores).
CONTEST_TIMEOUTS = {
  **dict.fromkeys("ABCDE", 60.0),
  **dict.fromkeys("FGHIJ", 120.0),
  **dict.fromkeys("KLMNO", 180.0),
  **dict.fromkeys("PQRST", 240.0),
  **dict.fromkeys("UVWXY", 300.0),
}
# The instances public before the contest; the other twenty were withheld and scored.
PUBLIC = frozenset("AGMSY")


@dataclasses.dataclass(frozen=True)
class ContestResults:
  """Every team's cost on every instance.

  Attributes:
    costs: instance letter -> team -> cost of its plan (teams without a plan left out).
  """

  costs: Mapping[str, Mapping[str, int]]

  def best(self, instance: str) -> int | None:
    """The lowest cost any team reached on `instance`, or None if it is not listed."""
    costs = self.costs.get(instance, {})
    return min(costs.values()) if costs else None

  def winner(self) -> str | None:
    """The team with the most points on the withheld instances (None without results)."""
    teams = {team for costs in self.costs.values() for team in costs}
    withheld = [i for i in self.costs if i not in PUBLIC]
    return max(
      sorted(teams),
      key=lambda team: sum(self.points(i, self.costs[i].get(team)) for i in withheld),
      default=None,
    )

  def points(
    self, instance: str, cost: int | float | None, ours: int | float | None = None
  ) -> float:
    """The points `cost` earns on `instance` (0 without a plan), with the best cost taken over
    the contest's teams and, when given, `ours` as one more team."""
    best = self.best(instance)
    if cost is None or best is None or not cost > 0:
      return 0.0
    if ours is not None and ours < best:
      best = ours
    return min(best, cost) / cost


def load_results(path: str | Path) -> ContestResults:
  """Reads the contest's results table (column "TEAM #", then one column per instance)."""
  costs: dict[str, dict[str, int]] = {}
  with Path(path).open() as f:
    for row in csv.DictReader(f):
      team = row.pop("TEAM #")
      for instance, value in row.items():
        if value and value.strip():
          costs.setdefault(instance, {})[team] = int(value)
  return ContestResults(costs)
