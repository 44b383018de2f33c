"""What each argument of a training step is, read from what the step returns.

A training step returns the arguments it updates, `step(params, opt_state, batch) ->
(params, opt_state, loss)`: an argument whose pytree comes back among the outputs (the
same structure, shapes and dtypes) is state the step replaces. Among those:

* optimizer state holds optax's state types, or else mirrors another updated argument's
  leaves and is mirrored by none (Adam's `mu` and `nu` have the parameters' shapes, plus a
  step count);
* the parameters are the largest of what the optimizer state mirrors (not the batch-norm
  statistics, whose shapes the parameters hold too), or, with no optimizer state, the one
  updated argument;
* anything else updated is non-trainable `state` (batch-norm statistics, counters).

Arguments the step does not return are `input`s. Updated arguments are donated: the step
replaces them, so their buffers may hold its outputs (`donated_argnums`, the one rule of
donation for tracing, the simulator's memory and `Plan.jit`).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from automap_rl.ir.program import Program, Role
from automap_rl.ir.trace import trace


@dataclasses.dataclass(frozen=True)
class InferredRoles:
  """Argument roles read off a step.

  Attributes:
    roles: a role per positional argument (`parameter`, `optimizer_state`, `state`,
      `input`).
    doubts: why the roles may be wrong, one sentence each (empty when the step returns
      its parameters updated and they could be told from the optimizer state).
  """

  roles: tuple[str, ...]
  doubts: tuple[str, ...]


def _leaf_shapes(tree: Any) -> collections.Counter:
  """The multiset of (shape, dtype) of a pytree's array leaves."""
  return collections.Counter((tuple(np.shape(x)), str(x.dtype)) for x in jax.tree.leaves(tree))


def _same_tree(a: Any, b: Any) -> bool:
  """Whether two pytrees have one structure and leaves of equal shapes and dtypes."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(
    np.shape(x) == np.shape(y) and x.dtype == y.dtype  # Typed PRNG keys have no numpy dtype.
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def _holds_optax_state(tree: Any) -> bool:
  nodes = jax.tree.leaves(tree, is_leaf=lambda x: type(x).__module__.split(".")[0] == "optax")
  return any(type(x).__module__.split(".")[0] == "optax" for x in nodes)


def _mirrors(outer: collections.Counter, inner: collections.Counter) -> bool:
  """Whether `outer` holds every leaf shape of `inner` and more (optimizer state over
  its parameters)."""
  return bool(inner) and not (inner - outer) and sum(outer.values()) > sum(inner.values())


def updated_arguments(returned: Sequence[Any], args: Sequence[Any]) -> list[int | None]:
  """For each of a step's returned pytrees, the argument it updates: the first with arrays
  and the same structure, shapes and dtypes (one not yet taken where several match), or
  None (a new value, such as the loss)."""
  taken: list[int | None] = []
  for r in returned:
    matches = [i for i, arg in enumerate(args) if jax.tree.leaves(arg) and _same_tree(arg, r)]
    taken.append(next((i for i in matches if i not in taken), matches[0] if matches else None))
  return taken


def infer_roles(
  fn: Callable[..., Any], *args: Any, arg_names: Sequence[str] | None = None
) -> InferredRoles:
  """The role of each positional argument of `fn(*args)` (nothing is run: shapes only);
  `arg_names` name them in the doubts (default `arg0`, `arg1`, ...)."""
  out = jax.eval_shape(fn, *args)
  returned = list(out) if isinstance(out, (tuple, list)) else [out]
  names = list(arg_names) if arg_names is not None else [f"arg{i}" for i in range(len(args))]
  updated = [
    i
    for i, arg in enumerate(args)
    if jax.tree.leaves(arg) and any(_same_tree(arg, r) for r in returned)
  ]
  roles = ["input"] * len(args)
  if not updated:
    return InferredRoles(
      tuple(roles),
      (
        f"the step returns none of its arguments updated, so none of "
        f"{', '.join(names)} reads as parameters",
      ),
    )
  shapes = {i: _leaf_shapes(args[i]) for i in updated}
  mirrors = lambda i, within: any(_mirrors(shapes[j], shapes[i]) for j in within if j != i)
  optimizer = {i for i in updated if _holds_optax_state(args[i])} or {
    i
    for i in updated
    if any(_mirrors(shapes[i], shapes[j]) for j in updated) and not mirrors(i, updated)
  }
  mirrored = [j for j in updated if j not in optimizer and mirrors(j, optimizer)]
  parameters = {
    j for j in mirrored if not mirrors(j, mirrored)
  }  # Not what the parameters mirror (norm statistics).
  rest = [i for i in updated if i not in optimizer | parameters]
  doubts = []
  if not parameters and len(rest) == 1:
    parameters = set(rest)
    if optimizer:
      doubts.append(
        f"the optimizer state does not mirror {names[rest[0]]}'s shapes; taken as the parameters"
      )
  elif not parameters:
    doubts.append(
      f"none of the updated arguments ({', '.join(names[i] for i in updated)}) reads as the "
      "parameters (no optimizer state mirrors one)"
    )
  for i in updated:
    roles[i] = "optimizer_state" if i in optimizer else "parameter" if i in parameters else "state"
  return InferredRoles(tuple(roles), tuple(doubts))


def donated_argnums(roles: Sequence[str | Role]) -> tuple[int, ...]:
  """The arguments a step replaces and so donates: every one but its `input`s."""
  parsed = [Role.parse(r) if isinstance(r, str) else Role(r) for r in roles]
  return tuple(i for i, role in enumerate(parsed) if role != Role.INPUT)


def trace_step(
  fn: Callable[..., Any],
  *args: Any,
  arg_names: Sequence[str] | None = None,
  arg_roles: Sequence[str | Role] | None = None,
) -> Program:
  """Traces a training step with its arguments' roles (given, else `infer_roles`, with a
  warning that names the arguments where they are in doubt) and its updated arguments
  donated (`donated_argnums`)."""
  if arg_roles is None:
    inferred = infer_roles(fn, *args, arg_names=arg_names)
    arg_roles = inferred.roles
    for doubt in inferred.doubts:
      warnings.warn(
        f"argument roles: {doubt}; the expert baselines (data parallel, Megatron, FSDP) may be "
        f"wrong. Roles used: {', '.join(arg_roles)}; pass arg_roles=(...) to say them.",
        stacklevel=3,
      )
  return trace(
    fn, *args, arg_names=arg_names, arg_roles=arg_roles, donate_argnums=donated_argnums(arg_roles)
  )
