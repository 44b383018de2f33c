"""Buckets: the few sizes a table dimension is padded to, so that one compile serves every
problem whose tables round to the same sizes.

A problem's tables (`Problem`'s owners and cost tables, an environment's `EnvTables`) have
dims that grow with the program (signatures, edges, classes) and small ones that vary
between programs (dims of a value, factors of an op, slots of an owner). Jitted functions
take the tables as arguments, so a compile is keyed by their shapes: padded to buckets,
the problems of one bucket share every compile. Padding is inert (rows that add nothing);
its cost is the padded entries a computation runs over (`waste`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from automap_rl.batching import next_power_of_two

# Dims that stay small (dims of one value, factors of one op, slots of one owner, factors
# of one value dim, combining loop groups) round up to a multiple of `SMALL_STEP`; the
# others to the ladder 16, 20, 24, 28, 32, 40, 48, 56, 64, ... (`RUNGS` rungs an octave,
# 2**k times 1, 1.25, 1.5 and 1.75: at most a fifth of a padded dim is padding, where
# powers of two alone pad up to half and a table over two or three such dims pays the
# product; the computations over the tables run in time about proportional to their
# entries), at least `LARGE_MINIMUM` (so that a few rows more or less, of memory probes
# or targets, do not split a bucket). Problems of one structure share a bucket at any
# rung count; more rungs would split few buckets more and pad less.
SMALL_STEP = 2
SMALL_DIMS = frozenset({"Rv", "Rf", "S", "D", "K"})
LARGE_MINIMUM = 16
RUNGS = 4


def bucket(dim: str, size: int) -> int:
  """The padded size of a `size`-entry dim named `dim`: a multiple of `SMALL_STEP` (at
  least one step) for `SMALL_DIMS`, else the smallest rung of the ladder (`2**k * (1 +
  j / RUNGS)`, j below `RUNGS`) at or above it, at least `LARGE_MINIMUM`."""
  if dim in SMALL_DIMS:
    return SMALL_STEP * max(1, -(-size // SMALL_STEP))
  size = max(size, LARGE_MINIMUM)
  power = next_power_of_two(size)
  step = power // (2 * RUNGS)
  return -(-size // step) * step


def bucket_sizes(sizes: Mapping[str, int], dims: frozenset[str] | None = None) -> dict[str, int]:
  """Each of `sizes` padded to its bucket (`bucket`); only those in `dims` when given."""
  return {d: bucket(d, n) if dims is None or d in dims else n for d, n in sizes.items()}


def waste(real, padded) -> float:
  """Entries of the padded tables `padded` over those of the real ones `real` (pytrees of
  arrays): how much more a bucket's computation runs over than the problem's own."""
  entries = lambda tree: sum(int(np.size(leaf)) for leaf in jax.tree.leaves(tree))
  return entries(padded) / max(entries(real), 1)


def key(*trees) -> tuple:
  """What a compile over these pytrees of arrays (numpy or jax) is keyed by besides static
  arguments: their structure and each leaf's shape and dtype. Problems whose tables have
  one key share a bucket."""
  leaves, structure = jax.tree.flatten(trees)
  return (str(structure), tuple((np.shape(x), str(x.dtype)) for x in leaves))
