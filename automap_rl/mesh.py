"""Device meshes and the hardware they run on.

A `Mesh` is a named, row-major grid of devices (the last axis is minor, as in
`jax.sharding.Mesh`) together with one `Link` per axis describing the
interconnect that collectives along that axis travel over, and the `Hardware`
profile of each device. Everything here is plain, immutable data plus a few
small functions; `to_jax_mesh` is the only bridge to JAX.

Which link each axis runs over, stated or inferred, is `automap_rl.topology`'s job; the
hardware profiles are `automap_rl.hardware`'s.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from automap_rl.hardware import HARDWARE, Hardware, get_hardware
from automap_rl.topology import AxisLink, Link, axis_links, device_grid, stated_dcn

__all__ = [
  "DEFAULT_HARDWARE",
  "HARDWARE",
  "AxisLink",
  "Hardware",
  "Link",
  "Mesh",
  "as_mesh",
  "axis_links",
  "get_hardware",
  "make_mesh",
  "parse_mesh_spec",
  "parse_mesh_split",
  "to_jax_mesh",
]


@dataclasses.dataclass(frozen=True)
class Mesh:
  """A named row-major grid of devices with one link per axis.

  Device id `i` sits at the row-major position `i` of a grid with shape
  `axis_sizes` (the last axis is minor), matching `jax.sharding.Mesh` built
  from `jax.devices()` in order, unless the axes' splits over nodes are stated
  (`topology.device_grid`).

  Attributes:
    axis_names: One unique name per axis.
    axis_sizes: Positive size of each axis.
    links: The link collectives along each axis use (`make_mesh` gives each axis its
      effective `topology.AxisLink`).
    hardware: Profile of every device.
  """

  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  links: tuple[Link, ...]
  hardware: Hardware

  def __post_init__(self):
    _check_axes(self.axis_names, self.axis_sizes)
    if len(self.links) != len(self.axis_names):
      raise ValueError(
        f"Mesh has {len(self.axis_names)} axes {self.axis_names} but {len(self.links)} links."
      )

  @property
  def num_devices(self) -> int:
    """Total number of devices, the product of the axis sizes."""
    return math.prod(self.axis_sizes)

  @property
  def shape(self) -> dict[str, int]:
    """Axis name to size, in axis order."""
    return dict(zip(self.axis_names, self.axis_sizes))

  def axis_index(self, name: str) -> int:
    """Position of axis `name` in `axis_names`."""
    try:
      return self.axis_names.index(name)
    except ValueError:
      raise ValueError(f"Mesh has no axis {name!r}; valid axes: {self.axis_names}.") from None

  def axis_size(self, name: str) -> int:
    """Size of axis `name`."""
    return self.axis_sizes[self.axis_index(name)]

  def link(self, name: str) -> Link:
    """Link used by collectives along axis `name`."""
    return self.links[self.axis_index(name)]


_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_axes(names: Sequence[str], sizes: Sequence[int]) -> None:
  """Raises ValueError unless names are unique identifiers, sizes positive."""
  if len(names) != len(sizes):
    raise ValueError(
      f"{len(names)} axis names {tuple(names)} but {len(sizes)} axis sizes {tuple(sizes)}."
    )
  if not names:
    raise ValueError("A mesh needs at least one axis.")
  seen = set()
  for name, size in zip(names, sizes):
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
      raise ValueError(f"Axis name {name!r} is not an identifier.")
    if name in seen:
      raise ValueError(f"Duplicate axis name {name!r} in {tuple(names)}.")
    seen.add(name)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
      raise ValueError(f"Axis {name!r} has size {size!r}; sizes must be positive ints.")


_SIZE_RE = re.compile(r"([+-]?\d+)(?:x([+-]?\d+))?")


def parse_mesh_split(spec: str) -> tuple[dict[str, int], dict[str, int]]:
  """Parses a mesh spec into its shape and its stated DCN parts, keeping order.

  `"data=16,model=8"` -> `({"data": 16, "model": 8}, {})`: the split of each axis over nodes
  is inferred (`topology.infer_dcn`). `"data=2x8,model=8"` -> `({"data": 16, "model": 8},
  {"data": 2})`: `NAME=DCNxICI` states the axis's DCN part (nodes, the major factor, as in
  `mesh_utils.create_hybrid_device_mesh(mesh_shape=ICI, dcn_mesh_shape=DCN)` and MaxText's
  `dcn_*` x `ici_*` parallelism) and its ICI part (devices per node); the size is their
  product.
  """
  names, sizes, dcn = [], [], {}
  for fragment in spec.split(","):
    name, sep, size = (part.strip() for part in fragment.partition("="))
    match = _SIZE_RE.fullmatch(size)
    if not sep or not name or not match:
      raise ValueError(
        f"Malformed mesh spec fragment {fragment.strip()!r} in {spec!r}; "
        "expected comma-separated name=size or name=DCNxICI, e.g. 'data=2,model=4' or "
        "'data=2x8,model=8'."
      )
    names.append(name)
    sizes.append(int(match[1]) * int(match[2] or 1))
    if match[2] is not None:
      dcn[name] = int(match[1])
  _check_axes(names, sizes)
  return dict(zip(names, sizes)), dcn


def parse_mesh_spec(spec: str) -> dict[str, int]:
  """Parses "data=2,model=4" into {"data": 2, "model": 4}, keeping order; a stated split
  `NAME=DCNxICI` gives the axis their product (`parse_mesh_split`)."""
  return parse_mesh_split(spec)[0]


def make_mesh(
  spec: str | Mapping[str, int],
  hardware: str | Hardware,
  dcn: Mapping[str, int] | None = None,
) -> Mesh:
  """Builds a `Mesh` from a spec like "data=2,model=4" (or a mapping).

  Args:
    spec: Axis names and sizes, major to minor; a string may state axes' splits as
      `NAME=DCNxICI` ("data=2x8,model=8", see `parse_mesh_split`).
    hardware: A `Hardware` profile or the name of one in `HARDWARE`.
    dcn: Stated DCN parts (nodes) by axis name, the Python form of `NAME=DCNxICI`:
      `make_mesh({"data": 16, "model": 8}, "h100", dcn={"data": 2})`.

  Once any axis's split is stated, every axis without one is all ICI (DCN part 1), as in
  `create_hybrid_device_mesh`; with none stated, all splits are inferred.

  Returns the mesh, each axis with its effective link (`topology.axis_links`); raises a
  one-line ValueError for a malformed spec or a split that contradicts the axis or the
  hardware (e.g. ICI parts that do not fit in a node), naming the numbers.
  """
  shape, in_spec = parse_mesh_split(spec) if isinstance(spec, str) else (dict(spec), {})
  hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
  names, sizes = tuple(shape), tuple(shape.values())
  _check_axes(names, sizes)
  split = stated_dcn(names, in_spec, dcn or {})
  return Mesh(names, sizes, axis_links(names, sizes, hw, split), hw)


def spec_axes(spec: Sequence[Any], rank: int) -> list[tuple[str, ...]]:
  """The mesh axes of each of `rank` dims of a `PartitionSpec` (entries None, an axis name
  or a tuple of them; missing trailing entries are replicated; `UNCONSTRAINED` names no
  axes)."""
  entries = list(spec) + [None] * (rank - len(spec))
  return [
    (e,) if isinstance(e, str) else tuple(e) if isinstance(e, (tuple, list)) else ()
    for e in entries
  ]


def to_jax_mesh(mesh: Mesh, devices: Sequence[Any] | None = None):
  """Returns a `jax.sharding.Mesh` with the same axes (all of type Auto).

  Args:
    mesh: The mesh to mirror.
    devices: Devices to use, in row-major mesh order; defaults to `jax.devices()` laid
      out as `topology.device_grid` places them (row-major where splits are inferred; node
      k holding ids `[k N, (k + 1) N)` where they are stated).
  """
  import jax  # Imported lazily: the rest of this module is pure data.

  available = list(jax.devices() if devices is None else devices)
  if len(available) < mesh.num_devices:
    raise ValueError(
      f"Mesh {mesh.shape} needs {mesh.num_devices} devices but only "
      f"{len(available)} are available. On CPU, set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.num_devices}"
      " before importing jax."
    )
  ids = device_grid(mesh) if devices is None else np.arange(mesh.num_devices)
  if len(available) <= ids.max():
    raise ValueError(
      f"Mesh {mesh.shape} with its stated splits puts devices on ids up to {ids.max()} "
      f"({mesh.hardware.devices_per_node} per node) but only {len(available)} are available."
    )
  grid = np.array(available, dtype=object)[ids.reshape(mesh.axis_sizes)]
  return jax.sharding.Mesh(
    grid,
    mesh.axis_names,
    axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
  )


DEFAULT_HARDWARE = "h100"


def as_mesh(
  mesh: Any, hardware: str | Hardware | None = None
) -> tuple[Mesh, tuple[Any, ...] | None]:
  """The `Mesh` a user means, and the devices to run on (None: the first of `jax.devices()`).

  Args:
    mesh: a spec (`"data=2,model=4"`), a mapping of axis names to sizes, a `Mesh`, or a
      `jax.sharding.Mesh` (its axis names and shape; its devices run the plan).
    hardware: the profile to price the mesh with (a name or a `Hardware`); default a
      `Mesh`'s own, else `DEFAULT_HARDWARE`. Given with a `Mesh` of another profile, the
      mesh is rebuilt for it (links included).
  """
  if isinstance(mesh, Mesh):
    if (
      hardware is None
      or (hardware if isinstance(hardware, str) else hardware.name) == mesh.hardware.name
    ):
      return mesh, None
    stated = {
      name: link.dcn
      for name, link in zip(mesh.axis_names, mesh.links)
      if isinstance(link, AxisLink) and link.stated
    }
    return make_mesh(mesh.shape, hardware, stated or None), None
  hardware = DEFAULT_HARDWARE if hardware is None else hardware
  if isinstance(mesh, (str, Mapping)):
    return make_mesh(mesh, hardware), None
  devices = getattr(mesh, "devices", None)
  if isinstance(getattr(mesh, "axis_names", None), tuple) and isinstance(devices, np.ndarray):
    return make_mesh(dict(zip(mesh.axis_names, devices.shape)), hardware), tuple(devices.flat)
  raise TypeError(
    f"mesh must be a spec like 'data=2,model=4', a mapping, an automap_rl Mesh or a "
    f"jax.sharding.Mesh; got {type(mesh).__name__}."
  )
