"""XLA options: for programs compiled to be inspected or run once on small inputs, and for
the functions a search compiles for each problem it is given."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax

__all__ = ["SearchJit", "quick_compile_options", "search_compile_options"]

Calls = Literal["few", "many"]


def quick_compile_options(platform: str) -> dict[str, Any]:
  """`compiler_options` for a program compiled to inspect it or to run it once on small
  inputs (a plan's check, the reference runs of the numerics check, a workload's
  initialisation): on CPU, LLVM without its optimisations (a 2-layer GPT training step
  compiles in 1.4 s instead of 3-4.5 s and runs in 50 ms instead of 25 ms). XLA's HLO
  passes, and with them the collectives, flops and memory the checks read, are the same.
  XLA's fusion emitters stay on, as by default, whatever `XLA_FLAGS` says: they decide
  which fusions XLA:CPU forms, and so the kernels a check reads. None elsewhere."""
  if platform != "cpu":
    return {}
  return {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": True,
  }


def search_compile_options(platform: str, calls: Calls) -> dict[str, Any]:
  """`compiler_options` for a function a search compiles for each bucket of problems (an
  environment step, a Gumbel search, a network's head; `automap_rl.buckets`): a user's
  first call on a model of a new bucket waits for these compiles. On CPU, XLA's fusion
  emitters off (the environment's step compiles about a third faster and runs as fast: its
  fusions are small elementwise ones); for a function called `few` times per problem (an
  environment's reset), LLVM without its optimisations too (about half the compile again;
  the code runs 2-3x slower). `many` is for what searches call again and again, on every
  problem of the bucket: UCT's and random search's batched steps, the learned agent's
  greedy paths, encoder and searches (compiled once per bucket, and kept by the persistent
  cache, their optimised code pays: a compiled learned search runs 2.5-3x faster for about
  4 s more of compiling). None elsewhere."""
  if platform != "cpu":
    return {}
  options: dict[str, Any] = {"xla_cpu_use_fusion_emitters": False}
  if calls == "few":
    options |= {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
  return options


class SearchJit:
  """`jax.jit(fun, **jit_kwargs)` for a search, compiled with `search_compile_options(platform,
  calls)` (`calls`: `few` or `many`) for the default backend's platform, read at the first
  call (not at import, where it would start the backends before `jax.distributed` or the
  XLA flags are set)."""

  def __init__(self, fun: Callable, calls: Calls, **jit_kwargs: Any):
    functools.update_wrapper(self, fun)
    self._fun, self._calls, self._jit_kwargs = fun, calls, jit_kwargs
    self._by_platform: dict[str, Callable] = {}

  def jitted(self) -> Callable:
    """The `jax.jit` of the default backend's platform (its `lower`, its cache)."""
    platform = jax.default_backend()
    if platform not in self._by_platform:
      self._by_platform[platform] = jax.jit(
        self._fun,
        compiler_options=search_compile_options(platform, self._calls),
        **self._jit_kwargs,
      )
    return self._by_platform[platform]

  def __call__(self, *args, **kwargs):
    return self.jitted()(*args, **kwargs)
