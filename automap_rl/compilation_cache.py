"""JAX's persistent compilation cache: where compiled programs are kept between runs.

On by default, in `$XDG_CACHE_HOME/automap_rl/jax` (`~/.cache/automap_rl/jax` when
`XDG_CACHE_HOME` is unset). `AUTOMAP_RL_COMPILATION_CACHE` moves it (a directory) or turns
it off (`0`, `off`, `false`, `no`, or empty); JAX's own `JAX_COMPILATION_CACHE_DIR`, when
set and `AUTOMAP_RL_COMPILATION_CACHE` is not, is honoured the same way. `configure` writes
the choice into the environment, so that processes started later (isolated lowering,
validation workers) share the cache, and into JAX's config when JAX is already imported.
"""

from __future__ import annotations

import os
import sys

ENV = "AUTOMAP_RL_COMPILATION_CACHE"
JAX_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
OFF = ("", "0", "off", "false", "no")
# A compile this long or longer is kept: a cache hit costs about 0.05 s on a CPU (reading
# the file, loading the executable), so shorter compiles gain little from a hit.
MIN_COMPILE_TIME_SECS = 0.1


def default_directory() -> str:
  """The cache's directory when nothing else is set: `$XDG_CACHE_HOME/automap_rl/jax`."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "automap_rl", "jax")


def directory(setting: str | None = None) -> str | None:
  """The directory the cache uses, or None when it is off.

  Args:
    setting: a directory, or one of `OFF`; None reads `AUTOMAP_RL_COMPILATION_CACHE`, then
      `JAX_COMPILATION_CACHE_DIR`, then takes `default_directory()`.
  """
  if setting is None:
    setting = os.environ.get(ENV, os.environ.get(JAX_ENV))
  if setting is None:
    return default_directory()
  if setting.strip().lower() in OFF:
    return None
  return os.path.abspath(os.path.expanduser(setting))


def configure(
  setting: str | None = None, min_compile_time_secs: float = MIN_COMPILE_TIME_SECS
) -> str | None:
  """Turns the cache on in `directory(setting)`, creating the directory, or off; returns
  the directory (None: off).

  Args:
    setting: as for `directory`.
    min_compile_time_secs: compiles shorter than this are not written to the cache (a
      `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` in the environment wins).

  Raises:
    ValueError: the directory cannot be created or written.
  """
  path = directory(setting)
  if path is None:
    os.environ[ENV] = "0"
    os.environ.pop(JAX_ENV, None)
  else:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise ValueError(f"cannot create the compilation cache directory {path}: {e}") from None
    if not os.access(path, os.W_OK):
      raise ValueError(f"the compilation cache directory {path} is not writable")
    os.environ[ENV] = os.environ[JAX_ENV] = path
  os.environ.setdefault(MIN_COMPILE_TIME_ENV, str(min_compile_time_secs))
  if "jax" in sys.modules:
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update(
      "jax_persistent_cache_min_compile_time_secs", float(os.environ[MIN_COMPILE_TIME_ENV])
    )
  return path
