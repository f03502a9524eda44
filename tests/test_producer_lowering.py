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


def test_ptx_streams_weights_into_mma(tmp_path):
    """Tensor-core mma.sync on bf16, weights through 16-byte streaming loads, rows through
    16-byte (weak: an ordinary output) stores."""
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
    (8, 1, None), (8, 1, "one_shot"), (8, 2, None), (8, 2, "one_shot"), (8, 2, "two_shot"),
    (8, 8, None), (8, 8, "one_shot"), (4, 1, "one_shot"), (4, 2, "one_shot"), (16, 1, None),
    (16, 2, None), (16, 2, "one_shot")])
def test_register_budget_only_at_its_tile_counts(tmp_path, tp, tiles, publish):
    """The producer's launch carries the register budget (.minnctapersm) of
    geometry.PRODUCER_BUDGETS at its (K, B tiles), the plain product's or the one-shot
    publish's, none when it publishes two-shot; with two row groups per CTA (from
    PRODUCER_GROUPED_TILES) the one that keeps its CTAs in one wave; none elsewhere."""
    from jax_kimik3.kernels.geometry import (PRODUCER_BUDGETS, PRODUCER_GROUPED_CTAS_PER_SM,
                                             PRODUCER_GROUPED_TILES)

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
    plain, one_shot = PRODUCER_BUDGETS.get((k, tiles), (None, None))
    budget = plain if publish is None else one_shot
    if budget is not None and publish != "two_shot":
        wanted = [str(budget)]
    elif tiles >= PRODUCER_GROUPED_TILES:
        wanted = [str(PRODUCER_GROUPED_CTAS_PER_SM)]
    else:
        wanted = []
    assert budgets == wanted


@pytest.mark.parametrize("tiles", range(1, 9))
def test_row_groups_share_x_from_many_tiles(tiles):
    """From PRODUCER_GROUPED_TILES B tiles a CTA takes two 16-row groups: half the CTAs, each
    x load feeding both."""
    from jax_kimik3.kernels.geometry import PRODUCER_GROUPED_TILES
    from jax_kimik3.kernels.producer import row_groups

    groups = row_groups(tiles)
    assert groups == (2 if tiles >= PRODUCER_GROUPED_TILES else 1)
    producer = OprojProducer(tiles, K_TOTAL // 8, H, None, groups=groups)
    assert producer.ctas_per_rank == H // (16 * groups)
    with pytest.raises(ValueError, match="N=7160 of 32"):
        OprojProducer(tiles, K_TOTAL // 8, H - 8, None, groups=2)
