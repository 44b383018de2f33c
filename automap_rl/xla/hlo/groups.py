"""Replica groups of collectives: their three text formats, XLA's id modes, mesh axes.

Device ids. With `use_global_device_ids=true` groups hold flattened ids
`replica * num_partitions + partition`; with a `channel_id` but no such flag
they hold partition ids (all-to-all, collective-permute) or replica ids whose
partitions all join (all-reduce, all-gather, reduce-scatter); without a
`channel_id` they hold replica ids. `device_groups` converts everything to flattened
ids. For a jitted SPMD program there is one replica, so flattened ids are
partition ids, i.e. row-major positions in the mesh's device order.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

Groups = tuple[tuple[int, ...], ...]

_EXPLICIT_RE = re.compile(r"\{\s*((?:\{[\d,\s]*\}\s*,?\s*)*)\}")
_INNER_GROUP_RE = re.compile(r"\{([\d,\s]*)\}")
_IOTA_RE = re.compile(r"\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_RE = re.compile(
  r"mesh\[(?P<axes>[^\]]*)\]"
  r"(?:,\s*device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\))?"
  r"\s*\{(?P<refs>[^}]*)\}"
)
_MESH_AXIS_RE = re.compile(r"'?(?P<name>[^'=,\s]+)'?=(?P<size>\d+)")
_AXIS_REF_RE = re.compile(r"'?(?P<name>[^',:\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
_DEVICE_IOTA_RE = re.compile(r"\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_REPLICA_GROUPS_RE = re.compile(
  r"replica_groups=(?P<value>"
  + _MESH_RE.pattern
  + "|"
  + _IOTA_RE.pattern
  + r"|\{\s*(?:\{[\d,\s]*\}\s*,?\s*)*\})"
)
_PAIRS_RE = re.compile(r"source_target_pairs=(?P<value>\{\s*(?:\{[\d,\s]*\}\s*,?\s*)*\})")


def parse_ints(text: str) -> tuple[int, ...]:
  """`"4,2"` -> `(4, 2)`."""
  return tuple(int(x) for x in text.split(",") if x.strip())


def parse_explicit_groups(text: str) -> Groups:
  """`"{{0,1},{2,3}}"` -> `((0, 1), (2, 3))`; `"{}"` -> `()` (all devices)."""
  match = _EXPLICIT_RE.fullmatch(text.strip())
  if match is None:
    raise ValueError(f"Malformed explicit replica groups {text!r}.")
  return tuple(parse_ints(g) for g in _INNER_GROUP_RE.findall(match.group(1)))


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
  """`arange(prod(reshape)).reshape(reshape).transpose(perm)`, flattened."""
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return (ids if perm is None else ids.transpose(perm)).reshape(-1)


def iota_device_ids(text: str) -> np.ndarray | None:
  """Device ids of an iota list `[d...]T(p...)`, e.g. `"[4,2]T(1,0)"`:
  `arange(prod(d)).reshape(d).transpose(p)`, flattened; None when `text` is not one."""
  match = _DEVICE_IOTA_RE.fullmatch(text.strip())
  if match is None:
    return None
  return _iota(parse_ints(match["reshape"]), parse_ints(match["perm"]) if match["perm"] else None)


def parse_iota_groups(text: str) -> Groups:
  """Expands iota groups, e.g. `"[4,2]<=[2,4]T(1,0)"`.

  `[G,S]<=[d...]T(p...)` means: `iota(prod(d)).reshape(d).transpose(p)`
  reshaped to `G` groups of `S` ids.
  """
  match = _IOTA_RE.fullmatch(text.strip())
  if match is None:
    raise ValueError(f"Malformed iota replica groups {text!r}.")
  dims = parse_ints(match["dims"])
  perm = parse_ints(match["perm"]) if match["perm"] else None
  ids = _iota(parse_ints(match["reshape"]), perm)
  if len(dims) != 2 or math.prod(dims) != ids.size:
    raise ValueError(
      f"Iota replica groups {text!r}: group dims {dims} must be [groups, "
      f"size] with product {ids.size}."
    )
  return tuple(tuple(int(i) for i in row) for row in ids.reshape(dims))


def mesh_axes_groups(
  axis_sizes: Sequence[int],
  group_axes: Sequence[tuple[int, int | None, int | None]],
  device_ids: Sequence[int] | None = None,
) -> Groups:
  """Groups of devices varying along some (sub-)axes of a row-major mesh.

  Args:
    axis_sizes: Mesh shape.
    group_axes: `(axis, pre_size, size)` per grouped axis; `pre_size` and
      `size` are None for a whole axis. A sub-axis `(pre, size)` is the
      factor of size `size` after (more minor than) factors of total `pre`.
    device_ids: Device id at each row-major mesh position; default iota.

  Returns:
    One group per combination of the non-grouped coordinates.
  """
  splits = [{1, n} for n in axis_sizes]
  for axis, pre, size in group_axes:
    if pre is not None:
      splits[axis] |= {pre, pre * size}
  splits = [sorted(s) for s in splits]
  factors = [[b // a for a, b in zip(s, s[1:])] or [1] for s in splits]
  offsets = np.cumsum([0] + [len(f) for f in factors])
  grouped = []
  for axis, pre, size in group_axes:
    lo = 0 if pre is None else splits[axis].index(pre)
    hi = len(factors[axis]) if pre is None else splits[axis].index(pre * size)
    grouped.extend(range(offsets[axis] + lo, offsets[axis] + hi))
  ids = np.arange(math.prod(axis_sizes)) if device_ids is None else device_ids
  refined = np.asarray(ids).reshape([f for fs in factors for f in fs])
  others = [d for d in range(refined.ndim) if d not in grouped]
  group_size = math.prod(refined.shape[d] for d in grouped)
  rows = refined.transpose(others + grouped).reshape(-1, group_size)
  return tuple(tuple(int(i) for i in row) for row in rows)


def parse_mesh_groups(text: str) -> Groups:
  """Expands mesh-axes groups, e.g. `"mesh['x'=2,'y'=4] {'y'}"`.

  The mesh may carry `device_ids=(...)`, either an iota `[4,2]T(1,0)` or an
  explicit comma-separated list; grouped axes may be sub-axes `'x':(1)2`.
  """
  match = _MESH_RE.fullmatch(text.strip())
  if match is None:
    raise ValueError(f"Malformed mesh replica groups {text!r}.")
  axes = _MESH_AXIS_RE.findall(match["axes"])
  names = [name for name, _ in axes]
  sizes = [int(size) for _, size in axes]
  device_ids = None
  if match["ids"]:
    device_ids = iota_device_ids(match["ids"])
    if device_ids is None:
      device_ids = np.array(parse_ints(match["ids"].strip("[] ")))
  group_axes = []
  for ref in filter(None, (r.strip() for r in match["refs"].split(","))):
    ref_match = _AXIS_REF_RE.fullmatch(ref)
    if ref_match is None or ref_match["name"] not in names:
      raise ValueError(f"Unknown mesh axis {ref!r} in replica groups {text!r}.")
    pre = int(ref_match["pre"]) if ref_match["pre"] else None
    size = int(ref_match["size"]) if ref_match["size"] else None
    group_axes.append((names.index(ref_match["name"]), pre, size))
  return mesh_axes_groups(sizes, group_axes, device_ids)


def parse_replica_groups(attrs: str) -> Groups | None:
  """Replica groups of an instruction's attributes, in any of the formats
  (explicit, iota, mesh axes); `()` for `{}` (all), None when absent."""
  match = _REPLICA_GROUPS_RE.search(attrs)
  if match is None:
    return None
  value = match["value"]
  if value.startswith("mesh"):
    return parse_mesh_groups(value)
  if value.startswith("["):
    return parse_iota_groups(value)
  return parse_explicit_groups(value)


def parse_source_target_pairs(attrs: str) -> Groups:
  """The `source_target_pairs` of a collective-permute's attributes, e.g.
  `((0, 1), (1, 0))`; `()` when absent."""
  match = _PAIRS_RE.search(attrs)
  return parse_explicit_groups(match["value"]) if match else ()


def permute_groups(pairs: Iterable[Sequence[int]]) -> Groups:
  """Connected components of collective-permute source->target pairs, each
  sorted, ordered by smallest member; `((0,1),(1,0),(2,2))` -> `((0,1),(2,))`.
  """
  parent: dict[int, int] = {}

  def root(i: int) -> int:
    while parent.setdefault(i, i) != i:
      i = parent[i]
    return i

  for source, target in pairs:
    parent[root(source)] = root(target)
  components: dict[int, list[int]] = {}
  for i in sorted(parent):
    components.setdefault(root(i), []).append(i)
  return tuple(sorted(tuple(c) for c in components.values()))


def crossed_axes(
  pairs: Iterable[Sequence[int]], axis_names: Sequence[str], axis_sizes: Sequence[int]
) -> tuple[str, ...]:
  """The mesh axes along which some source->target pair of a collective-permute moves
  (its devices' coordinates differ), in mesh order: the links its hops take. Device
  position `i` is the row-major index over `axis_sizes`."""
  crossed = set()
  for source, target in pairs:
    a, b = np.unravel_index(source, axis_sizes), np.unravel_index(target, axis_sizes)
    crossed |= {i for i, (x, y) in enumerate(zip(a, b)) if x != y}
  return tuple(axis_names[i] for i in sorted(crossed))


def group_mode(opcode: str, attrs: str) -> str:
  """How a collective's ids are interpreted (XLA's CollectiveOpGroupMode).

  Returns one of 'cross_replica', 'cross_partition',
  'cross_replica_and_partition', 'flattened_id'.
  """
  if "channel_id=" not in attrs:
    return "cross_replica"
  if opcode.startswith(("all-to-all", "collective-permute")):
    return "cross_partition"
  if "use_global_device_ids=true" in attrs:
    return "flattened_id"
  return "cross_replica_and_partition"


def device_groups(groups: Groups, mode: str, num_replicas: int, num_partitions: int) -> Groups:
  """Converts id groups in `mode` to groups of flattened device ids
  `replica * num_partitions + partition`. Empty `groups` means all ids."""
  r_all, p_all = range(num_replicas), range(num_partitions)
  if mode == "flattened_id":
    return groups or (tuple(range(num_replicas * num_partitions)),)
  if mode == "cross_partition":
    groups = groups or (tuple(p_all),)
    return tuple(tuple(r * num_partitions + p for p in g) for r in r_all for g in groups)
  groups = groups or (tuple(r_all),)
  if mode == "cross_replica":
    return tuple(tuple(r * num_partitions + p for r in g) for p in p_all for g in groups)
  if mode == "cross_replica_and_partition":
    return tuple(tuple(r * num_partitions + p for r in g for p in p_all) for g in groups)
  raise ValueError(f"Unknown collective group mode {mode!r}.")


def _canonical(groups: Iterable[Iterable[int]]) -> frozenset[frozenset[int]]:
  return frozenset(frozenset(g) for g in groups)


def axes_for_groups(
  groups: Iterable[Iterable[int]],
  axis_names: Sequence[str],
  axis_sizes: Sequence[int],
) -> tuple[str, ...] | None:
  """Mesh axes whose combination produces exactly `groups`.

  Device position `i` is the row-major index over `axis_sizes`. Among the
  subsets of axes that match, the smallest (first in mesh order) is returned,
  so size-1 axes are left out. Returns `()` when every group is a single
  device and None when no subset of axes matches (e.g. groups that do not
  cover the mesh, or that cut across axes).
  """
  target = _canonical(groups)
  for k in range(len(axis_names) + 1):
    for subset in itertools.combinations(range(len(axis_names)), k):
      candidate = mesh_axes_groups(axis_sizes, [(a, None, None) for a in subset])
      if _canonical(candidate) == target:
        return tuple(axis_names[a] for a in subset)
  return None
