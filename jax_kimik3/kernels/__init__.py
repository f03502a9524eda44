"""CuTe DSL kernels for Hopper (sm_90a), launched inside jax.jit through `launch.py`: compiled
by `cutlass_call` (JIT) or taken from the prebuilt library (AOT); the `*_ops.py` modules, the
tail (`oproj.py`) and the catalog import no part of the DSL."""
