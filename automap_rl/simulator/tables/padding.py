"""`CostTables` padded to larger sizes with rows that add nothing (see `automap_rl.buckets`).

Every field's axes are named (`dims`): Uv value signatures with Rv dims, Uo op signatures
with Rf factors, E edges (Eu classes of edges that resolve alike) of which R reduce, Ss
reads priced as sharing a resharding (Sp pairs of them), L memory probe rows, D factors per
dim, K combining loop groups, B = 2**X axis masks. Padded ops, values and edges cost
nothing (zero seconds, bytes and weights), padded dims have no class, padded factors are
never sharded, and per-mask tables laid out for more mesh axes repeat the mesh's own
(`tiled_masks`: no plan of the mesh uses the axes added).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

# The dims whose sizes vary between problems (the others are fixed by the mesh or the
# simulator: B, and the columns of pairs): what buckets pad.
VARYING = frozenset({"Uv", "Rv", "Uo", "Rf", "E", "Eu", "R", "L", "Ss", "Sp", "D", "K"})
# Fields whose axes their name's prefix does not say, by field.
_DIMS: Mapping[str, tuple[str, ...]] = {
  "op_reduction": ("Uo", "Rf"),
  "edge_dim_factors": ("E", "Rv", "D"),
  "live_bytes": ("L", "Uv"),
  "hbm_bytes": (),
  "combine_bytes": ("2",),
  "native_scatter": (),
  "async_collectives": (),
  "loop_repeats": ("K",),
  "shared_slot_edge": ("Ss",),
  "shared_slot_runs": ("Ss",),
  "shared_slot_share": ("Ss",),
  "shared_pairs": ("2", "Sp"),
  "value_dim_class": ("Uv", "Rv"),
}
_PREFIX_DIM = {
  "value": "Uv",
  "op": "Uo",
  "edge": "E",
  "unique": "Eu",
  "reduction": "R",
  "mask": "B",
}
# Fills other than 0, by field.
FILL: Mapping[str, int] = {
  "edge_dim_factors": -1,
  "value_dim_class": -1,  # -1: a dim of no named dimension.
  "op_dense_factor": -1,  # -1: the simulator's never-sharded factor.
  "shared_pairs": -1,  # -1: a pair that counts for no slot.
}


def dims(field: str, ndim: int) -> tuple[str, ...]:
  """Dims of a `CostTables` field of rank `ndim`: as listed, else a vector over the dim its
  name's prefix names (`value_*`: Uv, `op_*`: Uo, `edge_*`: E, `unique_*`: Eu,
  `reduction_*`: R, `mask_*`: B)."""
  if field in _DIMS:
    return _DIMS[field]
  prefix = field.split("_")[0]
  if ndim == 1 and prefix in _PREFIX_DIM:
    return (_PREFIX_DIM[prefix],)
  raise KeyError(f"CostTables field {field!r} of rank {ndim} has no named dims.")


def padded_array(
  name: str, axes: tuple[str, ...], array, sizes: Mapping[str, int], fill
) -> np.ndarray:
  """`array` (dims `axes`) padded at the end of each axis to `sizes`, with `fill`.

  Raises:
    ValueError: the array is larger than `sizes` on some axis.
  """
  array = np.asarray(array)
  if not axes:
    return array
  widths = [(0, sizes[d] - n) for d, n in zip(axes, array.shape)]
  if any(w < 0 for _, w in widths):
    raise ValueError(f"{name} of shape {array.shape} does not fit {[sizes[d] for d in axes]}.")
  return np.pad(array, widths, constant_values=fill)


def table_sizes(tables) -> dict[str, int]:
  """The size of every named dim of `tables` (a `CostTables`).

  Raises:
    ValueError: two fields disagree on a dim's size.
  """
  out: dict[str, int] = {}
  for field in dataclasses.fields(tables):
    array = getattr(tables, field.name)
    for dim, n in zip(dims(field.name, np.ndim(array)), np.shape(array)):
      if out.setdefault(dim, n) != n:
        raise ValueError(f"CostTables.{field.name}: dim {dim} is {n}, elsewhere {out[dim]}.")
  return out


def pad_tables(tables, sizes: Mapping[str, int]):
  """`tables` (a `CostTables`, numpy) with every field padded to `sizes` (at least its own)."""
  return dataclasses.replace(
    tables,
    **{
      f.name: tiled_masks(a, sizes["B"])
      if dims(f.name, np.ndim(a)) == ("B",)
      else padded_array(f.name, dims(f.name, np.ndim(a)), a, sizes, FILL.get(f.name, 0))
      for f in dataclasses.fields(tables)
      for a in [getattr(tables, f.name)]
    },
  )


def tiled_masks(table, size: int) -> np.ndarray:
  """A per-axis-mask table [2**X] laid out for `size` = 2**X' masks, X' >= X (a mesh padded
  with axes of size 1): mask m reads the entry of its bits on the mesh's own axes, so the
  rows of masks no plan of the mesh makes repeat real ones (a group of 1 device is never
  priced as none)."""
  table = np.asarray(table)
  if size < table.shape[0]:
    raise ValueError(f"A table of {table.shape[0]} axis masks does not fit {size}.")
  return table[np.arange(size) & (table.shape[0] - 1)]
