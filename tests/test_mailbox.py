"""CPU: mailbox layout arithmetic, the multicast refusal, and the Lamport kernels' lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from tests.lowering import kept_ptx
from jax_kimik3.mailbox import (MULTICAST_OFF, PARITIES, SENTINEL, Mailbox, MailboxLayout,
                                peer_table, refuse_multicast)

H, C = 7168, 64
ROW = H * 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_layout_regions(tp):
    lay = MailboxLayout(tp)
    one_shot = PARITIES * tp * C * ROW
    assert lay.slot(0, 0) == 0
    assert lay.slot(1, 0) == tp * C * ROW  # parity 1 follows parity 0's T slots
    assert lay.slot(0, 1) == C * ROW and lay.slot(1, tp - 1, C - 1) == one_shot - ROW
    assert lay.receive(0, 0) == one_shot
    assert lay.chunk == H // tp and lay.receive(0, 1) - lay.receive(0, 0) == C * (H // tp) * 2
    assert lay.receive(1, 0) == one_shot + tp * C * (H // tp) * 2
    assert lay.gather(0) == one_shot + PARITIES * C * ROW
    assert lay.gather(1, 3) == lay.gather(0) + C * ROW + 3 * ROW
    assert lay.armed_bytes == one_shot + 2 * PARITIES * C * ROW
    assert lay.status >= lay.armed_bytes and lay.status % 256 == 0 and lay.nbytes > lay.status


def test_layout_size_at_tp8():
    """[2, 8, 64, 7168] bf16 one-shot slots plus 2 x [2, 64, 7168] two-shot regions."""
    assert MailboxLayout(8).armed_bytes == 2 * 8 * 64 * 7168 * 2 + 2 * 2 * 64 * 7168 * 2


@pytest.mark.parametrize("tp", [0, 3, 5])
def test_layout_rejects_bad_tp(tp):
    with pytest.raises(ValueError, match=f"tp={tp} must be >= 1 and divide hidden=7168"):
        MailboxLayout(tp)


def test_parity_alternates_by_layer():
    assert [k3.KIMI_K3.layer(i).parity for i in range(4)] == [0, 1, 0, 1]


def test_peer_table_words():
    addresses = [0x7F12_3456_7800, 0x1_0000_0000, 0xFFFF_FFFF]
    table = peer_table(addresses, multicast=0x7F00_0020_0000)
    assert table.dtype == np.uint32 and table.shape == (4, 2)
    assert [int(lo) | int(hi) << 32 for lo, hi in table] == addresses + [0x7F00_0020_0000]
    assert peer_table(addresses)[3].tolist() == [0, 0]  # no multicast object


@pytest.mark.parametrize("name", sorted(MULTICAST_OFF))
def test_multicast_refused(monkeypatch, name):
    for other in MULTICAST_OFF:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, MULTICAST_OFF[name])
    with pytest.raises(RuntimeError, match=f"multicast mailbox refused: {name}="):
        Mailbox([0, 1], MailboxLayout(2), multicast=True)
    with pytest.raises(RuntimeError, match=name):
        refuse_multicast()


def test_sentinel_is_negative_zero():
    assert np.array([SENTINEL], np.uint32).view(np.float32)[0] == 0.0
    assert np.signbit(np.array([SENTINEL], np.uint32).view(np.float32)[0])


@dataclasses.dataclass(frozen=True, eq=False)
class FakeMailbox:
    """Layout and peer table without GPU memory: enough to trace and lower."""

    layout: MailboxLayout
    multicast: bool = False

    @property
    def tp(self):
        return self.layout.tp

    @property
    def peer_table(self):
        return peer_table([0x1000_0000 * (r + 1) for r in range(self.tp)])


def _lower(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


pytest.importorskip("cutlass")


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_virtual_all_reduce_lowers(tp, two_shot):
    mailbox = FakeMailbox(MailboxLayout(tp))
    text = _lower(functools.partial(k3.all_reduce_virtual, mailbox=mailbox, parity=tp % 2,
                                    two_shot=two_shot),
                  jax.ShapeDtypeStruct((tp, 8, H), jnp.bfloat16))
    assert "CuteDSLRT_NvJaxCutlassCall" in text


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_all_reduce_lowers_under_shard_map(two_shot):
    tp = 4
    mailbox = FakeMailbox(MailboxLayout(tp))
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    f = jax.shard_map(functools.partial(k3.all_reduce, mailbox=mailbox, axis_name="tp", parity=0,
                                        two_shot=two_shot),
                      mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    text = _lower(f, jax.ShapeDtypeStruct((tp * 8, H), jnp.bfloat16))
    assert text.count("CuteDSLRT_NvJaxCutlassCall") >= 2 + two_shot


def test_all_reduce_rejects_bad_input():
    mailbox = FakeMailbox(MailboxLayout(2))
    with pytest.raises(ValueError, match=r"partials\[r\] has batch B=65; must be in \[1, 64\]"):
        _lower(functools.partial(k3.all_reduce_virtual, mailbox=mailbox, parity=0),
               jax.ShapeDtypeStruct((2, 65, H), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"parity=2 must be 0 or 1"):
        _lower(functools.partial(k3.all_reduce_virtual, mailbox=mailbox, parity=2),
               jax.ShapeDtypeStruct((2, 8, H), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"partials has shape=\(3, 8, 7168\); expected \[tp=2, B, H\]"):
        _lower(functools.partial(k3.all_reduce_virtual, mailbox=mailbox, parity=0),
               jax.ShapeDtypeStruct((3, 8, H), jnp.bfloat16))
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    f = jax.shard_map(functools.partial(k3.all_reduce, mailbox=mailbox, axis_name="tp", parity=0),
                      mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    with pytest.raises(ValueError, match=r"axis 'tp' has 4 ranks; the mailbox has tp=2"):
        _lower(f, jax.ShapeDtypeStruct((32, H), jnp.bfloat16))


@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "new_block"])
def test_oproj_attn_res_kernels_lower_under_shard_map(has_delta):
    """With a mailbox the tail is kernels: as tuning.TAIL_VARIANTS says, the fused kernel (one
    call) or a publish, then the AttnRes ring consumer (two)."""
    from jax_kimik3 import tuning
    tp, b, nb = 4, 8, 8
    mailbox = FakeMailbox(MailboxLayout(tp))
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    f = jax.shard_map(
        functools.partial(k3.oproj_attn_res, axis_name="tp", num_blocks=3, has_delta=has_delta,
                          mailbox=mailbox, parity=1, backend="kernel"),
        mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")) + (P(),) * 5, out_specs=P())
    s = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    text = _lower(f, s((b, 12288)), s((H, 12288)), s((b, H)), s((b, nb, H)), s((H,)), s((H,)),
                  s((H,)))
    calls = 1 if tuning.tail_variant(b, 12288 // tp) == "fused" else 2
    assert text.count("CuteDSLRT_NvJaxCutlassCall") >= calls
    assert "all-reduce" not in text  # no XLA collective: the mailbox carries the sum


def test_oproj_attn_res_kernel_backend_needs_a_mailbox():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    f = jax.shard_map(functools.partial(k3.oproj_attn_res, axis_name="tp", num_blocks=1,
                                        has_delta=True, backend="kernel"),
                      mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")) + (P(),) * 5,
                      out_specs=P())
    s = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"backend='kernel' needs mailbox="):
        _lower(f, s((4, 64)), s((H, 64)), s((4, H)), s((4, 8, H)), s((H,)), s((H,)), s((H,)))


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_multicast_publish_compiles_to_multimem(tmp_path, two_shot):
    """The multicast variant (never run here) publishes with one multimem.st per vector."""
    script = f"""
import functools, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_kimik3 as k3
from tests.test_mailbox import FakeMailbox
from jax_kimik3.mailbox import MailboxLayout
box = FakeMailbox(MailboxLayout(4), multicast=True)
mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
f = jax.shard_map(functools.partial(k3.all_reduce, mailbox=box, axis_name="tp", parity=0,
                                    two_shot={two_shot}), mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
jax.jit(f).trace(jax.ShapeDtypeStruct((32, 7168), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
"""
    ptx = kept_ptx(script, tmp_path, devices=4)
    assert "multimem.st.relaxed.sys.global.v4.f32" in ptx


@pytest.mark.parametrize("b,tp,kernels", [(4, 2, 1), (8, 2, 2), (8, 8, 2), (64, 8, 3)])
def test_virtual_tail_lowers_to_the_table_variant(b, tp, kernels):
    """oproj_attn_res_virtual with a mailbox: every rank's tail as kernels (the lowering keeps
    one copy of each distinct kernel): the fused one where the table says fused (TP 2,
    B <= 4); else the producer and the consumer; at B = 64, TP 8 XLA's dot, the publish, the
    two-shot owner and the consumer."""
    from jax_kimik3 import tuning
    variant = tuning.tail_variant(b, 12288 // tp)
    assert variant == ("fused" if kernels == 1 else "xla" if b > 16 else "split")
    f = functools.partial(k3.oproj_attn_res_virtual, num_blocks=3, has_delta=True,
                          mailbox=FakeMailbox(MailboxLayout(tp)), parity=1, backend="kernel")
    s = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    text = _lower(f, s((tp, b, 12288 // tp)), s((tp, H, 12288 // tp)), s((b, H)),
                  s((b, 8, H)), s((H,)), s((H,)), s((H,)))
    assert text.count("custom_call @CuteDSLRT_NvJaxCutlassCall") == kernels
    assert ("dot_general" in text) == (variant == "xla")
