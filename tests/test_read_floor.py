"""The read-floor benchmark's stream-read kernels (benchmarks/read_floor.py), lowered for CUDA
on the CPU host: each shape reads a weight once, every load of a thread issued before the
first is used, and a carry of the wrong grid is refused."""

import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import read_floor
from jax_kimik3.config import KIMI_K3
from tests.lowering import CUSTOM_CALL, entries, kept_ptx, lower_for_cuda, spec

H = KIMI_K3.hidden_size


@pytest.mark.parametrize("shape", read_floor.SHAPES, ids=lambda s: f"{s.form}{s.per_thread}")
@pytest.mark.parametrize("k", [768, 12288])
def test_stream_read_lowers(shape, k):
    grid = shape.grid(H * k * 2)
    carry = spec(grid, dtype=jnp.uint32)
    f = lambda c, w: read_floor.stream_read(c, w, shape)  # noqa: E731
    assert lower_for_cuda(f, carry, spec(H, k)).count(CUSTOM_CALL) == 1
    assert jax.eval_shape(f, carry, spec(H, k)) == carry


def test_a_shape_that_does_not_divide_the_bytes_is_refused():
    with pytest.raises(ValueError, match="nbytes=1000"):
        read_floor.SHAPES[0].grid(1000)
    with pytest.raises(ValueError, match=r"carry.shape=\(3,\)"):
        lower_for_cuda(lambda c, w: read_floor.stream_read(c, w, read_floor.SHAPES[0]),
                       spec(3, dtype=jnp.uint32), spec(H, 768))


@pytest.mark.parametrize("shape", read_floor.SHAPES, ids=lambda s: f"{s.form}{s.per_thread}")
def test_each_shape_requests_its_bytes_at_once(tmp_path, shape):
    """The loads form issues a thread's per_thread 16-byte loads, the bulk form one copy per
    chunk counted on one mbarrier, each before any wait."""
    ptx = kept_ptx(f"""
        import jax, jax.numpy as jnp
        from benchmarks import read_floor
        shape = read_floor.{shape!r}
        c = jax.ShapeDtypeStruct((shape.grid(7168 * 768 * 2),), jnp.uint32)
        w = jax.ShapeDtypeStruct((7168, 768), jnp.bfloat16)
        jax.jit(lambda c, w: read_floor.stream_read(c, w, shape)).trace(c, w).lower(
            lowering_platforms=("cuda",))
    """, tmp_path)
    (body,) = [body for name, body in entries(ptx) if "StreamRead" in name]
    if shape.form == "loads":
        lines = body.splitlines()
        loads = [i for i, line in enumerate(lines) if re.search(r"ld\.global\.v4", line)]
        assert len(loads) == shape.per_thread
        loaded = {r for i in loads for r in re.findall(r"%\w+", lines[i].split("[")[0])}
        uses = [i for i, line in enumerate(lines)
                if i not in loads and loaded & set(re.findall(r"%\w+", line))]
        assert uses and max(loads) < min(uses)  # every load in flight before the first use
        assert ".minnctapersm" in ptx
    else:
        copy = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
        assert body.count(copy) == 1 and body.count("mbarrier.init") == 1  # in a loop over chunks
        assert body.index(copy) < body.index("mbarrier.try_wait")
