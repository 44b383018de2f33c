"""An unrolled layer stack's loss split into embedding, repeated segment and head, for
`scheduled.run_schedule` (the counterpart of `staged_loss._Split` for scanned stacks).

The loss on one microbatch is flattened (`correspond.flatten`: calls inlined) and each of
its equations labelled with the layer of its counterpart in the planned step
(`LayerStack.op_layer`, through `correspond.align`). Layer l's first labelled equation
starts segment l; the segments are the stretches of one period (the distance between
layer 0's and layer 1's starts) from there, and must repeat equation for equation (the
same primitives on the same types). Segment 0 is the repeated body; what a segment reads
from outside itself is, position by position over the segments: the same value in every
segment (a constant), a different parameter leaf in each (a stacked weight: the leaves
stacked [L, ...]), or a value the segment before made (a carry; segment 0's comes from
before the stack). The equations before segment 0 embed, those after the last compute
the head and the loss, given the last segment's carries. Each equation is pinned as its
counterpart in the planned step; every segment takes segment 0's pins.

NotImplementedError (one line) where the loss does not split so: segments that differ,
a value read by the head from inside the stack other than its carries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from automap_rl.ir.stacks import LayerStack
from automap_rl.ir.trace import CALL_PRIMITIVES, call_body
from automap_rl.problem import Problem
from automap_rl.xla.correspond import Flat, Origin, flatten
from automap_rl.xla.step_pins import StepPins

__all__ = ["UnrolledSplit"]


def _segments(flat: Sequence[Flat], labels: Sequence[int], stack: LayerStack) -> tuple[int, int]:
  """(start of segment 0, period) of the stack's layers among `flat`."""
  firsts = [labels.index(layer) if layer in labels else -1 for layer in range(stack.layers)]
  period = firsts[1] - firsts[0] if len(firsts) > 1 else len(flat) - firsts[0]
  start = firsts[0]
  regular = min(firsts) >= 0 and all(f == start + i * period for i, f in enumerate(firsts))
  end = start + stack.layers * period
  keys = lambda layer: [
    e.key() for e in flat[start + layer * period : start + (layer + 1) * period]
  ]
  if (
    not regular
    or period < 1
    or end > len(flat)
    or any(keys(layer) != keys(0) for layer in range(1, stack.layers))
  ):
    raise NotImplementedError(
      f"the layers of the {stack.describe()} do not repeat equation for equation in the loss; "
      "the scheduled lowering pipelines unrolled stacks whose layers do"
    )
  return start, period


def _inner_consts(jaxpr: jax_core.Jaxpr) -> dict:
  """The constants of the closed bodies of `jaxpr`'s calls (through calls) and the
  literals they are called with, by variable: `flatten` inlines the bodies but not
  these."""
  out = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in CALL_PRIMITIVES:
      body = call_body(eqn)
      inner = getattr(body, "jaxpr", body)
      out.update(zip(inner.constvars, getattr(body, "consts", ())))
      out.update(
        (i, o.val) for i, o in zip(inner.invars, eqn.invars) if isinstance(o, jax_core.Literal)
      )
      out.update(_inner_consts(inner))
  return out


class UnrolledSplit:
  """The split of the loss on a microbatch (module docstring), with the interface of
  `staged_loss._Split`: `is_stacked`, `prepare`, `embed`, `head`, `chunk_fn`."""

  def __init__(
    self,
    closed: jax_core.ClosedJaxpr,
    stack: LayerStack,
    problem: Problem,
    aligned: Mapping[Origin, Origin],
    pins: StepPins,
    mesh: jax.sharding.Mesh,
    manual: frozenset[str],
  ):
    self.closed, self.pins, self.mesh, self.manual = closed, pins, mesh, manual
    self.alias: dict = {}
    self.flat = flatten(closed.jaxpr, alias=self.alias)
    op_of = {op.origin: op.id for op in problem.program.ops if op.origin}
    labels = []
    for e in self.flat:
      op = op_of.get(aligned.get(e.origin))
      labels.append(-1 if op is None else int(stack.op_layer[op]))
    self.start, self.period = _segments(self.flat, labels, stack)
    self.layers = stack.layers
    self.end = self.start + self.layers * self.period
    self.aligned = {o: s for o, s in aligned.items()}
    self.entries = {e.origin: e for e in self.flat}
    self.invars = list(closed.jaxpr.invars)
    self._slots(stack)

  def _segment(self, layer: int) -> Sequence[Flat]:
    return self.flat[self.start + layer * self.period : self.start + (layer + 1) * self.period]

  def _free(self, layer: int) -> dict[tuple[int, int], Any]:
    """What segment `layer` reads from outside itself: (equation, operand) position in the
    segment -> the variable read there."""
    defined, out = set(), {}
    for k, e in enumerate(self._segment(layer)):
      out.update(
        ((k, i), v) for i, v in enumerate(e.operands) if v is not None and v not in defined
      )
      defined.update(e.eqn.outvars)
    return out

  def _read(self, layer: int, at: tuple[int, int], free: Mapping) -> Any:
    """The variable, or literal, segment `layer` reads at position `at`."""
    if at in free:
      return free[at]
    var = self._segment(layer)[at[0]].eqn.invars[at[1]]
    if not isinstance(var, jax_core.Literal):
      raise NotImplementedError(
        "the layers of the unrolled stack read values made inside one layer and outside another"
      )
    return var

  def _made(self, layer: int) -> list[Any]:
    """Segment `layer`'s results, in order."""
    return [v for e in self._segment(layer) for v in e.eqn.outvars]

  def _slots(self, stack: LayerStack) -> None:
    """Classifies segment 0's reads into constants, stacked weights and carries."""
    frees = [self._free(layer) for layer in range(self.layers)]
    if self.layers < 2:
      raise NotImplementedError(f"the {stack.describe()} has one layer: nothing to pipeline")
    self.positions = sorted(set().union(*frees))
    free = [
      [self._read(layer, at, frees[layer]) for at in self.positions] for layer in range(self.layers)
    ]
    position = {v: i for i, v in enumerate(self.invars)}
    literal = lambda v: isinstance(v, jax_core.Literal)
    made = [set(self._made(layer)) for layer in range(self.layers)]
    self.consts, self.weights, self.carries = [], [], []  # Slot positions.
    self.weight_leaves: list[list[int]] = []  # Per weight slot: the invar position per layer.
    for j, reads in enumerate(zip(*free)):
      if all(v is reads[0] for v in reads) and not literal(reads[0]):
        self.consts.append(j)
      elif not any(map(literal, reads)) and all(v in position for v in reads):
        self.weights.append(j)
        self.weight_leaves.append([position[v] for v in reads])
      elif all(
        not literal(reads[layer]) and reads[layer] in made[layer - 1]
        for layer in range(1, self.layers)
      ):
        self.carries.append(j)
      else:
        raise NotImplementedError(
          f"a layer of the {stack.describe()} reads a value that is neither a constant, its "
          "own weight nor the layer before's result"
        )
    self.free0 = free[0]
    # Segment 0's results that segment 1 reads as its carries, and the last segment's.
    made0, made_last = self._made(0), self._made(self.layers - 1)
    self.carry_out0 = [free[1][j] for j in self.carries]
    self.last_outs = [made_last[made0.index(v)] for v in self.carry_out0]
    stacked = {p for leaves in self.weight_leaves for p in leaves}
    self.is_stacked = [i in stacked for i in range(len(self.invars))]
    inner = set().union(*made[:-1]) | (made[-1] - set(self.last_outs))
    head_reads = {v for e in self.flat[self.end :] for v in e.operands if v is not None}
    if head_reads & inner:
      raise NotImplementedError(
        f"the head reads values from inside the {stack.describe()}; the scheduled lowering "
        "pipelines stacks whose head reads only the last layer's results"
      )

  def _run(
    self, entries: Sequence[Flat], env: dict, in_stage: bool, reads: Mapping | None = None
  ) -> dict:
    """Evaluates `entries` into `env` (canonical variable -> value), each pinned as its
    counterpart in the planned step; `reads`: (equation, operand) position -> the value
    read there instead."""
    reads = reads or {}
    origin_of = lambda e: e.origin
    targets = {origin_of(e): e for e in entries}
    aligned = {o: self.aligned[o] for o in targets if o in self.aligned}
    before, constrain, bind = self.pins.constrainer(
      aligned, targets, self.manual, self.mesh, in_stage=in_stage
    )
    for k, e in enumerate(entries):
      origin = origin_of(e)
      invals = [
        reads[k, i] if (k, i) in reads else v.val if isinstance(v, jax_core.Literal) else env[c]
        for i, (v, c) in enumerate(zip(e.eqn.invars, e.operands))
      ]
      arrays = [i for i, v in enumerate(e.eqn.invars) if not isinstance(v, jax_core.Literal)]
      for i, x in zip(arrays, before(origin, [invals[i] for i in arrays])):
        invals[i] = x
      outs = constrain(origin, bind(origin, e.eqn, invals))
      for var, val in zip(e.eqn.outvars, outs):
        if not isinstance(var, jax_core.DropVar):
          env[var] = val
    return env

  def _consts_env(self) -> dict:
    """The loss's constants and its calls' (by variable)."""
    env = dict(zip(self.closed.jaxpr.constvars, self.closed.consts))
    env.update(_inner_consts(self.closed.jaxpr))
    return env

  def _start_env(self, leaves: Sequence[Any]) -> dict:
    env = self._consts_env()
    env.update(zip(self.invars, leaves))
    return env

  def prepare(self, param_leaves: list[Any], first: list[Any]) -> tuple[list[Any], list[Any], Any]:
    """The segments' constants, the stacked weights [L, ...] and their pullback to the
    parameters' leaves."""
    self.param_leaves = param_leaves
    env = self._run(self.flat[: self.start], self._start_env([*param_leaves, *first]), False)
    consts = [env[self.free0[j]] for j in self.consts]
    stacked = lambda p: [jnp.stack([p[i] for i in leaves]) for leaves in self.weight_leaves]
    xs, xs_back = jax.vjp(stacked, param_leaves)
    return consts, xs, xs_back

  def full(self, others: list[Any]) -> list[Any]:
    """The parameters' leaves with the stacked ones as (dead) zeros."""
    it = iter(others)
    return [
      jnp.zeros(x.shape, x.dtype) if s else next(it)
      for x, s in zip(self.param_leaves, self.is_stacked)
    ]

  def embed(self, others: list[Any], one: Any) -> list[Any]:
    """Segment 0's carries in, for microbatch `one`."""
    leaves = [*self.full(others), *jax.tree_util.tree_leaves(one)]
    env = self._run(self.flat[: self.start], self._start_env(leaves), True)
    return [
      jnp.asarray(v.val, v.aval.dtype) if isinstance(v, jax_core.Literal) else env[v]
      for v in (self.free0[j] for j in self.carries)
    ]

  def head(self, others: list[Any], one: Any, acts: list[Any]) -> Any:
    """The loss of microbatch `one` given the last segment's carries `acts`."""
    leaves = [*self.full(others), *jax.tree_util.tree_leaves(one)]
    env = self._run(self.flat[: self.start], self._start_env(leaves), True)
    env.update(zip(self.last_outs, acts))
    env = self._run(self.flat[self.end :], env, True)
    out = self.closed.jaxpr.outvars[0]
    out = self.alias.get(out, out)
    return out.val if isinstance(out, jax_core.Literal) else env[out]

  def chunk_fn(self) -> Callable[..., list[Any]]:
    """`chunk(consts, weights, carries, index)`: segment 0's equations over a chunk's
    stacked weights [n, ...], every layer pinned as layer 0."""
    segment = self._segment(0)

    def layer(c, carries, w):
      env = self._consts_env()
      reads = {}
      for slots, values in ((self.consts, c), (self.weights, w), (self.carries, carries)):
        reads.update((self.positions[j], x) for j, x in zip(slots, values))
      env = self._run(segment, env, True, reads)
      return [env[v] for v in self.carry_out0]

    def chunk(c: list[Any], w: list[Any], acts: list[Any], index: Any) -> list[Any]:
      step = lambda carries, x: (layer(c, carries, x), None)
      return jax.lax.scan(step, list(acts), list(w))[0]

    return chunk
