"""Suite cases drawn at random for the full-size validation, among those no full-size
check covers (`validate --suite fullsize --draw N --seed S`)."""

from __future__ import annotations

import numpy as np

from automap_rl import workloads
from automap_rl.xla.fullsize import FULLSIZE_CASES, SAMPLED_CASES

__all__ = ["FAMILY_ORDER_SEED", "MAX_DRAWN_DEVICES", "drawn_cases"]

# The seed of the one shuffle of the families that `drawn_cases` walks.
FAMILY_ORDER_SEED = 20261206
# The most devices a drawn case has: XLA:CPU compiles a full-size step on as many virtual
# devices, and the suite's cases at published batch sizes (up to 1,024 devices) are past
# what a CPU compiles.
MAX_DRAWN_DEVICES = 128


def drawn_cases(n: int, seed: int) -> tuple[str, ...]:
  """`n` task-suite cases of at most `MAX_DRAWN_DEVICES` devices that no full-size check covers
  (none of `FULLSIZE_CASES` and `SAMPLED_CASES`), drawn one family at a time: the families in one
  fixed shuffled order (`FAMILY_ORDER_SEED`), from the `(seed * n)`-th on and wrapping around, so
  draws of consecutive seeds meet every family before one meets a family twice; in each family a
  case drawn at random with `seed` (a family met again gives another of its cases). The same `n`
  and `seed` draw the same cases."""
  if n < 1:
    raise ValueError(f"--draw {n}: draw at least one case.")
  covered = {*FULLSIZE_CASES, *SAMPLED_CASES}
  by_family: dict[str, list[str]] = {}
  for case in workloads.load_cases():
    if case.name not in covered and case.make_mesh().num_devices <= MAX_DRAWN_DEVICES:
      by_family.setdefault(case.family, []).append(case.name)
  if n > sum(map(len, by_family.values())):
    raise ValueError(
      f"--draw {n}: only {sum(map(len, by_family.values()))} suite cases are not covered."
    )
  families = sorted(by_family)
  np.random.default_rng(FAMILY_ORDER_SEED).shuffle(families)
  rng = np.random.default_rng(seed)
  pools = {f: list(rng.permutation(by_family[f])) for f in sorted(by_family)}
  drawn: list[str] = []
  position = seed * n
  while len(drawn) < n:
    pool = pools[families[position % len(families)]]
    if pool:
      drawn.append(str(pool.pop(0)))
    position += 1
  return tuple(drawn)
