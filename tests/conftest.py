"""Pytest setup, before JAX is imported: 8 virtual CPU devices, and the commands'
persistent compilation cache (tests that build the same functions for the same programs,
in either xdist worker, compile them once)."""

import os

from experiments.cli import compilation_cache

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
compilation_cache()


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: the same property on more models than `make test` has time for (`make test-all` runs them)")
