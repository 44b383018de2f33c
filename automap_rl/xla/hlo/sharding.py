"""HLO sharding attributes read as the mesh axes each array dim is tiled over."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

from automap_rl.xla.hlo.groups import iota_device_ids, parse_ints

Spec = tuple[tuple[str, ...], ...]
_TILED_RE = re.compile(r"\{devices=\[(?P<dims>[\d,]+)\](?P<ids>[^\s}]+)(?P<rest>.*)\}")
_LAST_TILE_DIMS_RE = re.compile(r"last_tile_dims=\{(?P<kinds>[^}]*)\}")


def _balanced(text: str, start: int) -> str:
  """The brace group of `text` opening at `start` (`text[start] == '{'`)."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[start : i + 1]
  raise ValueError(f"Unbalanced braces in HLO sharding {text[start:]!r}.")


def sharding_attr(attrs: str) -> str | None:
  """The `{...}` of an instruction's `sharding=` attribute; None when absent."""
  at = attrs.find("sharding={")
  return None if at < 0 else _balanced(attrs, at + len("sharding="))


def split_tuple_sharding(text: str) -> tuple[str, ...]:
  """The element shardings of a tuple sharding `{{a}, {b}}`; `(text,)` for an
  array's sharding."""
  inner = text.strip()[1:-1].strip()
  if not inner.startswith("{"):
    return (text.strip(),)
  parts, i = [], 0
  while i < len(inner):
    if inner[i] == "{":
      parts.append(_balanced(inner, i))
      i += len(parts[-1])
    else:
      i += 1
  return tuple(parts)


def _tile_assignment(dims: Sequence[int], ids: str) -> np.ndarray:
  """Device ids laid out as the tile array `dims`, from an iota `<=[..]T(..)`
  or an explicit `0,1,2,...` list."""
  if ids.startswith("<="):
    flat = iota_device_ids(ids[2:])
    if flat is None:
      raise ValueError(f"Malformed iota tile assignment {ids!r}.")
  else:
    flat = np.array(parse_ints(ids))
  return flat.reshape(dims)


def _dim_axes(
  index: np.ndarray,
  count: int,
  coords: np.ndarray,
  sizes: Sequence[int],
  free: Sequence[int],
) -> tuple[int, ...] | None:
  """The ordered mesh axes (major first, drawn from `free`) whose row-major
  coordinate gives each device's tile `index` [num_devices] along a dim
  tiled `count` ways; None when none do."""
  for k in range(1, len(free) + 1):
    for axes in itertools.permutations(free, k):
      if math.prod(sizes[a] for a in axes) != count:
        continue
      position = np.zeros(len(index), np.int64)
      for a in axes:
        position = position * sizes[a] + coords[:, a]
      if np.array_equal(position, index):
        return axes
  return None


def sharding_spec(
  text: str, rank: int, axis_names: Sequence[str], axis_sizes: Sequence[int]
) -> Spec | None:
  """The mesh axes each dim of an array is tiled over under the HLO sharding
  `text` (one array's, e.g. `{devices=[1,4,2]<=[2,4]T(1,0)
  last_tile_dim_replicate}`), major axis first, size-1 axes left out:
  `(("model",), ())` for that example on a `data=2,model=4` mesh. `((),) * rank`
  for `{replicated}`; None for a sharding no mesh axes express (maximal,
  manual, or tiles in another device order)."""
  text = text.strip()
  if text == "{replicated}":
    return ((),) * rank
  match = _TILED_RE.fullmatch(text)
  if match is None:
    return None
  kinds = _LAST_TILE_DIMS_RE.search(match["rest"])
  if kinds and "manual" in kinds["kinds"]:
    return None
  dims = parse_ints(match["dims"])
  tiles = _tile_assignment(dims, match["ids"])
  if len(dims) < rank or tiles.size != math.prod(axis_sizes):
    return None
  coords = np.array(np.unravel_index(np.arange(tiles.size), axis_sizes)).T
  index = np.zeros((tiles.size, len(dims)), np.int64)
  index[tiles.reshape(-1)] = np.array(np.unravel_index(np.arange(tiles.size), dims)).T
  free = [a for a, n in enumerate(axis_sizes) if n > 1]
  spec = []
  for d in range(rank):
    if dims[d] == 1:
      spec.append(())
      continue
    axes = _dim_axes(index[:, d], dims[d], coords, axis_sizes, free)
    if axes is None:
      return None
    free = [a for a in free if a not in axes]
    spec.append(tuple(axis_names[a] for a in axes))
  return tuple(spec)
