"""How many clusters of a launch are resident at once on the device: the fused tail's persistent
grid (kernels/fused.py), whose consumers wait for its producers inside one launch, so every CTA
of its grid must run at the same time. Imports no part of the CuTe DSL.

On a GPU the driver answers (cuOccupancyMaxActiveClusters) for a stand-in kernel of the fused
kernel's geometry: the same threads per CTA and cluster size, and enough dynamic shared memory
that no more than `ctas_per_sm` CTAs share an SM (the fused kernel's register cap guarantees it
that many). The answer counts the GPCs' shapes, which the SM count alone does not tell (an
H200's 132 SMs hold 15 clusters of 7 one-CTA-per-SM, not 18). Where no GPU is attached
(lowering for CUDA, building the kernel library), FALLBACK_CLUSTERS, measured on an H200.
"""

from __future__ import annotations

import functools

# Clusters of 7 CTAs of 256 threads, 4 per SM, resident at once on an H200: this module's
# query there (benchmarks/RESULTS.md, 2026-12-01; 15 at one CTA per SM).
FALLBACK_CLUSTERS = 69
_PROBE_PTX = (b".version 8.0\n.target sm_90a\n.address_size 64\n"
              b".visible .entry k3_residency_probe()\n{\n\tret;\n}\n\0")
_RESERVED_SMEM = 1024  # per CTA, taken by the system on sm_90


def _check(result, call):
    error, *values = result
    if int(error) != 0:
        raise RuntimeError(f"CUDA driver call {call} failed: {error!r}")
    return values[0] if len(values) == 1 else values


@functools.cache
def co_resident_clusters(ordinal: int, cluster: int, threads: int, smem_bytes: int,
                         ctas_per_sm: int) -> int:
    """Clusters of `cluster` CTAs of `threads` threads and `smem_bytes` of shared memory, at
    most `ctas_per_sm` per SM, resident at once on CUDA device `ordinal`."""
    from cuda.bindings import driver as cu

    _check(cu.cuInit(0), "cuInit")
    device = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    context = _check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    try:
        _check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        per_sm = _check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            device), "cuDeviceGetAttribute")
        smem = max(smem_bytes, per_sm // ctas_per_sm - _RESERVED_SMEM)
        module = _check(cu.cuModuleLoadData(_PROBE_PTX), "cuModuleLoadData")
        try:
            kernel = _check(cu.cuModuleGetFunction(module, b"k3_residency_probe"),
                            "cuModuleGetFunction")
            _check(cu.cuFuncSetAttribute(
                kernel, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem), "cuFuncSetAttribute")
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = smem
            attribute = cu.CUlaunchAttribute()
            attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attribute.value.clusterDim.x = cluster
            attribute.value.clusterDim.y = 1
            attribute.value.clusterDim.z = 1
            config.attrs = [attribute]
            config.numAttrs = 1
            return int(_check(cu.cuOccupancyMaxActiveClusters(kernel, config),
                              "cuOccupancyMaxActiveClusters"))
        finally:
            cu.cuModuleUnload(module)
    finally:
        cu.cuDevicePrimaryCtxRelease(device)


def clusters_here(cluster: int, threads: int, smem_bytes: int, ctas_per_sm: int) -> int:
    """`co_resident_clusters` on this process's first CUDA device, or FALLBACK_CLUSTERS where
    JAX has none (the kernels then compile for an H200)."""
    import jax

    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        return FALLBACK_CLUSTERS
    return co_resident_clusters(gpus[0].local_hardware_id, cluster, threads, smem_bytes,
                                ctas_per_sm)
