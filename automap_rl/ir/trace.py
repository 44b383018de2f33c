"""`trace(fn, *args) -> Program`: the partitioning IR from a jaxpr.

Call-like primitives (`jit`, `closed_call`, `checkpoint`/`remat2`, `custom_jvp_call`,
`custom_vjp_call`, `eval_jaxpr`) are inlined. Control flow is kept compact rather than unrolled:

* `scan`: the body is inlined once and its ops carry `repeat = length` and, like the ops
  of an inlined call, origins through the scan's equation (`automap_rl.xla.lower`
  constrains them inside the loop body). Each stacked input gets a `scan_slice` op (the
  stacked dim needs replication, the rest passes through), each stacked output a
  `scan_stack` op (whose origin is the scan's: the lowering constrains the stacked
  results and, inside the loop, each iteration's value as the op reads it), and each
  carry a `scan_carry` op in and out, with the carry's value in
  the body *tied* to its value out of the body, so the two share named dimensions. A
  48-layer `nn.scan` transformer therefore has the size of one layer, and the simulator
  multiplies the body's costs by the trip count: exactly what XLA's while loop does,
  where unrolling would not be.
* `while`: the same, with `repeat = 1` since the trip count is not static in general,
  and no origin (the lowering binds `while` whole).
* `cond`: every branch is inlined (costs are an upper bound) and a `cond_merge` op
  joins the branch results, passing every dim through.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jax_core

from automap_rl.ir import rules
from automap_rl.ir.flops import primitive_flops
from automap_rl.ir.kernels import kernel_of
from automap_rl.ir.program import Op, Program, Role, Rule, Value, itemsize_of
from automap_rl.ir.table_rows import keep_parameter_rows

# `eval_jaxpr` is jax 0.11's plain call, e.g. around the known half of a scan split by
# `checkpoint` (the forward scan and the residuals it hoists out of the loop).
CALL_PRIMITIVES = frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "checkpoint",
    "remat",
    "remat2",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
    "eval_jaxpr",
  }
)
# Primitives whose equal applications differ (fresh random bits): never one of another.
NOT_DEDUPLICATED = frozenset({"rng_bit_generator", "rng_uniform", "random_bits"})
_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def call_body(eqn) -> Any:
  """The jaxpr (open or closed) a call-like equation (`CALL_PRIMITIVES`) runs."""
  return next(eqn.params[k] for k in _CALL_JAXPR_PARAMS if k in eqn.params)


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
  """`(num_consts, num_carry)` of a `scan` equation, from its params.

  In every jax the scan's operands are its constants, then its initial carries, then its
  stacked inputs (the same for its body's invars), and its results the final carries, then
  the stacked outputs. jax up to 0.10 gives the two counts as the params `num_consts` and
  `num_carry`; jax 0.11 gives them as `ft_in`, a flat tree of the operands whose `unpack()`
  is the three groups (consts, carries, xs). Both are read here, so nothing else in the
  project depends on which one the installed jax writes.
  """
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carries, _ = params["ft_in"].unpack()
  return len(consts), len(carries)


def _path_string(path: Sequence[Any]) -> str:
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


class _Builder:
  """Accumulates values and ops while walking a jaxpr."""

  def __init__(self):
    self.values: list[Value] = []
    self.ops: list[Op] = []
    self.ties: list[tuple[int, int]] = []
    self.unknown: dict[str, None] = {}
    # Each equation's key for common subexpressions -> the first op with it (`same_as`).
    self.seen: dict[tuple, int] = {}
    # A value an op computes again -> the first op's (`same_as`).
    self.same_value: dict[int, int] = {}
    # The name stacks of the equations whose bodies are being inlined, outermost first:
    # an inner equation's name stack is relative to its caller's.
    self.name_stacks: list[str] = []

  def new_value(self, aval, role: Role = Role.INTERMEDIATE, path: str | None = None) -> int:
    dtype = str(aval.dtype)
    value = Value(
      len(self.values), tuple(int(d) for d in aval.shape), dtype, role, path, itemsize_of(dtype)
    )
    self.values.append(value)
    return value.id

  def add_op(
    self,
    primitive: str,
    operands,
    results,
    rule: Rule,
    repeat: int,
    scope: str,
    origin: tuple[int, ...] = (),
    flops: float = 0.0,
    kernel: str = "",
    same_as: int = -1,
  ) -> None:
    self.ops.append(
      Op(
        len(self.ops),
        primitive,
        tuple(operands),
        tuple(results),
        rule,
        repeat,
        scope,
        origin,
        float(flops),
        kernel,
        same_as,
      )
    )

  def kernel(self, eqn) -> str:
    """The fused kernel an equation belongs to, from its and its callers' name stacks."""
    return kernel_of("/".join([*self.name_stacks, str(eqn.source_info.name_stack)]))

  def read(self, env: dict, var) -> int | None:
    """The value id of a jaxpr atom; None for literals (scalars folded into the op)."""
    if isinstance(var, jax_core.Literal):
      return None
    return env[var]

  def outvar_id(self, env: dict, var) -> int:
    """The value id of a body output; a literal output becomes a constant value."""
    if isinstance(var, jax_core.Literal):
      return self.new_value(var.aval, Role.CONSTANT)
    return env[var]

  def bind_consts(self, closed, env: dict) -> None:
    for var in closed.jaxpr.constvars:
      env[var] = self.new_value(var.aval, Role.CONSTANT)

  def add_rule_op(
    self, primitive: str, operands, results, repeat: int, scope: str, origin: tuple[int, ...] = ()
  ) -> None:
    """Adds one of the IR's own ops (`scan_slice`, `scan_carry`, ...) with its registry rule."""
    rule, _ = rules.rule_for(
      primitive,
      [self.values[v].shape for v in operands],
      [self.values[v].shape for v in results],
      {},
    )
    self.add_op(primitive, operands, results, rule, repeat, scope, origin)

  def identity(self, primitive: str, source: int, aval, repeat: int, scope: str) -> int:
    """A pass-through copy of `source`, e.g. a loop carry entering or leaving a body."""
    result = self.new_value(aval)
    self.add_rule_op(primitive, [source], [result], repeat, scope)
    return result

  # -- the walk ---------------------------------------------------------------------------

  def walk(self, jaxpr, env: dict, repeat: int, scope: str, prefix: tuple[int, ...] = ()) -> None:
    """Adds the ops of `jaxpr`; `prefix` is its origin, None inside `while` and `cond` bodies."""
    for index, eqn in enumerate(jaxpr.eqns):
      name = eqn.primitive.name
      origin = None if prefix is None else (*prefix, index)
      if name not in CALL_PRIMITIVES and name not in ("scan", "while", "cond"):
        self.add_eqn(eqn, env, repeat, scope, origin)
        continue
      self.name_stacks.append(str(eqn.source_info.name_stack))
      if name in CALL_PRIMITIVES:
        self.inline_call(eqn, env, repeat, scope, origin)
      elif name == "scan":
        self.inline_scan(eqn, env, repeat, scope, origin)
      elif name == "while":
        self.inline_while(eqn, env, repeat, scope)
      else:
        self.inline_cond(eqn, env, repeat, scope)
      self.name_stacks.pop()

  def add_eqn(self, eqn, env: dict, repeat: int, scope: str, origin) -> None:
    name = eqn.primitive.name
    operand_shapes = [tuple(v.aval.shape) for v in eqn.invars]
    result_shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    rule, known = rules.rule_for(name, operand_shapes, result_shapes, eqn.params)
    if not known and name not in self.unknown:
      self.unknown[name] = None
      warnings.warn(
        f"automap_rl: no sharding rule for primitive {name!r}; using the conservative rule "
        "(every dimension replicated).",
        stacklevel=4,
      )
    operand_ids = [self.read(env, v) for v in eqn.invars]
    kept = [i for i, v in enumerate(operand_ids) if v is not None]
    rule = Rule(
      rule.factor_sizes,
      rule.factor_kinds,
      tuple(rule.operand_dims[i] for i in kept),
      rule.result_dims,
    )
    results = []
    for var in eqn.outvars:
      results.append(self.new_value(var.aval))
      if not isinstance(var, jax_core.DropVar):
        env[var] = results[-1]
    flops = primitive_flops(name, operand_shapes, result_shapes, eqn.params)
    self.add_op(
      name,
      [operand_ids[i] for i in kept],
      results,
      rule,
      repeat,
      scope,
      origin or (),
      flops,
      self.kernel(eqn),
      self.same_as(eqn, operand_ids, results, repeat, scope),
    )

  def same_as(
    self,
    eqn,
    operand_ids: Sequence[int | None],
    results: Sequence[int],
    repeat: int,
    scope: str,
  ) -> int:
    """The id of an earlier op this equation computes again (`Op.same_as`), -1 for none:
    one of the same primitive, operands (literals by value; a value an earlier op
    computed again counts as the first one's), parameters and results in the same loop
    body. The op being added is registered as the first of its kind."""
    if eqn.effects or eqn.primitive.name in NOT_DEDUPLICATED:
      return -1
    try:
      key = (
        eqn.primitive.name,
        tuple(
          ("literal", repr(v.val)) if i is None else self.same_value.get(i, i)
          for i, v in zip(operand_ids, eqn.invars)
        ),
        repr(sorted(eqn.params.items())),
        tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.outvars),
        repeat,
        scope,
      )
      first = self.seen.setdefault(key, len(self.ops))
    except TypeError:  # Unhashable parameters: nothing to compare with.
      return -1
    if first == len(self.ops):
      return -1
    for result, earlier in zip(results, self.ops[first].results):
      self.same_value[result] = earlier
    return first

  def inline(
    self, closed, operand_ids: Sequence[int], repeat: int, scope: str, prefix=None
  ) -> list[int]:
    """Walks a (closed) sub-jaxpr whose invars are `operand_ids`; returns its outputs."""
    jaxpr = getattr(closed, "jaxpr", closed)
    env: dict = {}
    if hasattr(closed, "consts"):
      self.bind_consts(closed, env)
    env.update(zip(jaxpr.invars, operand_ids))
    self.walk(jaxpr, env, repeat, scope, prefix)
    return [self.outvar_id(env, v) for v in jaxpr.outvars]

  def operands_as_values(self, eqn, env: dict) -> list[int]:
    """Operand ids, turning literals into constant values (bodies need a value per invar)."""
    return [
      self.new_value(v.aval, Role.CONSTANT) if isinstance(v, jax_core.Literal) else env[v]
      for v in eqn.invars
    ]

  def bind_results(self, eqn, env: dict, ids: Sequence[int]) -> None:
    for var, value_id in zip(eqn.outvars, ids):
      if not isinstance(var, jax_core.DropVar):
        env[var] = value_id

  def inline_call(self, eqn, env: dict, repeat: int, scope: str, origin) -> None:
    outs = self.inline(call_body(eqn), self.operands_as_values(eqn, env), repeat, scope, origin)
    self.bind_results(eqn, env, outs)

  def carry_in(self, init_ids: Sequence[int], body_invars, repeat: int, scope: str) -> list[int]:
    return [
      self.identity("scan_carry", v, var.aval, repeat, scope)
      for v, var in zip(init_ids, body_invars)
    ]

  def carry_out(
    self, body_in: Sequence[int], body_out: Sequence[int], outvars, repeat: int, scope: str
  ) -> list[int]:
    self.ties.extend(zip(body_in, body_out))
    return [
      self.identity("scan_carry", v, var.aval, repeat, scope) for v, var in zip(body_out, outvars)
    ]

  def inline_scan(self, eqn, env: dict, repeat: int, scope: str, origin) -> None:
    params = eqn.params
    body = params["jaxpr"]
    length, (num_consts, num_carry) = params["length"], scan_counts(params)
    operands = self.operands_as_values(eqn, env)
    consts, init, xs = (
      operands[:num_consts],
      operands[num_consts : num_consts + num_carry],
      operands[num_consts + num_carry :],
    )
    body_invars = body.jaxpr.invars
    inner_scope = f"{scope}/scan" if scope else "scan"
    inner_repeat = repeat * length
    carries = self.carry_in(init, body_invars[num_consts : num_consts + num_carry], repeat, scope)
    slices = []
    for x, var in zip(xs, body_invars[num_consts + num_carry :]):
      sliced = self.new_value(var.aval)
      self.add_rule_op("scan_slice", [x], [sliced], inner_repeat, inner_scope)
      slices.append(sliced)
    outs = self.inline(body, [*consts, *carries, *slices], inner_repeat, inner_scope, origin)
    finals = self.carry_out(carries, outs[:num_carry], eqn.outvars[:num_carry], repeat, scope)
    stacked = []
    for y, var in zip(outs[num_carry:], eqn.outvars[num_carry:]):
      result = self.new_value(var.aval)
      self.add_rule_op("scan_stack", [y], [result], inner_repeat, inner_scope, origin or ())
      stacked.append(result)
    self.bind_results(eqn, env, [*finals, *stacked])

  def inline_while(self, eqn, env: dict, repeat: int, scope: str) -> None:
    params = eqn.params
    cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
    operands = self.operands_as_values(eqn, env)
    cond_consts, body_consts, init = (
      operands[:cond_n],
      operands[cond_n : cond_n + body_n],
      operands[cond_n + body_n :],
    )
    inner_scope = f"{scope}/while" if scope else "while"
    carries = self.carry_in(init, params["body_jaxpr"].jaxpr.invars[body_n:], repeat, scope)
    self.inline(params["cond_jaxpr"], [*cond_consts, *carries], repeat, inner_scope)
    outs = self.inline(params["body_jaxpr"], [*body_consts, *carries], repeat, inner_scope)
    self.bind_results(eqn, env, self.carry_out(carries, outs, eqn.outvars, repeat, scope))

  def inline_cond(self, eqn, env: dict, repeat: int, scope: str) -> None:
    operands = self.operands_as_values(eqn, env)
    inner_scope = f"{scope}/cond" if scope else "cond"
    branch_outs = [
      self.inline(branch, operands[1:], repeat, inner_scope) for branch in eqn.params["branches"]
    ]
    merged = []
    for outs, var in zip(zip(*branch_outs), eqn.outvars):
      result = self.new_value(var.aval)
      self.add_rule_op("cond_merge", outs, [result], repeat, scope)
      merged.append(result)
    self.bind_results(eqn, env, merged)


def trace(
  fn: Callable[..., Any],
  *args: Any,
  arg_names: Sequence[str] | None = None,
  arg_roles: Sequence[str | Role] | None = None,
  donate_argnums: Sequence[int] = (),
) -> Program:
  """Traces `fn(*args)` into a `Program`.

  Args:
    fn: the function, typically a whole training step.
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`s), any pytrees.
    arg_names: a name per positional argument, the first element of every argument path
      (default `arg0`, `arg1`, ...).
    arg_roles: a role per positional argument (`parameter`, `optimizer_state`, `state` for
      non-trainable state such as batch-norm statistics, caches and step counters, `input`);
      default `input`.
    donate_argnums: positional arguments whose buffers the caller donates.

  Returns:
    The program; unknown primitives got the conservative rule, with one warning each; a
    lookup splits a table by rows only where they are a parameter's (`table_rows`).
  """
  names, roles = _names_and_roles(len(args), arg_names, arg_roles)
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  builder = _Builder()
  env: dict = {}
  inputs, donated = [], []
  leaves = [
    (i, path)
    for i, arg in enumerate(args)
    for path, _ in jax.tree_util.tree_flatten_with_path(arg)[0]
  ]
  if len(leaves) != len(closed.jaxpr.invars):
    raise ValueError(
      f"{len(leaves)} argument leaves but the jaxpr has {len(closed.jaxpr.invars)} inputs."
    )
  for (arg_index, path), var in zip(leaves, closed.jaxpr.invars):
    full_path = "/".join(filter(None, (names[arg_index], _path_string(path))))
    env[var] = builder.new_value(var.aval, roles[arg_index], full_path)
    inputs.append(env[var])
    donated.append(arg_index in donate_argnums)
  builder.bind_consts(closed, env)
  builder.walk(closed.jaxpr, env, repeat=1, scope="", prefix=())
  out_paths = [_path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
  outputs = [builder.outvar_id(env, v) for v in closed.jaxpr.outvars]
  values = builder.values
  input_set = set(inputs)
  for value_id, path in zip(outputs, out_paths):
    if value_id not in input_set:
      values[value_id] = Value(
        value_id,
        values[value_id].shape,
        values[value_id].dtype,
        Role.OUTPUT,
        f"out/{path}" if path else "out",
        values[value_id].itemsize,
      )
  program = Program(
    values=tuple(values),
    ops=tuple(builder.ops),
    inputs=tuple(inputs),
    outputs=tuple(outputs),
    donated=tuple(donated),
    ties=tuple(builder.ties),
    unknown_primitives=tuple(builder.unknown),
    jaxpr=closed,
    out_tree=jax.tree_util.tree_structure(out_shape),
    donate_argnums=tuple(sorted(set(donate_argnums))),
  )
  return keep_parameter_rows(program)


def _names_and_roles(
  count: int, arg_names: Sequence[str] | None, arg_roles: Sequence[str | Role] | None
) -> tuple[tuple[str, ...], tuple[Role, ...]]:
  """`trace`'s argument names and roles, defaults filled in (`arg0`, ... and `input`).

  Raises:
    ValueError: not one name and one role per argument, or a name given twice.
  """
  names = tuple(arg_names) if arg_names is not None else tuple(f"arg{i}" for i in range(count))
  roles = tuple(
    Role.parse(r) if isinstance(r, str) else r for r in (arg_roles or (Role.INPUT,) * count)
  )
  if len(names) != count or len(roles) != count:
    raise ValueError(f"trace got {count} arguments but {len(names)} names and {len(roles)} roles.")
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(
      f"arg_names repeat {repeated}: every argument needs its own name (its paths start with it)"
    )
  return names, roles
