"""Pytest setup: expose 8 virtual CPU devices before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
