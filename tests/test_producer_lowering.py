"""CPU: the o_proj producer compiles for sm_90a at every TP's K and lowers to its custom call,
alone or as the first kernel of the tail call."""

import re

import jax.numpy as jnp
import pytest

from jax_kimik3.config import KIMI_K3
from jax_kimik3.layout import MailboxLayout, MailboxSpec
from tests.lowering import CUSTOM_CALL, entries, kept_ptx, kernel_calls, lower_for_cuda, spec

pytest.importorskip("cutlass")
from jax_kimik3.kernels import producer_ops as producer  # noqa: E402
from jax_kimik3.kernels import variants  # noqa: E402
from jax_kimik3.kernels.producer import OprojProducer  # noqa: E402

H, K_TOTAL = KIMI_K3.hidden_size, KIMI_K3.o_proj_in_features


@pytest.mark.parametrize("b", [1, 9, 64])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_rows_lower(tp, b):
    assert CUSTOM_CALL in lower_for_cuda(producer.project, spec(b, K_TOTAL // tp),
                                         spec(H, K_TOTAL // tp))


def split_tail(tp, b, ranks=1, two_shot=False):
    """(kernel calls, StableHLO) of the split tail: the producer publishes, the AttnRes kernel
    completes the all-reduce."""
    from jax_kimik3.kernels import oproj

    def f(x, w, p, bl, g, pw, o, table, ids):
        return oproj.tail(x, w, p, bl, g, pw, o, table=table, ranks=ids,
                          spec=MailboxSpec(MailboxLayout(tp)), num_blocks=4, has_delta=True,
                          eps=1e-5, out_eps=1e-5, two_shot=two_shot, variant="split")
    k = K_TOTAL // tp
    return kernel_calls(f, spec(ranks, b, k), spec(ranks, H, k), spec(b, H), spec(b, 8, H),
                        spec(H), spec(H), spec(H), spec(tp + 1, 2, dtype=jnp.uint32),
                        spec(ranks, dtype=jnp.int32))


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("tp", [2, 8, 16])
def test_publish_lowers(tp, two_shot):
    calls, text = split_tail(tp, 8, two_shot=two_shot)
    assert text.count(f"custom_call @{CUSTOM_CALL}") == 1
    (call,) = calls
    assert call.variant.family == "tail" and call.variant.params[:2] == (1, K_TOTAL // tp)


@pytest.mark.parametrize("k,tiles", [(1000, 1), (1536, 0), (1536, 9)])
def test_unsupported_shapes_are_refused(k, tiles):
    with pytest.raises(ValueError, match="o_proj producer"):
        OprojProducer(tiles, k, H, None)


@pytest.mark.parametrize("b,tiles", [(1, 1), (8, 1), (9, 2), (64, 8)])
def test_one_producer_per_b_tile_count(b, tiles):
    """The producer reads B at run time: compiled per B tile count, not per batch."""
    assert variants.tiles(b) == tiles
    for bad in (0, 65):
        with pytest.raises(ValueError, match=rf"B={bad} must be in \[1, 64\]"):
            variants.tiles(bad)


@pytest.mark.parametrize("k,b", [(1536, 8), (1536, 9), (3072, 1)],
                         ids=["streamed", "staged", "staged_long_k"])
def test_ptx_feeds_weights_into_mma(tmp_path, k, b):
    """Tensor cores on bf16, rows out through 16-byte (weak: an ordinary output) stores;
    streamed, the weights go into registers through 16-byte streaming loads and mma.sync,
    staged (producer.is_staged) both operands into shared memory (cp.async, 16 bytes) and
    from there into wgmma (M = 64 rows of w, N = 8 per B tile), fenced for the async proxy."""
    from jax_kimik3.kernels.producer import is_staged

    ptx = kept_ptx(f"""
        import jax, jax.numpy as jnp
        from jax_kimik3.kernels import producer_ops as producer
        s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        jax.jit(producer.project).trace(s({b}, {k}), s({H}, {k})).lower(
            lowering_platforms=("cuda",))
    """, tmp_path)
    staged = is_staged(variants.tiles(b), k)
    assert staged == (b > 8 or k > 1536)
    assert ".target sm_90a" in ptx
    assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx) == (not staged)
    assert ("ld.global.nc.L1::no_allocate.L2::256B.v4.u32" in ptx) == (not staged)
    assert ("cp.async.cg.shared.global" in ptx) == staged
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{8 * variants.tiles(b)}k16.f32.bf16.bf16"
    assert (wgmma in ptx) == staged
    assert ("fence.proxy.async.shared::cta" in ptx) == staged
    assert "st.global.v4.b32" in ptx


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_two_shot_tail_adds_the_owner(tmp_path, two_shot):
    """The tail call launches the producer, [the owner (chunk sums),] and the AttnRes kernel:
    its module holds two kernels one-shot, three two-shot. Each kernel but the last lets the
    next launch early, and each but the first (a dependent launch) waits for the one before it
    ahead of its mailbox reads."""
    ptx = kept_ptx(f"""
        from tests.test_producer_lowering import split_tail
        split_tail(4, 64, two_shot={two_shot})
    """, tmp_path)
    kernels = dict(entries(ptx))
    assert len(kernels) == 2 + two_shot
    for name, body in kernels.items():
        first, last = "Producer" in name, "AttnRes" in name
        assert ("griddepcontrol.launch_dependents" in body) == (not last), name
        assert ("griddepcontrol.wait" in body) == (not first), name


@pytest.mark.parametrize("tp, tiles, publish", [
    (8, 1, None), (8, 1, "one_shot"), (8, 1, "two_shot"), (8, 2, None), (8, 2, "one_shot"),
    (8, 8, None), (8, 8, "one_shot"), (16, 1, None), (16, 1, "one_shot"), (4, 1, None),
    (4, 1, "one_shot"), (16, 2, "one_shot")])
def test_register_budget_only_streamed_at_one_tile(tmp_path, tp, tiles, publish):
    """The producer's launch carries geometry.PRODUCER_BUDGETS' register budget
    (.minnctapersm) for its K where it streams one B tile, the plain product's or the one-shot
    publish's, none when it publishes two-shot; none staged (shared memory holds it to one CTA
    per SM) or elsewhere."""
    from jax_kimik3.kernels.geometry import PRODUCER_BUDGETS
    from jax_kimik3.kernels.producer import is_staged

    k, b = K_TOTAL // tp, 8 * tiles
    if publish is None:
        script = f"""
            from jax_kimik3.kernels import producer_ops
            from tests.lowering import lower_for_cuda, spec
            lower_for_cuda(producer_ops.project, spec({b}, {k}), spec({H}, {k}))
        """
    else:
        script = f"""
            from tests.test_producer_lowering import split_tail
            split_tail({tp}, {b}, two_shot={publish == "two_shot"})
        """
    ptx = kept_ptx(script, tmp_path)
    (producer_entry,) = [name for name, _ in entries(ptx) if "Producer" in name]
    head = ptx[ptx.index(producer_entry):]
    head = head[:head.index("{")]
    budgets = re.findall(r"\.minnctapersm (\d+)", head)
    plain, one_shot = PRODUCER_BUDGETS.get(k, (None, None))
    budget = plain if publish is None else one_shot
    streamed_budget = not is_staged(tiles, k) and publish != "two_shot" and budget is not None
    assert budgets == ([str(budget)] if streamed_budget else [])
    assert streamed_budget == (tiles == 1 and tp in (8, 16) and publish != "two_shot")


@pytest.mark.parametrize("tiles", range(1, 9))
@pytest.mark.parametrize("k", [768, 1536, 3072, 6144, 12288])
def test_staged_producer_owns_64_rows(tiles, k):
    """Staged (from geometry.STAGED_TILES[K] B tiles, else from one), a CTA owns 64 rows of
    w (112 CTAs per rank) and its shared memory holds STAGED_STAGES chunk buffers of its rows
    of w and of x, within the 227 KB one CTA may hold on sm_90; streamed, 16 rows (448 CTAs)."""
    from jax_kimik3.kernels.geometry import STAGED_STAGES, STAGED_TILES
    from jax_kimik3.kernels.producer import is_staged

    staged = is_staged(tiles, k)
    assert staged == (tiles >= STAGED_TILES.get(k, 1))
    producer = OprojProducer(tiles, k, H, None, staged=staged)
    assert producer.ctas_per_rank == (112 if staged else 448)
    buffers = STAGED_STAGES * (64 + 8 * tiles) * 128 * 2 if staged else 0
    assert buffers <= producer.smem_bytes <= 227 * 1024
    with pytest.raises(ValueError, match="N=7160 of 64"):
        OprojProducer(tiles, k, H - 8, None, staged=True)
