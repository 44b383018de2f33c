"""Model spec strings: ``"name"`` or ``"name:key=value,key=value"``."""

from __future__ import annotations

import dataclasses
import typing
from types import ModuleType
from typing import Any

import jax

from automap_rl.workloads import gnn, gpt, mlp, moe, resnet, training, unet

# Model name -> (module with ``make(config, seed)``, config class).
_MODELS: dict[str, tuple[ModuleType, type]] = {
    "mlp": (mlp, mlp.MLPConfig),
    "gpt": (gpt, gpt.GPTConfig),
    "moe": (moe, moe.MoEConfig),
    "gnn": (gnn, gnn.GNNConfig),
    "resnet": (resnet, resnet.ResNetConfig),
    "unet": (unet, unet.UNetConfig),
}
FAMILIES: tuple[str, ...] = tuple(_MODELS)


def _convert(key: str, value: str, kind: type) -> Any:
  """Converts the string ``value`` of config field ``key`` to ``kind``."""
  if kind is bool:
    if value.lower() in ("true", "false"):
      return value.lower() == "true"
  else:
    try:
      return kind(value)
    except ValueError:
      pass
  raise ValueError(
      f"bad value {value!r} for key {key!r}: expected {kind.__name__}"
      + (" ('true' or 'false')" if kind is bool else ""))


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
  """Splits a spec into the model name and typed config overrides.

  Example: ``"gpt:layers=12,d_model=768,scan=true"`` ->
  ``("gpt", {"layers": 12, "d_model": 768, "scan": True})``.

  Raises:
    ValueError: unknown model name or key, malformed item, or a value that
      does not convert to the field's type.
  """
  name, _, overrides = spec.partition(":")
  name = name.strip()
  if name not in _MODELS:
    raise ValueError(
        f"unknown model {name!r}; valid models: {', '.join(FAMILIES)}")
  config_cls = _MODELS[name][1]
  types = typing.get_type_hints(config_cls)
  kwargs = {}
  for item in filter(None, (i.strip() for i in overrides.split(","))):
    key, sep, value = (s.strip() for s in item.partition("="))
    if not sep:
      raise ValueError(
          f"bad item {item!r} in spec {spec!r}: expected key=value")
    if key not in types:
      raise ValueError(
          f"unknown key {key!r} for model {name!r}; valid keys: "
          f"{', '.join(f.name for f in dataclasses.fields(config_cls))}")
    kwargs[key] = _convert(key, value, types[key])
  return name, kwargs


def make_workload(spec: str, seed: int = 0, abstract: bool = False) -> training.Workload:
  """Builds the workload described by ``spec`` with parameters from ``seed``.

  With ``abstract=True`` the arguments are ``jax.ShapeDtypeStruct``s and nothing is
  allocated: enough to trace, analyse and simulate models of any size.
  """
  name, kwargs = parse_model_spec(spec)
  module, config_cls = _MODELS[name]
  config = config_cls(**kwargs)
  if not abstract:
    return module.make(config, seed)
  built = []

  def build():
    built.append(module.make(config, seed))
    return built[0].args

  params, opt_state, batch = jax.eval_shape(build)
  return dataclasses.replace(built[0], params=params, opt_state=opt_state, batch=batch)
