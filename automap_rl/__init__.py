"""automap_rl: find sharding plans for JAX programs by search over a partitioning IR.

`automap_rl.partition(fn, *args, mesh=..., agent=...)` returns a `Plan` (see
`automap_rl.api`). Both are imported lazily, so `import automap_rl.mesh` stays light.
"""

from __future__ import annotations

__all__ = ["Plan", "partition"]


def __getattr__(name: str):
  if name in __all__:
    from automap_rl import api

    return getattr(api, name)
  raise AttributeError(f"module 'automap_rl' has no attribute {name!r}")
