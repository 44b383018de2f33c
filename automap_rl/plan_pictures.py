"""Pictures of a plan: how its largest arguments are split over the devices, as text
(`diagram`) and as a figure (`plot`); `Plan.diagram` and `Plan.plot` call them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from jax.sharding import PartitionSpec

from automap_rl.mesh import spec_axes

if TYPE_CHECKING:
  from automap_rl.plan import Plan


def shard_blocks(
  shape: Sequence[int], spec: PartitionSpec, axis_names: Sequence[str], axis_sizes: Sequence[int]
) -> tuple[tuple[int, ...], dict[tuple[int, ...], list[int]]]:
  """How an array of `shape` with `spec` is split over a row-major mesh.

  Returns:
    The number of blocks per dimension, and for each block index the devices (row-major
    mesh ids) that hold it (several when it is replicated over some axes).
  """
  per_dim = spec_axes(spec, len(shape))
  size = dict(zip(axis_names, axis_sizes))
  counts = tuple(math.prod(size[a] for a in axes) for axes in per_dim)
  holders: dict[tuple[int, ...], list[int]] = {}
  for device, coord in enumerate(np.ndindex(*axis_sizes)):
    at = dict(zip(axis_names, coord))
    block = []
    for axes in per_dim:
      index = 0
      for a in axes:
        index = index * size[a] + at[a]
      block.append(index)
    holders.setdefault(tuple(block), []).append(device)
  return counts, holders


def _view_dims(counts: Sequence[int], shape: Sequence[int]) -> tuple[int | None, int | None]:
  """The (row, column) dims to draw: the sharded ones first, then the largest, in order."""
  order = sorted(range(len(shape)), key=lambda d: (counts[d] == 1, -shape[d]))
  chosen = sorted(order[:2])
  if not chosen:
    return None, None
  return (None, chosen[0]) if len(chosen) == 1 else (chosen[0], chosen[1])


def _devices_at(holders, row_dim, col_dim, r: int, c: int) -> list[int]:
  """Devices holding any block whose drawn indices are (r, c) (undrawn dims merged)."""
  out = set()
  for block, devices in holders.items():
    if block[col_dim] == c and (row_dim is None or block[row_dim] == r):
      out.update(devices)
  return sorted(out)


def diagram(plan: Plan, count: int = 3, max_cells: int = 8) -> str:
  """A text picture of how the largest arguments are split: a grid of blocks (two dims
  drawn, the sharded ones first), each cell listing the devices that hold it."""
  out = []
  for path, shape, spec in plan.main_arguments(count):
    counts, holders = shard_blocks(shape, spec, plan.mesh.axis_names, plan.mesh.axis_sizes)
    row_dim, col_dim = _view_dims(counts, shape)
    rows = 1 if row_dim is None else counts[row_dim]
    cols = counts[col_dim]
    label = lambda r, c: ",".join(map(str, _devices_at(holders, row_dim, col_dim, r, c)))
    width = max(
      len(label(r, c)) for r in range(min(rows, max_cells)) for c in range(min(cols, max_cells))
    )
    drawn = [f"dim {d} ({shape[d]}) in {counts[d]}" for d in (row_dim, col_dim) if d is not None]
    out.append(
      f"{path} {list(shape)} {tuple(spec)}: rows {drawn[0] if row_dim is not None else '-'}, "
      f"columns {drawn[-1]}; cells list the devices holding each block"
    )
    sep = "+" + "+".join("-" * (width + 2) for _ in range(min(cols, max_cells))) + "+"
    out.append(sep)
    for r in range(min(rows, max_cells)):
      out.append(
        "|"
        + "|".join(f" {label(r, c):^{width}} " for c in range(min(cols, max_cells)))
        + "|"
        + (" ..." if cols > max_cells else "")
      )
      out.append(sep)
    if rows > max_cells:
      out.append("  ...")
    out.append("")
  return "\n".join(out)


def plot(plan: Plan, path: str, count: int = 4) -> str:
  """Draws the largest arguments as grids of shards colored by device (matplotlib, Agg);
  returns `path`."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  args = plan.main_arguments(count)
  fig, axes = plt.subplots(
    1, max(len(args), 1), figsize=(4.2 * max(len(args), 1), 4.2), squeeze=False
  )
  cmap = plt.get_cmap("tab10" if plan.mesh.num_devices <= 10 else "tab20")
  for ax, (name, shape, spec) in zip(axes[0], args):
    counts, holders = shard_blocks(shape, spec, plan.mesh.axis_names, plan.mesh.axis_sizes)
    row_dim, col_dim = _view_dims(counts, shape)
    rows = 1 if row_dim is None else counts[row_dim]
    cols = counts[col_dim]
    for r in range(rows):
      for c in range(cols):
        devices = _devices_at(holders, row_dim, col_dim, r, c)
        ax.add_patch(
          plt.Rectangle(
            (c / cols, 1 - (r + 1) / rows),
            1 / cols,
            1 / rows,
            facecolor=cmap(devices[0] % cmap.N),
            edgecolor="black",
            linewidth=1.0,
          )
        )
        if rows * cols <= 64:
          ax.text(
            (c + 0.5) / cols,
            1 - (r + 0.5) / rows,
            "\n".join(map(str, devices)),
            ha="center",
            va="center",
            fontsize=8 if len(devices) < 4 else 6,
          )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"dim {col_dim} ({shape[col_dim]}) / {cols}")
    ax.set_ylabel("-" if row_dim is None else f"dim {row_dim} ({shape[row_dim]}) / {rows}")
    ax.set_title(f"{name}\n{list(shape)} {tuple(spec)}", fontsize=8)
  fig.suptitle(
    f"plan by {plan.agent} on {plan.mesh_name}: blocks colored by their first device, "
    f"labelled with every device holding them",
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
