"""Which equations of a loss function's forward are which ops of the traced training step.

A pipelined step is built from the loss function (`automap_rl.xla.pipeline_lower`), not
from the step the plan was made for, so its equations have no `Op.origin`. The step's
forward is the loss's forward under `jax.value_and_grad`: the same equations in the same
order, with the linearization's own equations in between (a `square`'s derivative, the
residuals a scan saves). `align` finds each loss equation's counterpart in the step, so
that the pipelined step can pin what the plan decides for it.

Both jaxprs are flattened the way `automap_rl.ir.trace` walks them: call-like primitives
inlined, origins as index paths through calls and scans. Equation e of the loss matches
the first equation after the previous match with the same primitive, operand and result
types, preferring one whose operands are the counterparts of e's (the dataflow), within
a window; a scan that matches has its body aligned the same way, its body inputs
starting as the counterparts of the loss scan's operands. An equation with no
counterpart (a custom derivative rule's primal written differently) is left out, and the
alignment carries on after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jax.extend import core as jax_core

from automap_rl.ir.trace import CALL_PRIMITIVES, call_body

__all__ = ["Flat", "Origin", "align", "flatten"]

Origin = tuple[int, ...]
# How far past the previous match a counterpart is looked for, in flattened equations.
WINDOW = 256


@dataclasses.dataclass(frozen=True)
class Flat:
  """One equation of a flattened jaxpr.

  Attributes:
    origin: its index path through calls and scans.
    eqn: the equation.
    operands: its operands as the flattened jaxpr's variables (through calls), literals
      as None.
  """

  origin: Origin
  eqn: Any
  operands: tuple[Any, ...]

  def key(self) -> tuple[Any, ...]:
    """What a counterpart must share: the primitive and the operand and result types (a
    scan: its length and direction, the step's saving residuals besides)."""
    name = self.eqn.primitive.name
    if name == "scan":
      return name, self.eqn.params["length"], self.eqn.params["reverse"]
    types = lambda vs: tuple(
      (tuple(v.aval.shape), str(v.aval.dtype)) for v in vs if hasattr(v.aval, "shape")
    )
    return name, types(self.eqn.invars), types(self.eqn.outvars)


def flatten(
  jaxpr: jax_core.Jaxpr, prefix: Origin = (), alias: dict | None = None, into_scans: bool = False
) -> list[Flat]:
  """`jaxpr`'s equations with calls inlined (a scan stays one equation, followed by its
  body's with `into_scans`); `alias` maps the variables of inlined bodies to the outer ones
  they stand for (filled in)."""
  alias = {} if alias is None else alias
  canon = lambda v: None if isinstance(v, jax_core.Literal) else alias.get(v, v)
  out = []
  for index, eqn in enumerate(jaxpr.eqns):
    origin = (*prefix, index)
    if eqn.primitive.name in CALL_PRIMITIVES:
      body = call_body(eqn)
      inner = getattr(body, "jaxpr", body)
      alias.update((i, o) for i, o in zip(inner.invars, map(canon, eqn.invars)) if o is not None)
      out += flatten(inner, origin, alias, into_scans)
      alias.update(
        (o, canon(i)) for o, i in zip(eqn.outvars, inner.outvars) if canon(i) is not None
      )
    else:
      out.append(Flat(origin, eqn, tuple(map(canon, eqn.invars))))
      if into_scans and eqn.primitive.name == "scan":
        out += flatten(eqn.params["jaxpr"].jaxpr, origin, alias, into_scans)
  return out


def align(
  loss: Sequence[Flat], step: Sequence[Flat], counterpart: Mapping[Any, Any]
) -> dict[Origin, Origin]:
  """Loss origin -> step origin for every loss equation with a counterpart (module
  docstring), scan bodies included.

  Args:
    loss: the loss's flattened equations.
    step: the step's.
    counterpart: loss variable -> step variable, for the inputs known to correspond
      (extended in place as equations match).
  """
  counterpart = dict(counterpart)
  matched: dict[Origin, Origin] = {}
  by_key: dict[tuple[Any, ...], list[int]] = {}
  for i, entry in enumerate(step):
    by_key.setdefault(entry.key(), []).append(i)
  position = 0
  for entry in loss:
    candidates = [i for i in by_key.get(entry.key(), ()) if position <= i < position + WINDOW]
    if not candidates:
      continue
    agrees = lambda i: all(
      v is None or counterpart.get(v) is None or counterpart[v] == s
      for v, s in zip(entry.operands, step[i].operands)
    )
    chosen = next((i for i in candidates if agrees(i)), candidates[0])
    other = step[chosen]
    matched[entry.origin] = other.origin
    counterpart.update(zip(entry.eqn.outvars, other.eqn.outvars))
    if entry.eqn.primitive.name == "scan":
      matched.update(_align_bodies(entry, other, counterpart))
    position = chosen + 1
  return matched


def _align_bodies(loss: Flat, step: Flat, counterpart: Mapping[Any, Any]) -> dict[Origin, Origin]:
  """The alignment of two matched scans' bodies: a loss body input corresponds to the
  step body input at the position of its operand's counterpart."""
  loss_body, step_body = loss.eqn.params["jaxpr"].jaxpr, step.eqn.params["jaxpr"].jaxpr
  position = {v: i for i, v in enumerate(step.operands) if v is not None}
  inputs = {}
  for v, operand in zip(loss_body.invars, loss.operands):
    j = position.get(counterpart.get(operand))
    if j is not None:
      inputs[v] = step_body.invars[j]
  return align(flatten(loss_body, loss.origin), flatten(step_body, step.origin), inputs)
