"""Named dimensions: classes of (value, dim) pairs that share a factor of some op.

Two dims join one class when one factor of an op is the *major* factor of both: a merged
dim `[B*S]` joins the batch class (sharding it on an axis shards B), not the seq class.
Loop carries tie their dims across the body. A value or op with two dims (factors) in
one class is a conflict (attention scores: seq x seq). Classes with the same structural
signature, the same argument dims up to layer indices (`block_3` ~ `block_7`), form a
group: the FFN hidden dims of all layers of a transformer are one group.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from automap_rl.ir.program import Program, Role

_LAYER_INDEX = re.compile(r"\d+")
_NUM_EXAMPLES = 3


@dataclasses.dataclass(frozen=True)
class DimClass:
  """A named dimension.

  Attributes:
    id: index in `NamedDims.classes`.
    size: the most common size among its members.
    num_members: how many (value, dim) pairs belong to it.
    group: the id of its structural group.
    examples: a few argument dims in it (`params/block_0/mlp/fc1/kernel:1`), or, for
      classes of intermediates only, a few producing ops (`dot_general[16,64,512]:2`).
  """

  id: int
  size: int
  num_members: int
  group: int
  examples: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Conflict:
  """A value or op that has two dims (factors) of one class."""

  class_id: int
  kind: str  # "value" or "op"
  count: int
  example: str


@dataclasses.dataclass(frozen=True)
class NamedDims:
  """The named-dimension analysis of a program.

  Attributes:
    dim_offsets: value v's dims are `dim_class[dim_offsets[v]:dim_offsets[v+1]]`, shape
      [num_values + 1].
    dim_class: class of every (value, dim), -1 for size-1 dims, shape [num_dims].
    factor_offsets: op o's factors are `factor_class[factor_offsets[o]:factor_offsets[o+1]]`,
      shape [num_ops + 1].
    factor_class: class of every op factor, -1 for factors major in no dim, shape
      [num_factors].
    classes: the named dimensions.
    groups: the class ids of each structural group.
    conflicts: per class and kind, how often and one example.
  """

  dim_offsets: np.ndarray
  dim_class: np.ndarray
  factor_offsets: np.ndarray
  factor_class: np.ndarray
  classes: tuple[DimClass, ...]
  groups: tuple[tuple[int, ...], ...]
  conflicts: tuple[Conflict, ...]

  def class_of(self, value_id: int, dim: int) -> int:
    return int(self.dim_class[self.dim_offsets[value_id] + dim])

  def value_classes(self, value_id: int) -> np.ndarray:
    return self.dim_class[self.dim_offsets[value_id] : self.dim_offsets[value_id + 1]]

  def op_factor_classes(self, op_id: int) -> np.ndarray:
    return self.factor_class[self.factor_offsets[op_id] : self.factor_offsets[op_id + 1]]


def _major_dims(program: Program, dim_offsets: np.ndarray):
  """Yields (op, factor, global dim node) for each dim whose major factor is `factor`."""
  for op in program.ops:
    for values, dims in ((op.operands, op.rule.operand_dims), (op.results, op.rule.result_dims)):
      for value_id, dim_factors in zip(values, dims):
        base = dim_offsets[value_id]
        for dim, factors in enumerate(dim_factors):
          if factors:
            yield op.id, factors[0], base + dim


def analyze(program: Program) -> NamedDims:
  """Finds the named dimensions, conflicts and groups of `program`."""
  ranks = np.array([len(v.shape) for v in program.values], dtype=np.int64)
  dim_offsets = np.concatenate([[0], np.cumsum(ranks)])
  num_dims = int(dim_offsets[-1])
  dim_sizes = np.array([s for v in program.values for s in v.shape], dtype=np.int64)
  factor_offsets = np.concatenate(
    [[0], np.cumsum([op.rule.num_factors for op in program.ops])]
  ).astype(np.int64)

  owners = np.array(list(_major_dims(program, dim_offsets)), dtype=np.int64).reshape(-1, 3)
  factor_ids = factor_offsets[owners[:, 0]] + owners[:, 1]
  nodes = owners[:, 2]
  # Chain the dims that share a factor; ties join carried dims.
  order = np.argsort(factor_ids, kind="stable")
  same = factor_ids[order][1:] == factor_ids[order][:-1]
  rows, cols = [nodes[order][:-1][same]], [nodes[order][1:][same]]
  for a, b in program.ties:
    n = ranks[a]
    rows.append(dim_offsets[a] + np.arange(n))
    cols.append(dim_offsets[b] + np.arange(n))
  rows, cols = np.concatenate(rows), np.concatenate(cols)
  graph = coo_matrix((np.ones(len(rows), dtype=np.int8), (rows, cols)), shape=(num_dims, num_dims))
  _, component = connected_components(graph, directed=False)

  # Classes: components holding a dim of size > 1, numbered in order of first appearance.
  shardable = dim_sizes > 1
  first = {}
  for node in np.flatnonzero(shardable):
    first.setdefault(component[node], len(first))
  remap = np.full(component.max() + 1 if num_dims else 0, -1, dtype=np.int64)
  for comp, cls in first.items():
    remap[comp] = cls
  dim_class = np.where(shardable, remap[component], -1)

  factor_class = np.full(int(factor_offsets[-1]), -1, dtype=np.int64)
  factor_class[factor_ids[::-1]] = dim_class[nodes[::-1]]  # The first major dim wins.

  classes, groups = _describe_classes(program, dim_offsets, dim_class, dim_sizes, len(first))
  conflicts = _find_conflicts(program, dim_offsets, dim_class, factor_offsets, factor_class)
  return NamedDims(dim_offsets, dim_class, factor_offsets, factor_class, classes, groups, conflicts)


def _dim_owner(dim_offsets: np.ndarray, node: int) -> tuple[int, int]:
  value_id = int(np.searchsorted(dim_offsets, node, side="right") - 1)
  return value_id, int(node - dim_offsets[value_id])


def _describe_classes(program, dim_offsets, dim_class, dim_sizes, num_classes):
  """Sizes, examples, and groups by structural signature."""
  members = collections.defaultdict(list)
  for node in np.flatnonzero(dim_class >= 0):
    members[int(dim_class[node])].append(int(node))
  producer = {}
  for op in program.ops:
    for value_id in op.results:
      producer[value_id] = op.primitive
  signatures, infos = {}, []
  for cls in range(num_classes):
    nodes = members[cls]
    size = collections.Counter(int(dim_sizes[n]) for n in nodes).most_common(1)[0][0]
    arg_dims, ops = [], collections.Counter()
    for node in nodes:
      value_id, dim = _dim_owner(dim_offsets, node)
      value = program.values[value_id]
      if value.path is not None and value.role != Role.OUTPUT:
        arg_dims.append(f"{value.path}:{dim}")
      else:
        ops[(producer.get(value_id, "const"), dim)] += 1
    if arg_dims:
      params_first = sorted(arg_dims, key=lambda d: (not d.startswith("params"), d))
      examples = tuple(params_first[:_NUM_EXAMPLES])
      signature = (size, frozenset(_LAYER_INDEX.sub("#", d) for d in arg_dims))
    else:
      examples = tuple(f"{p}:{d}" for (p, d), _ in ops.most_common(_NUM_EXAMPLES))
      signature = (size, frozenset(ops.items()))
    group = signatures.setdefault(signature, len(signatures))
    infos.append((size, len(nodes), group, examples))
  classes = tuple(DimClass(i, s, n, g, e) for i, (s, n, g, e) in enumerate(infos))
  groups = [[] for _ in signatures]
  for c in classes:
    groups[c.group].append(c.id)
  return classes, tuple(tuple(g) for g in groups)


def _find_conflicts(program, dim_offsets, dim_class, factor_offsets, factor_class):
  """Values with two dims, and ops with two factors, of one class."""
  found: dict[tuple[int, str], list] = {}

  def record(classes: np.ndarray, kind: str, describe) -> None:
    valid = classes[classes >= 0]
    if len(valid) < 2:
      return
    uniq, counts = np.unique(valid, return_counts=True)
    for cls in uniq[counts > 1]:
      entry = found.setdefault((int(cls), kind), [0, describe()])
      entry[0] += 1

  for value in program.values:
    record(
      dim_class[dim_offsets[value.id] : dim_offsets[value.id + 1]],
      "value",
      lambda v=value: f"{v.path or 'value'} {list(v.shape)}",
    )
  for op in program.ops:
    record(
      factor_class[factor_offsets[op.id] : factor_offsets[op.id + 1]],
      "op",
      lambda o=op: f"{o.primitive} -> {[list(program.values[r].shape) for r in o.results]}",
    )
  return tuple(
    Conflict(cls, kind, count, example) for (cls, kind), (count, example) in sorted(found.items())
  )
