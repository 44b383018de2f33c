"""The link each mesh axis's collectives travel over, stated by the user or inferred.

Devices sit in nodes (a GPU server, a TPU pod's ICI domain) of `Hardware.devices_per_node`
devices: inside a node they talk over ICI (`Hardware.intra_node`: NVLink on GPUs, the TPU's
inter-chip interconnect), between nodes over DCN (`Hardware.inter_node`: InfiniBand, the
data-centre network). Each mesh axis has an ICI part (the devices of one of its groups that
share a node) and a DCN part (the nodes a group spans), its size their product, as
`jax.experimental.mesh_utils.create_hybrid_device_mesh` (`mesh_shape` x `dcn_mesh_shape`)
and MaxText's `ici_*` x `dcn_*` parallelism split it.

Inferred (nothing stated): device ids are laid out row-major over the mesh (the last axis
minor) and node k holds ids `[k N, (k + 1) N)`, so the minor axes fill a node first; an
axis's ICI part is the share of each of its groups inside one node. Stated: the device grid
is the hybrid one (`device_grid`), each axis `dcn x ici` with its DCN coordinate major.

Each axis ends up with one effective `AxisLink` (a `Link`): the bandwidth and latency with
which the simulator's ring collective costs what the two-level (hierarchical) one does
(`hierarchical_link`); on a TPU torus the ICI part uses the links it really has
(`torus_links`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from automap_rl.mesh import Hardware, Mesh

__all__ = [
  "AxisLink",
  "Link",
  "axis_links",
  "device_grid",
  "format_axis_links",
  "hierarchical_link",
  "infer_dcn",
  "links_json",
  "stated_dcn",
  "torus_links",
]


@dataclasses.dataclass(frozen=True)
class Link:
  """An interconnect, seen from one device.

  Attributes:
    name: Human-readable name, e.g. "nvlink4".
    bandwidth: Bytes per second per device, in one direction.
    latency: Seconds of fixed cost per message (hop), an estimate.
  """

  name: str
  bandwidth: float
  latency: float


@dataclasses.dataclass(frozen=True)
class AxisLink(Link):
  """The one effective link of a mesh axis (`Link`'s fields), and what it is made of.

  Attributes:
    ici: Devices of one group of the axis inside one node (its ICI part).
    dcn: Nodes one group spans (its DCN part); the axis's size is `ici * dcn`.
    ici_links: ICI links per device (one direction each) a ring over the ICI part uses at
      once: 1 in a switched node (NVSwitch); on a torus 2 per dimension with wraparound
      (a bidirectional ring) and 1 per dimension without (`torus_links`).
    stated: Whether the user stated the split (else it was inferred).
  """

  ici: int = 1
  dcn: int = 1
  ici_links: int = 1
  stated: bool = False


def hierarchical_link(ici: int, ici_link: Link, dcn: int, dcn_link: Link) -> tuple[float, float]:
  """`(bandwidth, latency)` of one link over which a ring collective over `a = ici * dcn`
  devices costs what the two-level collective costs.

  The simulator prices a ring all-gather of a buffer of `B` bytes per device (the gathered
  size) over `a` devices as `(a - 1) / a * B / bw + (a - 1) * lat` (an all-reduce twice
  that, a reduce-scatter the same). The two-level all-gather first gathers across nodes
  (the `dcn` devices in the same position of their nodes: `dcn - 1` hops of the `B / a`
  shard, every device on its own share of the network at once), then inside each node
  (`ici - 1` hops of `B / ici`):

    T = (dcn - 1) / a * B / bw_dcn + (ici - 1) / ici * B / bw_ici
        + (dcn - 1) * lat_dcn + (ici - 1) * lat_ici

  (a reduce-scatter runs the same two steps in reverse order, an all-reduce both). Equating
  the per-byte and the fixed terms with the ring's, with `a - 1 = dcn (ici - 1) + (dcn - 1)`:

    1 / bw = (dcn (ici - 1) / bw_ici + (dcn - 1) / bw_dcn) / (a - 1)
    lat = ((ici - 1) lat_ici + (dcn - 1) lat_dcn) / (a - 1)

  the ring's per-hop time averaged over its hops, `dcn (ici - 1)` of them at ICI speed and
  `dcn - 1` at DCN speed. Exact for all-gather, reduce-scatter and all-reduce; all-to-all and
  collective-permute take it as an average. An axis inside one node (`dcn == 1`, one device
  included) gets `ici_link`, one across nodes only (`ici == 1`) `dcn_link`, exactly."""
  if dcn == 1 or ici == 1:
    link = ici_link if dcn == 1 else dcn_link
    return link.bandwidth, link.latency
  hops = ici * dcn - 1
  seconds_per_byte = (dcn * (ici - 1) / ici_link.bandwidth + (dcn - 1) / dcn_link.bandwidth) / hops
  latency = ((ici - 1) * ici_link.latency + (dcn - 1) * dcn_link.latency) / hops
  return 1.0 / seconds_per_byte, latency


def infer_dcn(names: Sequence[str], sizes: Sequence[int], hardware: Hardware) -> tuple[int, ...]:
  """The DCN part of each axis of a row-major mesh whose node k holds device ids
  `[k N, (k + 1) N)`, `N = hardware.devices_per_node`: the number of nodes each group of
  the axis spans, where every group puts the same number of devices in each node it touches.

  Raises:
    ValueError: an axis whose groups straddle node boundaries unevenly (no split describes
      it), naming the axis, its stride and the node size.
  """
  count, node = math.prod(sizes), hardware.devices_per_node
  if count <= node:
    return (1,) * len(sizes)
  nodes = (np.arange(count) // node).reshape(tuple(sizes))
  dcn = []
  for axis, (name, size) in enumerate(zip(names, sizes)):
    groups = np.moveaxis(nodes, axis, -1).reshape(-1, size)
    ici = int(np.sum(groups[0] == groups[0, 0]))
    runs = groups.reshape(len(groups), size // ici, ici) if size % ici == 0 else None
    if runs is None or (runs != runs[..., :1]).any() or (np.diff(runs[..., 0], axis=1) <= 0).any():
      stride = count // math.prod(sizes[: axis + 1])
      raise ValueError(
        f"axis {name!r} ({size} devices {stride} apart) straddles the {node}-device nodes of "
        f"{hardware.name} unevenly; choose sizes whose minor products tile a node, or state "
        f"its split as {name}=DCNxICI"
      )
    dcn.append(size // ici)
  return tuple(dcn)


def stated_dcn(
  names: Sequence[str], in_spec: Mapping[str, int], given: Mapping[str, int]
) -> tuple[int, ...] | None:
  """The DCN part of each axis from those stated in the spec (`NAME=DCNxICI`) and given
  by name (`make_mesh`'s `dcn`): 1 for an axis stated in neither; None when none is stated
  (all inferred).

  Raises:
    ValueError: an axis stated twice, a name that is no axis, a part that is no positive int.
  """
  if set(in_spec) & set(given):
    raise ValueError(f"axes {sorted(set(in_spec) & set(given))} split in both spec and dcn")
  stated = {**in_spec, **given}
  unknown = [name for name in stated if name not in names]
  if unknown:
    raise ValueError(f"dcn names axes {unknown} that the mesh {tuple(names)} lacks")
  for name, d in stated.items():
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
      raise ValueError(f"axis {name!r} has DCN part {d!r}; DCN parts must be positive ints")
  return tuple(stated.get(name, 1) for name in names) if stated else None


def _splits(n: int, k: int, low: int, high: int, step: int) -> bool:
  """Whether `n` is a product of `k` factors, each in `[low, high]` and a multiple of
  `step`."""
  if k == 1:
    return low <= n <= high and n % step == 0
  return any(
    _splits(n // f, k - 1, low, high, step)
    for f in range(max(low, step), min(high, n) + 1, step)
    if n % f == 0
  )


def torus_links(ici_sizes: Sequence[int], hardware: Hardware) -> tuple[int, ...]:
  """ICI links (one direction each) a ring over each axis's ICI part uses at once.

  A switched node (`hardware.torus_dims == 0`): 1. A torus of `D = torus_dims` dimensions
  of `E = torus_extent` chips: the ICI slice (the product of the ICI parts) is a torus, its
  dimensions wrapping around, when its chips are a multiple of `torus_wrap ** D` (TPU v4:
  whole 4x4x4 cubes; v5e: the whole 16x16 pod), else a mesh without wraparound. Axes take
  whole torus dimensions, the minor axis first, each the fewest dimensions that hold it
  (`E ** k >= size`) plus those left over that give it more links. An axis over `k`
  dimensions uses `2 k` links when it factors into `k` extents that are multiples of
  `torus_wrap` on a torus (a bidirectional ring per dimension: twice one direction's
  bandwidth), else `k` (a ring over a line uses each link once per direction). An axis left
  without a dimension of its own shares one: 1 link.
  """
  links = [1] * len(ici_sizes)
  dims = hardware.torus_dims
  if dims == 0:
    return tuple(links)
  extent, wrap = hardware.torus_extent, hardware.torus_wrap
  torus = math.prod(ici_sizes) % wrap**dims == 0
  axes = [a for a in reversed(range(len(ici_sizes))) if ici_sizes[a] > 1]
  need = {a: next(k for k in range(1, 64) if extent**k >= ici_sizes[a]) for a in axes}

  def ring(n: int, k: int) -> int:
    if torus and _splits(n, k, wrap, extent, wrap):
      return 2 * k
    return k if _splits(n, k, 2, extent, 1) else 0

  free = dims
  for i, a in enumerate(axes):
    if free < need[a]:
      continue
    most = max(need[a], free - sum(need[b] for b in axes[i + 1 :]))
    k = max(range(need[a], most + 1), key=lambda k: (ring(ici_sizes[a], k), -k))
    links[a] = max(ring(ici_sizes[a], k), 1)
    free -= k
  return tuple(links)


def axis_links(
  names: Sequence[str],
  sizes: Sequence[int],
  hardware: Hardware,
  dcn: Sequence[int] | None = None,
) -> tuple[AxisLink, ...]:
  """The effective link of each axis of a mesh on `hardware`.

  Args:
    names, sizes: The mesh's axes, major to minor.
    hardware: The profile whose links and node size the axes run over.
    dcn: The stated DCN part of each axis (each divides its size; the ICI parts, the
      quotients, must fit in one node together), or None to infer them (`infer_dcn`).

  Raises:
    ValueError: a stated split that contradicts the axis or the hardware, or an inferred
      layout no split describes; one line naming the numbers.
  """
  stated = dcn is not None
  if dcn is None:
    dcn = infer_dcn(names, sizes, hardware)
  for name, size, d in zip(names, sizes, dcn):
    if size % d:
      raise ValueError(f"axis {name!r} of {size} devices cannot have a DCN part of {d}")
  ici = [size // d for size, d in zip(sizes, dcn)]
  if math.prod(ici) > hardware.devices_per_node:
    parts = " x ".join(f"{n} {i}" for n, i in zip(names, ici))
    raise ValueError(
      f"ICI parts {parts} put {math.prod(ici)} devices in one node, but a node of "
      f"{hardware.name} has {hardware.devices_per_node}"
    )
  links = torus_links(ici, hardware)
  out = []
  for i, d, k in zip(ici, dcn, links):
    base = hardware.intra_node
    ici_link = Link(base.name if k == 1 else f"{base.name} x{k}", base.bandwidth * k, base.latency)
    if i == 1 and d > 1:
      name = hardware.inter_node.name
    else:
      name = ici_link.name + (f"+{hardware.inter_node.name}" if d > 1 else "")
    bandwidth, latency = hierarchical_link(i, ici_link, d, hardware.inter_node)
    out.append(AxisLink(name, bandwidth, latency, ici=i, dcn=d, ici_links=k, stated=stated))
  return tuple(out)


def device_grid(mesh: Mesh) -> np.ndarray:
  """The device id at each mesh position, int [*axis_sizes]: the hybrid layout of
  `create_hybrid_device_mesh`, node index row-major over the axes' DCN coordinates, position
  in the node row-major over their ICI coordinates, an axis's coordinate `dcn_i * ici + ici_i`
  (node k holds ids `[k N, (k + 1) N)`). For inferred splits this is the row-major grid."""
  ici = [getattr(link, "ici", size) for link, size in zip(mesh.links, mesh.axis_sizes)]
  dcn = [size // i for size, i in zip(mesh.axis_sizes, ici)]
  ids = (
    np.arange(math.prod(dcn))[:, None] * mesh.hardware.devices_per_node
    + np.arange(math.prod(ici))[None, :]
  ).reshape(*dcn, *ici)
  k = len(ici)
  order = [axis for pair in zip(range(k), range(k, 2 * k)) for axis in pair]
  return ids.transpose(order).reshape(mesh.axis_sizes)


def links_json(mesh: Mesh) -> dict[str, dict[str, Any]]:
  """Per axis: the link's name, effective GB/s (one direction), latency in microseconds,
  ICI and DCN parts, ICI links used and whether the split was stated."""
  out = {}
  for name, link in zip(mesh.axis_names, mesh.links):
    entry = {"link": link.name, "gb_per_s": link.bandwidth / 1e9, "latency_us": link.latency * 1e6}
    if isinstance(link, AxisLink):
      entry.update(ici=link.ici, dcn=link.dcn, ici_links=link.ici_links, stated=link.stated)
    out[name] = entry
  return out


def format_axis_links(mesh: Mesh) -> str:
  """One line: each axis's link, effective GB/s, latency and split, e.g.
  `links: data nvlink4+infiniband-ndr 88.5 GB/s 3.3 us (2 ici x 2 dcn, inferred)`."""
  parts = []
  for name, entry in links_json(mesh).items():
    text = f"{name} {entry['link']} {entry['gb_per_s']:.1f} GB/s {entry['latency_us']:.1f} us"
    if "ici" in entry:
      how = "stated" if entry["stated"] else "inferred"
      text += f" ({entry['ici']} ici x {entry['dcn']} dcn, {how})"
    parts.append(text)
  return "links: " + "; ".join(parts)
