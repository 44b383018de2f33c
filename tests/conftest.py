"""Pytest setup: expose 8 virtual CPU devices before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: the same property on more models than `make test` has time for (`make test-all` runs them)")
