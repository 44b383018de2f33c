"""Shared train-step construction for the model zoo.

Every model module supplies a pure loss function and example arguments;
:func:`build_workload` wraps it into an AdamW training step and packages
everything as a :class:`Workload`.

Most families are stateless: ``loss_fn(params, batch) -> loss []`` and
``step(params, opt_state, batch)``. Families with non-trainable state that the
step updates (batch-norm statistics) supply
``loss_fn(params, model_state, batch) -> (loss [], new_model_state)`` and get
``step(params, opt_state, model_state, batch)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from automap_rl import ir

LossFn = Callable[..., Any]
StepFn = Callable[..., tuple[Any, ...]]

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4
# Compute dtypes a config's ``dtype`` field may name; parameters stay float32.
DTYPES = ("float32", "bfloat16")
# The name a mixture of experts gives its experts' activations (the tokens dispatched to
# them and the outputs of their matmuls, batched over experts) for the "dots" policy.
EXPERT_ACTIVATION = "expert_activation"
# What a rematerialized block keeps for its backward pass (a config's ``remat_policy``):
# "full" keeps only the block's input and recomputes everything else; "dots" keeps the
# outputs of its projections (the matmuls without batch dims, and the experts' matmuls,
# batched over experts, with the tokens dispatched to them: `EXPERT_ACTIVATION`) and
# recomputes the elementwise ops, attention's batched matmuls and normalizations between
# them: MaxText's 'minimal' policy, and the activations of a framework whose elementwise
# kernels are fused and recompute their cheap intermediates (Megatron-LM with no
# recomputation).
REMAT_POLICIES: Mapping[str, Callable[..., bool] | None] = {
  "full": None,
  "dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(EXPERT_ACTIVATION),
  ),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """A training step together with example arguments.

  Attributes:
    name: canonical spec string, e.g. ``"gpt:layers=4,scan=true"`` or
      ``"gpt:size=1.3b,batch=8"``; just the model name when every config
      field has its default value.
    step: ``step(*args) -> (new_params, new_opt_state, [new_model_state,]
      loss)``; pure and jittable.
    params: pytree of float32 parameters, in the style of the family's
      framework (a Flax ``params`` dict, an nnx ``State``, a Haiku params
      dict, an Equinox module).
    opt_state: optax AdamW state for ``params``.
    batch: dict of input arrays (inputs, labels, ...).
    model_state: non-trainable state the step updates (Flax ``batch_stats``),
      or None for stateless families.
    loss_fn: the loss ``step`` differentiates (module docstring), or None for
      a step given whole: what a pipelined plan needs to lower (it pipelines
      the forward, then differentiates it).
    optimizer: the optax transformation ``step`` applies to the gradients,
      or None.
  """

  name: str
  step: StepFn
  params: Any
  opt_state: Any
  batch: Any
  model_state: Any = None
  loss_fn: LossFn | None = None
  optimizer: optax.GradientTransformation | None = None

  @property
  def args(self) -> tuple[Any, ...]:
    """``(params, opt_state, [model_state,] batch)``."""
    if self.model_state is None:
      return (self.params, self.opt_state, self.batch)
    return (self.params, self.opt_state, self.model_state, self.batch)

  @property
  def arg_names(self) -> tuple[str, ...]:
    """Top-level pytree path names of :attr:`args`."""
    if self.model_state is None:
      return ("params", "opt_state", "batch")
    return ("params", "opt_state", "model_state", "batch")

  @property
  def arg_roles(self) -> tuple[str, ...]:
    """Role of each element of :attr:`args`; model state (batch-norm
    statistics) is non-trainable ``state``."""
    if self.model_state is None:
      return ("parameter", "optimizer_state", "input")
    return ("parameter", "optimizer_state", "state", "input")

  def trace(self) -> ir.Program:
    """The training step as a `Program`, with argument names and roles; every
    argument but the batch is donated (the step replaces it)."""
    return ir.trace(
      self.step,
      *self.args,
      arg_names=self.arg_names,
      arg_roles=self.arg_roles,
      donate_argnums=ir.donated_argnums(self.arg_roles),
    )


def make_train_step(
  loss_fn: LossFn, optimizer: optax.GradientTransformation, stateful: bool = False
) -> StepFn:
  """Returns ``step(params, opt_state, batch) -> (params, opt_state, loss)``,
  or with ``stateful`` ``step(params, opt_state, model_state, batch) ->
  (params, opt_state, model_state, loss)``."""

  def update(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return *update(params, opt_state, grads), loss

  def stateful_step(params, opt_state, model_state, batch):
    (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, model_state, batch
    )
    return *update(params, opt_state, grads), model_state, loss

  return stateful_step if stateful else step


def build_workload(
  name: str, loss_fn: LossFn, params: Any, batch: Any, model_state: Any = None
) -> Workload:
  """Packages ``loss_fn`` with an AdamW step and initial optimizer state.

  With ``model_state`` the loss has the stateful signature (module docstring).
  """
  optimizer = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
  return Workload(
    name=name,
    step=make_train_step(loss_fn, optimizer, stateful=model_state is not None),
    params=params,
    opt_state=optimizer.init(params),
    batch=batch,
    model_state=model_state,
    loss_fn=loss_fn,
    optimizer=optimizer,
  )


def check_dtype(dtype: str) -> None:
  """Raises ValueError unless ``dtype`` is one of :data:`DTYPES`."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")


def check_remat(remat: bool, remat_policy: str) -> None:
  """Raises ValueError unless ``remat_policy`` is one of :data:`REMAT_POLICIES`, and
  names a policy other than "full" only with ``remat``."""
  if remat_policy not in REMAT_POLICIES:
    raise ValueError(f"remat_policy={remat_policy!r} is not one of {', '.join(REMAT_POLICIES)}")
  if remat_policy != "full" and not remat:
    raise ValueError(f"remat_policy={remat_policy!r} needs remat=true")


def cast_floating(tree: Any, dtype: str) -> Any:
  """Casts the floating-point leaves of ``tree`` to the compute ``dtype``.

  Mixed precision as jmp's ``cast_to_compute`` does it: float32 master
  parameters, a compute copy in ``dtype`` made inside the step. ``"float32"``
  means full precision: leaves keep their dtype, so the float64 reference of
  the numerics check stays float64.
  """
  if dtype == "float32":
    return tree

  def cast(leaf):
    return leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

  return jax.tree_util.tree_map(cast, tree)


def widen(x: jax.Array) -> jax.Array:
  """``x`` in at least float32 (softmax, losses and scans of low-precision
  compute); float64 stays float64, so the numerics reference is not narrowed."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def format_value(value: Any) -> str:
  """Formats a config value the way :func:`spec_string` writes it."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, str):
    return value
  return repr(value)


def spec_string(
  model: str, config: Any, presets: Mapping[str, Mapping[str, Any]] | None = None
) -> str:
  """Canonical spec of ``config``: the model name plus non-default fields.

  Example: ``spec_string("gpt", GPTConfig(layers=4))`` is
  ``"gpt:layers=4"``; with all defaults it is just ``"gpt"``. When a preset
  of ``presets`` explains more fields than the defaults do, the spec names it
  (``size=...``) and lists the fields that differ from it.
  """
  default = type(config)()

  def changed(base) -> list[str]:
    return [
      f"{f.name}={format_value(getattr(config, f.name))}"
      for f in dataclasses.fields(config)
      if getattr(config, f.name) != getattr(base, f.name)
    ]

  best = changed(default)
  for size, fields in (presets or {}).items():
    candidate = [f"size={size}", *changed(dataclasses.replace(default, **fields))]
    if len(candidate) < len(best):
      best = candidate
  return f"{model}:{','.join(best)}" if best else model


def split_seed(seed: int) -> tuple[jax.Array, jax.Array]:
  """Returns typed ``(params_key, data_key)`` derived from an integer seed.

  The keys use the ``rbg`` generator: XLA compiles its RngBitGenerator far
  faster than threefry's unrolled hash (an initializer of many parameters
  compiles about 10x faster on CPU).
  """
  params_key, data_key = jax.random.split(jax.random.key(seed, impl="rbg"))
  return params_key, data_key
