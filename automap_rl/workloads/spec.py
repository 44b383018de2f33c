"""Model spec strings: ``"name"``, ``"name:key=value,key=value"`` or with a
preset, ``"name:size=label,key=value"``.

``size=label`` selects a published shape of the family (the module's
``PRESETS``: e.g. ``gpt:size=1.3b``, ``llama:size=8b``, ``moe:size=10b``,
``t5:size=xl``, ``vit:size=h14``, ``wresnet:size=2b``,
``unet:size=sd-1.5``, ``gnn:size=graphcast``, ``ssm:size=2.8b``,
``lstm:size=8192-1024``, ``dit:size=xl-2``); the other
items override its fields (``gpt:size=1.3b,batch=32``), whatever their order.

The zoo's families (:data:`FAMILIES`) are written here; the external ones
(:data:`EXTERNAL_FAMILIES`, e.g. ``hf-gpt2:size=medium``) wrap models that ship
inside other packages (:mod:`automap_rl.workloads.external`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import jax

from automap_rl.compile_options import quick_compile_options
from automap_rl.workloads import (
  dit,
  external,
  gnn,
  gpt,
  llama,
  lstm,
  mlp,
  moe,
  resnet,
  ssm,
  t5,
  training,
  unet,
  vit,
  wide_resnet,
)

# Zoo model name -> (module with ``make(config, seed)`` and ``PRESETS``, config
# class).
_ZOO: dict[str, tuple[ModuleType, type]] = {
  "mlp": (mlp, mlp.MLPConfig),
  "gpt": (gpt, gpt.GPTConfig),
  "moe": (moe, moe.MoEConfig),
  "gnn": (gnn, gnn.GNNConfig),
  "resnet": (resnet, resnet.ResNetConfig),
  "unet": (unet, unet.UNetConfig),
  "llama": (llama, llama.LlamaConfig),
  "t5": (t5, t5.T5Config),
  "vit": (vit, vit.ViTConfig),
  "wresnet": (wide_resnet, wide_resnet.WideResNetConfig),
  "ssm": (ssm, ssm.SSMConfig),
  "lstm": (lstm, lstm.LSTMConfig),
  "dit": (dit, dit.DiTConfig),
}
# Every model name, the zoo's and the external ones -> (``make(config, seed)``,
# config class, size label -> config fields).
_MODELS: dict[
  str, tuple[Callable[[Any, int], training.Workload], type, Mapping[str, Mapping[str, Any]]]
] = {
  **{
    name: (module.make, config, getattr(module, "PRESETS", {}))
    for name, (module, config) in _ZOO.items()
  },
  **{
    name: (family.make, family.config, family.presets) for name, family in external.FAMILIES.items()
  },
}
FAMILIES: tuple[str, ...] = tuple(_ZOO)
EXTERNAL_FAMILIES: tuple[str, ...] = tuple(external.FAMILIES)
# Family -> its framework style.
STYLES: dict[str, str] = {
  "mlp": "haiku",
  "gpt": "flax.linen",
  "moe": "flax.linen",
  "gnn": "haiku",
  "resnet": "haiku",
  "unet": "flax.linen",
  "llama": "flax.nnx",
  "t5": "haiku",
  "vit": "equinox",
  "wresnet": "flax.linen",
  "ssm": "equinox",
  "lstm": "flax.linen",
  "dit": "flax.nnx",
}

# A tiny spec per family, for numerics (`automap-rl validate --random`) and concrete tests:
# seconds to build, trace and compile on CPU, every dim still divisible by 8.
SMALL: dict[str, str] = {
  "mlp": "mlp:width=32,batch=8",
  "gpt": "gpt:layers=1,d_model=32,heads=2,seq=16,vocab=64,batch=4",
  "moe": "moe:layers=1,d_model=32,seq=16,vocab=64,batch=8,experts=4",
  "gnn": "gnn",
  "resnet": "resnet:stages=2,width=8,groups=4,image_size=8,batch=8",
  "unet": "unet:levels=1,base_channels=8,groups=4,image_size=8,batch=4",
  "llama": "llama",
  "t5": "t5:layers=1",
  "vit": "vit:layers=1",
  "wresnet": "wresnet:width=4,image_size=16",
  "ssm": "ssm:layers=1",
  "lstm": "lstm:layers=1",
  "dit": "dit:layers=1,image_size=16",
}


def presets(name: str) -> Mapping[str, Mapping[str, Any]]:
  """Size label -> config fields of family ``name``."""
  return _MODELS[name][2]


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
    + (" ('true' or 'false')" if kind is bool else "")
  )


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
  """Splits a spec into the model name and typed config overrides.

  Example: ``"gpt:layers=12,d_model=768,scan=true"`` ->
  ``("gpt", {"layers": 12, "d_model": 768, "scan": True})``; a ``size``
  item expands to its preset's fields, which the other items override.

  Raises:
    ValueError: unknown model name, key or size, malformed or repeated item,
      or a value that does not convert to the field's type.
  """
  name, _, overrides = spec.partition(":")
  name = name.strip()
  if name not in _MODELS:
    raise ValueError(
      f"unknown model {name!r}; valid models: {', '.join(FAMILIES + EXTERNAL_FAMILIES)}"
    )
  config_cls = _MODELS[name][1]
  types = typing.get_type_hints(config_cls)
  kwargs, size = {}, {}
  for item in filter(None, (i.strip() for i in overrides.split(","))):
    key, sep, value = (s.strip() for s in item.partition("="))
    if not sep:
      raise ValueError(f"bad item {item!r} in spec {spec!r}: expected key=value")
    if key in kwargs or (key == "size" and size):
      raise ValueError(f"key {key!r} given twice in spec {spec!r}")
    if key == "size":
      sizes = presets(name)
      if value not in sizes:
        raise ValueError(
          f"unknown size {value!r} for model {name!r}; valid sizes: {', '.join(sizes) or 'none'}"
        )
      size = sizes[value]
    elif key not in types:
      keys = [f.name for f in dataclasses.fields(config_cls)]
      raise ValueError(
        f"unknown key {key!r} for model {name!r}; valid keys: "
        f"{', '.join(keys + ['size'] * bool(presets(name)))}"
      )
    else:
      kwargs[key] = _convert(key, value, types[key])
  return name, {**size, **kwargs}


def make_config(spec: str) -> tuple[str, Any]:
  """The family name and its config dataclass described by ``spec``.

  Raises:
    ValueError: as :func:`parse_model_spec`, or a config the family rejects.
  """
  name, kwargs = parse_model_spec(spec)
  config_cls = _MODELS[name][1]
  _check_sizes(name, config_cls, kwargs)
  return name, config_cls(**kwargs)


def _check_sizes(name: str, config_cls: type, kwargs: dict[str, Any]) -> None:
  """Sizes are positive: an int field must be at least 1, or at least 0 where its
  default is 0 or None (0 then means off or derived, like ``d_ff=0``); a float field
  must be finite and positive where its default is."""
  defaults = config_cls()
  for key, value in kwargs.items():
    default = getattr(defaults, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      continue
    least = 0 if default in (0, None) else 1
    if isinstance(value, int) and value < least:
      raise ValueError(
        f"{name}: {key}={value} must be {'>= 0' if least == 0 else 'a positive integer'}"
      )
    if isinstance(value, float) and (
      not math.isfinite(value) or (isinstance(default, float) and default > 0 >= value)
    ):
      raise ValueError(f"{name}: {key}={value} must be a finite positive number")


def canonical_spec(spec: str) -> str:
  """The name :func:`make_workload` gives ``spec``'s workload, e.g.
  ``"gpt:batch=8,size=1.3b"`` -> ``"gpt:size=1.3b,batch=8"``."""
  name, config = make_config(spec)
  return training.spec_string(name, config, presets(name))


def make_workload(spec: str, seed: int = 0, abstract: bool = False) -> training.Workload:
  """Builds the workload described by ``spec`` with parameters from ``seed``.

  With ``abstract=True`` the arguments are ``jax.ShapeDtypeStruct``s and nothing is
  allocated: enough to trace, analyse and simulate models of any size. Either
  way ``module.make`` runs once, under ``jax.eval_shape`` or ``jax.jit``.
  """
  name, config = make_config(spec)
  make = _MODELS[name][0]
  built = []

  def build():
    built.append(make(config, seed))
    return built[0].args

  # One compile for the whole build (initializers, data, optimizer state)
  # instead of one per eager op; it runs once.
  quick = quick_compile_options(jax.devices()[0].platform)
  args = jax.eval_shape(build) if abstract else jax.jit(build, compiler_options=quick)()
  fields = (
    ("params", "opt_state", "batch")
    if len(args) == 3
    else ("params", "opt_state", "model_state", "batch")
  )
  return dataclasses.replace(built[0], **dict(zip(fields, args)))
