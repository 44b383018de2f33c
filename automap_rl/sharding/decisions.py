"""Decisions: which mesh axis shards which target (an argument dim, a named dimension or a
group), and their expansion into class decisions."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

import numpy as np

from automap_rl.ir import NamedDims, Program
from automap_rl.mesh import Mesh


@dataclasses.dataclass(frozen=True)
class ArgDim:
  """Dimension `dim` of the argument at pytree path `path` (`params/block_0/mlp/fc1/kernel`)."""

  path: str
  dim: int


@dataclasses.dataclass(frozen=True)
class Group:
  """A structural group of named dimensions, by id."""

  id: int


@dataclasses.dataclass(frozen=True)
class Decision:
  """Shard `target` over mesh axis `axis`. An `int` target is a named-dimension id."""

  target: ArgDim | Group | int
  axis: str


def classes_of(target: ArgDim | Group | int, program: Program, named: NamedDims) -> tuple[int, ...]:
  """The named-dimension ids a target covers; ValueError names a bad path, dim or id."""
  if isinstance(target, ArgDim):
    paths = {program.values[v].path: v for v in program.inputs}
    if target.path not in paths:
      close = difflib.get_close_matches(target.path, list(paths), n=3)
      raise ValueError(f"No argument at path {target.path!r}; did you mean {close}?")
    value = program.values[paths[target.path]]
    if not 0 <= target.dim < len(value.shape):
      raise ValueError(
        f"Argument {target.path!r} of shape {value.shape} has no dimension {target.dim}."
      )
    cls = named.class_of(value.id, target.dim)
    return () if cls < 0 else (cls,)
  if isinstance(target, Group):
    if not 0 <= target.id < len(named.groups):
      raise ValueError(f"No group {target.id}; the program has {len(named.groups)} groups.")
    return named.groups[target.id]
  if not 0 <= int(target) < len(named.classes):
    raise ValueError(f"No named dimension {target}; the program has {len(named.classes)}.")
  return (int(target),)


def encode(
  decisions: Sequence[Decision],
  program: Program,
  named: NamedDims,
  mesh: Mesh,
  length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Expands decisions to parallel arrays `(classes, axes)` of shape [length], padded with -1."""
  classes, axes = [], []
  for decision in decisions:
    axis = mesh.axis_index(decision.axis)
    for cls in classes_of(decision.target, program, named):
      classes.append(cls)
      axes.append(axis)
  length = len(classes) if length is None else length
  if len(classes) > length:
    raise ValueError(f"{len(classes)} class decisions do not fit in length {length}.")
  pad = length - len(classes)
  return np.array(classes + [-1] * pad, np.int32), np.array(axes + [-1] * pad, np.int32)
