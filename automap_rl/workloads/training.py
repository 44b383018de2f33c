"""Shared train-step construction for the model zoo.

Every model module supplies a pure ``loss_fn(params, batch) -> scalar`` and
example arguments; :func:`build_workload` wraps it into an AdamW training step
and packages everything as a :class:`Workload`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax

from automap_rl import ir

LossFn = Callable[[Any, Any], jax.Array]
StepFn = Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4


@dataclasses.dataclass(frozen=True)
class Workload:
  """A training step together with example arguments.

  Attributes:
    name: canonical spec string, e.g. ``"gpt:layers=4,scan=true"``; just the
      model name when every config field has its default value.
    step: ``step(params, opt_state, batch) -> (new_params, new_opt_state,
      loss)``; pure and jittable.
    params: pytree of float32 parameters.
    opt_state: optax AdamW state for ``params``.
    batch: dict of input arrays (inputs, labels, ...).
    arg_names: top-level pytree path names of :attr:`args`.
    arg_roles: role of each element of :attr:`args`.
  """

  name: str
  step: StepFn
  params: Any
  opt_state: Any
  batch: Any
  arg_names: tuple[str, ...] = ("params", "opt_state", "batch")
  arg_roles: tuple[str, ...] = ("parameter", "optimizer_state", "input")

  @property
  def args(self) -> tuple[Any, Any, Any]:
    return (self.params, self.opt_state, self.batch)

  def trace(self) -> ir.Program:
    """The training step as a `Program`, with argument names and roles; parameters and
    optimizer state are donated (the step replaces them)."""
    return ir.trace(self.step, *self.args, arg_names=self.arg_names, arg_roles=self.arg_roles,
                    donate_argnums=(0, 1))


def make_train_step(
    loss_fn: LossFn, optimizer: optax.GradientTransformation
) -> StepFn:
  """Returns ``step(params, opt_state, batch) -> (params, opt_state, loss)``."""

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def build_workload(name: str, loss_fn: LossFn, params: Any,
                   batch: Any) -> Workload:
  """Packages ``loss_fn`` with an AdamW step and initial optimizer state."""
  optimizer = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
  return Workload(
      name=name,
      step=make_train_step(loss_fn, optimizer),
      params=params,
      opt_state=optimizer.init(params),
      batch=batch,
  )


def format_value(value: Any) -> str:
  """Formats a config value the way :func:`spec_string` writes it."""
  if isinstance(value, bool):
    return "true" if value else "false"
  return repr(value)


def spec_string(model: str, config: Any) -> str:
  """Canonical spec of ``config``: the model name plus non-default fields.

  Example: ``spec_string("gpt", GPTConfig(layers=4))`` is
  ``"gpt:layers=4"``; with all defaults it is just ``"gpt"``.
  """
  default = type(config)()
  changed = [
      f"{f.name}={format_value(getattr(config, f.name))}"
      for f in dataclasses.fields(config)
      if getattr(config, f.name) != getattr(default, f.name)
  ]
  return f"{model}:{','.join(changed)}" if changed else model


def split_seed(seed: int) -> tuple[jax.Array, jax.Array]:
  """Returns ``(params_key, data_key)`` derived from an integer seed."""
  params_key, data_key = jax.random.split(jax.random.PRNGKey(seed))
  return params_key, data_key
