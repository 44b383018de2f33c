"""Pytest setup, before JAX is imported.

- 8 virtual CPU devices.
- CPU code generated without LLVM's expensive optimisations: the tests' programs are
  small, so compiling them costs more than running them; the HLO, its collectives, flops
  and memory are the same.
- XLA:CPU's fusion emitters off: a training iteration compiles in two thirds of the time.
  The plans' checks keep them on (`quick_compile_options`), as the kernels they read
  depend on them.
- JAX's persistent compilation cache (`automap_rl.compilation_cache`) in the repository's
  `.cache/jax` (gitignored), never the user's home: tests that build the same functions
  for the same programs, in either xdist worker or a later run, compile them once. Every
  compile is kept, however short: the tests compile many small programs more than once,
  in both workers and after releasing their caches.
"""

import os

from automap_rl import compilation_cache

os.environ.setdefault(
  "XLA_FLAGS",
  "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
  "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false",
)
compilation_cache.configure(
  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax"),
  min_compile_time_secs=0,
)


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "slow: the same property on more models than `make test` has time for (`make test-all` runs "
    "them)",
  )
