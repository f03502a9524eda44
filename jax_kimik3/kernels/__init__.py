"""CuTe DSL kernels for Hopper (sm_90a), launched inside jax.jit through cutlass_call."""
