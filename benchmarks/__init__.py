"""Benchmarks of jax_kimik3 on GPUs: `python -m benchmarks.bench_<family>` (RESULTS.md keeps
the record)."""
