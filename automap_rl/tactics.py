"""Expert strategies, written as PartIR-style tactics over argument paths, then decisions.

A tactic names argument dims by path pattern (`*/mlp/fc1/kernel`, dim 1) and a mesh axis;
`to_decisions` turns them into `Decision`s in order. The data axis is the mesh axis named
`data` (else the first); the model axis is `model` (else the last).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from automap_rl.ir import Role
from automap_rl.problem import Problem
from automap_rl.sharding import ArgDim, Decision

# Column-parallel dims of Megatron-style tensor parallelism (the row-parallel partner
# dims share their named dimension, so one decision shards both): attention heads, the
# FFN hidden dim, MoE experts, and the first of each pair of Haiku MLP layers.
TENSOR_PARALLEL_DIMS: tuple[tuple[str, int], ...] = (
    ("params/*attn/query/kernel", 1),
    ("params/*mlp/fc1/kernel", -1),
    ("params/*mlp/wi", 0),
    ("params/*/linear_0/w", 1),
    ("params/*/linear_2/w", 1),
)


def data_axis(problem: Problem) -> str:
  names = problem.mesh.axis_names
  return "data" if "data" in names else names[0]


def model_axis(problem: Problem) -> str:
  names = problem.mesh.axis_names
  return "model" if "model" in names else names[-1]


def _arguments(problem: Problem, role: Role):
  return [problem.program.values[v] for v in problem.program.inputs if problem.program.values[v].role == role]


def _matching(problem: Problem, patterns: Sequence[tuple[str, int]], axis: str) -> list[Decision]:
  """Decisions for every parameter dim matched by (path pattern, dim)."""
  decisions = []
  for value in _arguments(problem, Role.PARAMETER):
    for pattern, dim in patterns:
      if fnmatch.fnmatchcase(value.path, pattern) and len(value.shape) > abs(dim) - (dim < 0):
        decisions.append(Decision(ArgDim(value.path, dim % len(value.shape)), axis))
  return decisions


def replicated(problem: Problem) -> list[Decision]:
  """Everything replicated: the baseline every reward is relative to."""
  return []


def data_parallel(problem: Problem) -> list[Decision]:
  """Shard dim 0 of every input (the batch) over the data axis."""
  axis = data_axis(problem)
  return [Decision(ArgDim(v.path, 0), axis) for v in _arguments(problem, Role.INPUT) if v.shape]


def megatron(problem: Problem) -> list[Decision]:
  """Megatron tensor parallelism on the model axis: heads, FFN hidden, experts."""
  return _matching(problem, TENSOR_PARALLEL_DIMS, model_axis(problem))


def fsdp(problem: Problem) -> list[Decision]:
  """ZeRO-3/FSDP: data parallel, then every parameter (and with it its gradient and
  optimizer state) stored sharded over the data axis on its largest divisible dim,
  gathered at use."""
  axis = data_axis(problem)
  size = problem.mesh.axis_size(axis)
  decisions = data_parallel(problem)
  for value in _arguments(problem, Role.PARAMETER):
    dims = [d for d in range(len(value.shape)) if value.shape[d] % size == 0]
    if dims:
      largest = max(dims, key=lambda d: value.shape[d])
      decisions.append(Decision(ArgDim(value.path, largest), axis))
  return decisions


def data_megatron(problem: Problem) -> list[Decision]:
  """Data parallel on the data axis and Megatron on the model axis (a 2-D mesh)."""
  return data_parallel(problem) + megatron(problem)


TACTICS: dict[str, Callable[[Problem], list[Decision]]] = {
    "replicated": replicated,
    "data_parallel": data_parallel,
    "megatron": megatron,
    "fsdp": fsdp,
    "data_megatron": data_megatron,
}


def applicable(problem: Problem) -> dict[str, list[Decision]]:
  """The tactics that apply to the problem's program (Megatron needs matching layers)."""
  plans = {name: tactic(problem) for name, tactic in TACTICS.items()}
  if not megatron(problem):
    plans = {k: v for k, v in plans.items() if k not in ("megatron", "data_megatron")}
  return plans
