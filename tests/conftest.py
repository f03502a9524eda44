"""Test setup: eight host devices for shard_map (set before jax is imported) and fixtures."""

import os
import zlib

# Kernels compile for Hopper also where no GPU is attached (read when cutlass is imported).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# The lowering tests check the DSL's JIT path; tests/test_native.py sets the AOT one.
os.environ.setdefault("JAX_KIMIK3_KERNELS", "jit")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SEED = int(os.environ.get("K3_TEST_SEED", "0"))  # change it for another draw of every case


@pytest.fixture
def rng(request):
    """Fresh data per case (seeded from the test's id), the same on every run."""
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


def pytest_runtest_setup(item):
    """Tests marked `gpu` skip where JAX has no GPU, before any of their fixtures runs (CI
    deselects them; this covers `-m gpu` on such a host)."""
    if item.get_closest_marker("gpu") is not None:
        import jax

        if jax.default_backend() != "gpu":
            pytest.skip("needs a GPU")
