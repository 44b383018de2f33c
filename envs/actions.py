"""Decision targets of each action space, deduplicated by the classes they cover.

Action `t * max_axes + a` shards target `t` over mesh axis `a`; the last action stops.
"""

from __future__ import annotations

import dataclasses

from automap_rl import sharding
from automap_rl.problem import Problem


@dataclasses.dataclass(frozen=True)
class Target:
  """One decision target.

  Attributes:
    name: for people (`params/wte/embedding:1`, `dim 4 (...)`, `group 2 (...)`).
    target: what `sharding.Decision` takes.
    classes: the named-dimension ids it covers, in decision order.
  """

  name: str
  target: sharding.ArgDim | sharding.Group | int
  classes: tuple[int, ...]


def _candidates(problem: Problem, action_space: str):
  program, named = problem.program, problem.named
  if action_space == "arg_dims":
    for value_id in program.inputs:
      value = program.values[value_id]
      for dim in range(len(value.shape)):
        yield f"{value.path}:{dim}", sharding.ArgDim(value.path, dim)
  elif action_space == "named_dims":
    for c in named.classes:
      yield f"dim {c.id} ({', '.join(c.examples[:1])})", c.id
  else:
    for g, members in enumerate(named.groups):
      yield (
        f"group {g} ({', '.join(named.classes[members[0]].examples[:1])}, x{len(members)})",
        sharding.Group(g),
      )


def targets(problem: Problem, action_space: str) -> tuple[Target, ...]:
  """The targets of `action_space`; the first of each set of equal class sets, none empty."""
  seen, out = set(), []
  for name, target in _candidates(problem, action_space):
    classes = sharding.classes_of(target, problem.program, problem.named)
    key = frozenset(classes)
    if classes and key not in seen:
      seen.add(key)
      out.append(Target(name, target, tuple(classes)))
  return tuple(out)
