"""Re-interpreting a closed jaxpr equation by equation, with hooks on every equation.

`interpret` walks a jaxpr the way `automap_rl.ir.trace` does: call-like primitives are
inlined and a `scan` is bound with its body interpreted the same way, so each equation's
index path through calls and scans (its origin) is the `Op.origin` of the program op it
became. `automap_rl.xla.lower` constrains each equation's results there; the pipelined
lowerings evaluate pieces of a loss so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jax_core

from automap_rl.ir.trace import CALL_PRIMITIVES, call_body

__all__ = ["interpret"]


def _bind(eqn, invals: Sequence[Any], **replaced: Any) -> list[Any]:
  """`eqn`'s primitive applied to `invals`, with its params but `replaced`."""
  params = eqn.primitive.get_bind_params({**eqn.params, **replaced})
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*invals, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


# Calls whose custom derivative rule a differentiated interpretation keeps.
_CUSTOM_DERIVATIVES = frozenset(
  {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}
)
# Calls that rematerialize their body (`jax.checkpoint`) in a differentiated interpretation.
_REMAT = frozenset({"checkpoint", "remat", "remat2"})


def interpret(
  closed: jax_core.ClosedJaxpr,
  constrain: Callable[[tuple[int, ...], list[Any]], list[Any]],
  before: Callable[[tuple[int, ...], list[Any]], list[Any]] = lambda origin, operands: operands,
  bind: Callable[[tuple[int, ...], Any, list[Any]], list[Any]] = lambda origin, eqn, invals: _bind(
    eqn, invals
  ),
  *,
  replaced: Mapping[tuple[int, ...], Callable[[list[Any]], list[Any]]] | None = None,
  differentiable: bool = False,
  stacks: bool = False,
) -> Callable[..., list[Any]]:
  """A function evaluating `closed` equation by equation, calling `before(origin, operands)`
  on each equation's array (non-literal) operands, `bind(origin, eqn, operands)` to apply it
  and `constrain(origin, results)` on its results, for every equation outside `while` and
  `cond` bodies (calls are inlined and a `scan` is bound with its body interpreted the same
  way, so origins are index paths through calls and scans, as in `automap_rl.ir.trace`).

  `replaced`: origin -> a function computing that equation's results from its operands
  instead. `differentiable`: the function will be differentiated, so a remat call runs
  its interpreted body under `jax.checkpoint` with the same policy (its rematerialization
  kept) and a custom derivative rule's call is bound whole (its rule kept; the equations
  inside get no constraints). `stacks`: a scan's stacked outputs are treated as the
  results of an equation at the scan's origin: in the body each iteration's values go
  through `before(origin, values)`, after the loop the stacked results through
  `constrain(origin, results)`.
  """
  walker = _Walker(constrain, before, bind, replaced or {}, differentiable, stacks)
  return lambda *args: walker.walk(closed.jaxpr, closed.consts, args, ())


@dataclasses.dataclass(frozen=True)
class _Walker:
  """`interpret`'s walk over a jaxpr, with its hooks and options (see `interpret`)."""

  constrain: Callable[[tuple[int, ...], list[Any]], list[Any]]
  before: Callable[[tuple[int, ...], list[Any]], list[Any]]
  bind: Callable[[tuple[int, ...], Any, list[Any]], list[Any]]
  replaced: Mapping[tuple[int, ...], Callable[[list[Any]], list[Any]]]
  differentiable: bool
  stacks: bool

  def walk(
    self,
    jaxpr: jax_core.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    prefix: tuple[int, ...],
  ) -> list[Any]:
    """`jaxpr`'s outputs for `args`, its equations' origins under `prefix`."""
    env: dict = {}
    read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for index, eqn in enumerate(jaxpr.eqns):
      outs = self.equation(eqn, [read(v) for v in eqn.invars], (*prefix, index))
      for var, val in zip(eqn.outvars, outs):
        if not isinstance(var, jax_core.DropVar):
          env[var] = val
    return [read(v) for v in jaxpr.outvars]

  def equation(self, eqn, invals: list[Any], origin: tuple[int, ...]) -> list[Any]:
    """One equation's results from its operands `invals`, at `origin`."""
    name = eqn.primitive.name
    if origin in self.replaced:
      return self.replaced[origin](invals)
    if self.differentiable and name in _CUSTOM_DERIVATIVES:
      return _bind(eqn, invals)
    if name in CALL_PRIMITIVES:
      body = call_body(eqn)
      run = lambda *a: self.walk(
        getattr(body, "jaxpr", body), getattr(body, "consts", ()), a, origin
      )
      if self.differentiable and name in _REMAT:
        run = jax.checkpoint(
          run, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
        )
      return run(*invals)
    if name == "scan":
      carried = eqn.params["num_carry"]
      outs = _bind(eqn, invals, jaxpr=self.scan_body(eqn.params["jaxpr"], origin, carried))
      if self.stacks:
        outs[carried:] = self.constrain(origin, outs[carried:])
      return outs
    arrays = [i for i, v in enumerate(eqn.invars) if not isinstance(v, jax_core.Literal)]
    for i, x in zip(arrays, self.before(origin, [invals[i] for i in arrays])):
      invals[i] = x
    return self.constrain(origin, self.bind(origin, eqn, invals))

  def scan_body(
    self, body: jax_core.ClosedJaxpr, prefix: tuple[int, ...], carried: int
  ) -> jax_core.ClosedJaxpr:
    """A scan's body, interpreted with origins under `prefix` (the scan's): the same
    inputs and outputs, so the scan's other params stay valid (constants the trace hoists
    stay in the closed jaxpr, which `scan` accepts); with `stacks`, its outputs after the
    `carried` carries go through `before(prefix, ...)`."""

    def run(*args):
      outs = self.walk(body.jaxpr, body.consts, args, prefix)
      return [*outs[:carried], *self.before(prefix, outs[carried:])] if self.stacks else outs

    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in body.in_avals]
    return jax.make_jaxpr(run)(*avals)
