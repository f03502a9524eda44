"""The benchmarks' stand-ins for what runs before rank 0's tail (benchmarks/ghost_peers.py),
lowered for CUDA on the CPU host: the ghost peers' deliveries with x's copy, and x's copy
alone (before XLA's per-rank work); and every kernel they compile is one the benchmark
leaves out of the times it reports."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import ghost_peers
from jax_kimik3.config import KIMI_K3
from jax_kimik3.layout import MailboxLayout, MailboxSpec
from tests.lowering import CUSTOM_CALL, entries, kept_ptx, lower_for_cuda, spec

H = KIMI_K3.hidden_size


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("tp, b", [(2, 1), (8, 8), (8, 64)])
def test_deliveries_lower(tp, b, two_shot):
    k = KIMI_K3.o_proj_in_features // tp

    def f(rows, gather, table, x, after):
        return ghost_peers.deliver(rows, gather, table, x, after,
                                   spec=MailboxSpec(MailboxLayout(tp)), two_shot=two_shot)

    args = (spec(tp - 1, b, H), spec(b, H), spec(tp + 1, 2, dtype=jnp.uint32), spec(1, b, k),
            spec(b, H))
    assert lower_for_cuda(f, *args).count(CUSTOM_CALL) == 1
    assert jax.eval_shape(f, *args) == spec(1, b, k)


def test_ready_lowers():
    assert lower_for_cuda(ghost_peers.ready, spec(8, 1536), spec(8, H)).count(CUSTOM_CALL) == 1
    assert jax.eval_shape(ghost_peers.ready, spec(8, 1536), spec(8, H)) == spec(8, 1536)


def test_the_benchmark_recognises_every_stand_in(tmp_path):
    ptx = kept_ptx("""
        import jax.numpy as jnp
        from benchmarks import ghost_peers
        from jax_kimik3.layout import MailboxLayout, MailboxSpec
        from tests.lowering import lower_for_cuda, spec
        lower_for_cuda(ghost_peers.ready, spec(8, 1536), spec(8, 7168))
        lower_for_cuda(lambda r, g, t, x, a: ghost_peers.deliver(
            r, g, t, x, a, spec=MailboxSpec(MailboxLayout(8)), two_shot=False),
            spec(7, 8, 7168), spec(8, 7168), spec(9, 2, dtype=jnp.uint32), spec(1, 8, 1536),
            spec(8, 7168))
    """, tmp_path)
    names = [name for name, _ in entries(ptx)]
    assert len(names) == 2 and all(ghost_peers.is_stand_in(name) for name in names), names
    assert not ghost_peers.is_stand_in("kernel_jax_kimik3kernelsproducerOprojProducer_0")
