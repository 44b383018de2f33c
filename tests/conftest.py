"""Pytest setup, before JAX is imported.

- 8 virtual CPU devices.
- CPU code generated without LLVM's expensive optimisations: the tests' programs are
  small, so compiling them costs more than running them; the HLO, its collectives, flops
  and memory are the same.
- XLA:CPU's fusion emitters off: a training iteration compiles in two thirds of the time.
  The plans' checks keep them on (`quick_compile_options`), as the kernels they read
  depend on them.
- A persistent compilation cache in the repository's `.cache/xla` (gitignored), never
  the user's home: tests that build the same functions for the same programs, in either
  xdist worker or a later run, compile them once. Every compile is kept, however short (a
  user's commands keep those over half a second): the tests compile many small programs
  more than once, in both workers and after releasing their caches.
"""

import os

from experiments.cli import compilation_cache

os.environ.setdefault(
  "XLA_FLAGS",
  "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
  "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false",
)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "xla"
)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
compilation_cache()


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "slow: the same property on more models than `make test` has time for (`make test-all` runs "
    "them)",
  )
