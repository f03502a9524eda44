"""CPU: the o_proj producer compiles for sm_90a at every TP's K and lowers to its custom call."""


import jax.numpy as jnp
import pytest

from jax_kimik3.mailbox import MailboxLayout
from tests.lowering import CUSTOM_CALL, kept_ptx, lower_for_cuda, spec

pytest.importorskip("cutlass")
from jax_kimik3.kernels import producer_ops as producer  # noqa: E402
from jax_kimik3.kernels.producer import OprojProducer  # noqa: E402

H, K_TOTAL = 7168, 12288


@pytest.mark.parametrize("b", [1, 9, 64])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_rows_lower(tp, b):
    assert CUSTOM_CALL in lower_for_cuda(producer.project, spec(b, K_TOTAL // tp),
                                         spec(H, K_TOTAL // tp))


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("tp", [2, 8, 16])
def test_publish_lowers(tp, two_shot):
    def f(x, w, table, rank):
        return producer.produce(x, w, table, rank, layout=MailboxLayout(tp), parity=1,
                                two_shot=two_shot)
    assert CUSTOM_CALL in lower_for_cuda(f, spec(8, K_TOTAL // tp), spec(H, K_TOTAL // tp),
                                         spec(tp + 1, 2, dtype=jnp.uint32),
                                         spec(1, dtype=jnp.int32))


@pytest.mark.parametrize("k,b", [(1000, 8), (1536, 0), (1536, 65)])
def test_unsupported_shapes_are_refused(k, b):
    with pytest.raises(ValueError, match="o_proj producer"):
        OprojProducer(b, k, H, None)


def test_ptx_streams_weights_into_mma(tmp_path):
    """Tensor-core mma.sync on bf16, weights through 16-byte streaming loads, rows through
    16-byte stores."""
    ptx = kept_ptx(f"""
        import jax, jax.numpy as jnp
        from jax_kimik3.kernels import producer_ops as producer
        s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        jax.jit(producer.project).trace(s(64, 1536), s({H}, 1536)).lower(
            lowering_platforms=("cuda",))
    """, tmp_path)
    assert ".target sm_90a" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.global.nc.L1::no_allocate.L2::256B.v4.u32" in ptx
    assert "st.global.v4.u32" in ptx


@pytest.mark.parametrize("b,tp,producer_kernel", [(8, 8, True), (1, 16, True), (64, 8, False),
                                                  (8, 1, False), (1, 2, True), (32, 2, False)])
def test_tail_takes_the_measured_variant(b, tp, producer_kernel):
    """tuning.TAIL_VARIANTS decides: the producer kernel (no XLA dot; alone, or in the fused
    launch) or XLA's dot + publish, then the consumer (one-shot)."""
    from jax_kimik3.kernels import oproj
    from jax_kimik3.tuning import tail_variant, use_producer
    assert use_producer(b, K_TOTAL // tp) == producer_kernel

    def f(x, w, prefix, blocks, g, proj, out_w, table, rank):
        return oproj.oproj_attn_res(x, w, prefix, blocks, g, proj, out_w, table=table, rank=rank,
                                    layout=MailboxLayout(tp), parity=0, num_blocks=4,
                                    has_delta=True, eps=1e-5, out_eps=1e-5, two_shot=False)
    text = lower_for_cuda(f, spec(b, K_TOTAL // tp), spec(H, K_TOTAL // tp), spec(b, H),
                          spec(b, 8, H), spec(H), spec(H), spec(H),
                          spec(tp + 1, 2, dtype=jnp.uint32), spec(1, dtype=jnp.int32))
    assert text.count(CUSTOM_CALL) == (1 if tail_variant(b, K_TOTAL // tp) == "fused" else 2)
    assert ("dot_general" in text) != producer_kernel


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_two_shot_tail_adds_the_owner(two_shot):
    """The two-shot tail: producer, owner (chunk sums) and AttnRes consumer; one-shot: two."""
    from jax_kimik3.kernels import oproj
    tp, b = 4, 64
    text = lower_for_cuda(
        lambda x, w, p, bl, g, pw, o, table, rank: oproj.oproj_attn_res(
            x, w, p, bl, g, pw, o, table=table, rank=rank, layout=MailboxLayout(tp), parity=1,
            num_blocks=4, has_delta=True, eps=1e-5, out_eps=1e-5, two_shot=two_shot),
        spec(b, K_TOTAL // tp), spec(H, K_TOTAL // tp), spec(b, H), spec(b, 8, H), spec(H),
        spec(H), spec(H), spec(tp + 1, 2, dtype=jnp.uint32), spec(1, dtype=jnp.int32))
    assert text.count(f"custom_call @{CUSTOM_CALL}") == 2 + two_shot
