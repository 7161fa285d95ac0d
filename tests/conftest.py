"""Test-wide settings that must precede any JAX import: a CPU backend with 8 devices,
so that tier-(b) tests can shard over a real (single-process) mesh."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
