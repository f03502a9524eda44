"""CPU: mailbox layout arithmetic, the multicast refusal, and the Lamport kernels' lowering."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from jax_kimik3.kernels.geometry import FUSED_POLLS_AHEAD, HOLDING_MAX_BATCH
from tests.lowering import entries, kept_ptx
from jax_kimik3.layout import (BUFFERS, CONTROL, SENTINEL, MailboxLayout, MailboxSpec,
                               peer_table)
from jax_kimik3.mailbox import MULTICAST_OFF, Mailbox, refuse_multicast

H, C = k3.KIMI_K3.hidden_size, k3.KIMI_K3.mailbox_capacity
K_TOTAL = k3.KIMI_K3.o_proj_in_features
ROW = H * 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_layout_regions(tp):
    lay = MailboxLayout(tp)
    one_shot = BUFFERS * tp * C * ROW
    assert lay.slot(0, 0) == 0
    assert lay.slot(1, 0) == tp * C * ROW  # buffer 1 follows buffer 0's T slots
    assert lay.slot(0, 1) == C * ROW and lay.slot(1, tp - 1, C - 1) == one_shot - ROW
    assert lay.receive(0, 0) == one_shot
    assert lay.chunk == H // tp and lay.receive(0, 1) - lay.receive(0, 0) == C * (H // tp) * 2
    assert lay.receive(1, 0) == one_shot + tp * C * (H // tp) * 2
    assert lay.gather(0) == one_shot + BUFFERS * C * ROW
    assert lay.gather(1, 3) == lay.gather(0) + C * ROW + 3 * ROW
    assert lay.armed_bytes == one_shot + 2 * BUFFERS * C * ROW
    assert lay.control >= lay.armed_bytes and lay.control % 256 == 0
    assert lay.word(CONTROL.ARRIVALS) == lay.control + 4 * CONTROL.ARRIVALS
    assert lay.nbytes >= lay.control + 4 * CONTROL.WORDS


def test_layout_size_at_tp8():
    """[2, 8, 64, 7168] bf16 one-shot slots plus 2 x [2, 64, 7168] two-shot regions."""
    assert MailboxLayout(8).armed_bytes == 2 * 8 * 64 * 7168 * 2 + 2 * 2 * 64 * 7168 * 2


@pytest.mark.parametrize("tp", [3, 5])
def test_layout_rejects_bad_tp(tp):
    with pytest.raises(ValueError, match=f"tp={tp} must be >= 1 and divide hidden=7168"):
        MailboxLayout(tp)


def test_control_words_are_distinct():
    words = [v for k, v in vars(CONTROL).items() if k.isupper() and k != "WORDS"]
    assert len(set(words)) == len(words) and max(words) < CONTROL.WORDS


def test_layout_offsets_fit_int32_at_tp16():
    """The kernels compute offsets in int32 before widening (buffer and rank are traced)."""
    lay = MailboxLayout(16)
    assert lay.gather(1, C - 1) + ROW < 2**31 and lay.slot(1, 15, C - 1) < 2**31


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


@pytest.mark.parametrize("name,value,refused", [
    ("NCCL_NVLS_ENABLE", "00", True), ("NCCL_NVLS_ENABLE", " 0", True),
    ("NCCL_NVLS_ENABLE", "false", True), ("NCCL_NVLS_ENABLE", "1", False),
    ("NVSHMEM_DISABLE_NVLS", "true", True), ("NVSHMEM_DISABLE_NVLS", "yes", True),
    ("NVSHMEM_DISABLE_NVLS", "2", True), ("NVSHMEM_DISABLE_NVLS", "0", False),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "True", True),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "off", False),
])
def test_multicast_switches_read_as_their_libraries_read_them(name, value, refused):
    """An enable switch is off where it reads as 0 or false, a disable switch on where it
    reads as anything else: each refuses the multicast mailbox."""
    if refused:
        with pytest.raises(RuntimeError, match=rf"{name}={value!r} disables NVLink multicast"):
            refuse_multicast({name: value})
    else:
        refuse_multicast({name: value})


def test_sentinel_is_negative_zero():
    assert np.array([SENTINEL], np.uint32).view(np.float32)[0] == 0.0
    assert np.signbit(np.array([SENTINEL], np.uint32).view(np.float32)[0])


def spec(tp, **kw):
    return MailboxSpec(MailboxLayout(tp), **kw)


def table(tp):
    """A peer table of made-up addresses: enough to trace and lower."""
    return peer_table([0x1000_0000 * (r + 1) for r in range(tp)])


def _lower(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _mesh(tp):
    return Mesh(np.array(jax.devices()[:tp]), ("tp",))


pytest.importorskip("cutlass")
CALL = "custom_call @CuteDSLRT_NvJaxCutlassCall"


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_virtual_all_reduce_is_one_call(tp, two_shot):
    """Every rank's publish, [owner,] consumer: ONE custom call, so no other mailbox call can
    run between its kernels."""
    text = _lower(functools.partial(k3.all_reduce_virtual, mailbox=spec(tp, virtual=True),
                                    peer_table=table(tp), two_shot=two_shot),
                  jax.ShapeDtypeStruct((tp, 8, H), jnp.bfloat16))
    assert text.count(CALL) == 1


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_all_reduce_lowers_under_shard_map(two_shot):
    tp = 4
    f = jax.shard_map(functools.partial(k3.all_reduce, mailbox=spec(tp), peer_table=table(tp),
                                        axis_name="tp", two_shot=two_shot),
                      mesh=_mesh(tp), in_specs=P("tp"), out_specs=P("tp"))
    text = _lower(f, jax.ShapeDtypeStruct((tp * 8, H), jnp.bfloat16))
    assert text.count(CALL) == 1 and "all-reduce" not in text


def test_all_reduce_rejects_bad_input():
    mailbox = spec(2, virtual=True)
    virtual = functools.partial(k3.all_reduce_virtual, mailbox=mailbox, peer_table=table(2))
    with pytest.raises(ValueError, match=r"partials\[r\] has batch B=65; must be in \[1, 64\]"):
        _lower(virtual, jax.ShapeDtypeStruct((2, 65, H), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"partials has TP=3 shards; the mailbox has tp=2"):
        _lower(virtual, jax.ShapeDtypeStruct((3, 8, H), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'parity'"):
        k3.all_reduce_virtual(jnp.zeros((2, 8, H), jnp.bfloat16), mailbox, parity=0)
    f = jax.shard_map(functools.partial(k3.all_reduce, mailbox=spec(2), peer_table=table(2),
                                        axis_name="tp"),
                      mesh=_mesh(4), in_specs=P("tp"), out_specs=P("tp"))
    with pytest.raises(ValueError, match=r"axis 'tp' has 4 ranks; the mailbox has tp=2"):
        _lower(f, jax.ShapeDtypeStruct((32, H), jnp.bfloat16))


def _tail_args(b, k):
    s = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    return s((b, k)), s((H, k)), s((b, H)), s((b, 8, H)), s((H,)), s((H,)), s((H,))


@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "new_block"])
@pytest.mark.parametrize("b", [4, 8, 64])
def test_oproj_attn_res_kernels_lower_under_shard_map(has_delta, b):
    """With a mailbox the tail is kernels, in ONE custom call whatever the table's variant
    (split, or XLA's dot + the call), and no XLA collective: the mailbox carries the sum."""
    from jax_kimik3 import tuning
    tp = 4
    f = jax.shard_map(
        functools.partial(k3.oproj_attn_res, axis_name="tp", num_blocks=3, has_delta=has_delta,
                          mailbox=spec(tp), peer_table=table(tp), backend="kernel"),
        mesh=_mesh(tp), in_specs=(P(None, "tp"), P(None, "tp")) + (P(),) * 5, out_specs=P())
    b_, k, *rest = _tail_args(b, K_TOTAL)
    text = _lower(f, b_, k, *rest)
    assert text.count(CALL) == 1
    assert "all-reduce" not in text
    assert ("dot_general" in text) == (tuning.tail_variant(b, K_TOTAL // tp) == "xla")


def test_oproj_attn_res_kernel_backend_needs_a_mailbox():
    f = jax.shard_map(functools.partial(k3.oproj_attn_res, axis_name="tp", num_blocks=1,
                                        has_delta=True, backend="kernel"),
                      mesh=_mesh(2), in_specs=(P(None, "tp"), P(None, "tp")) + (P(),) * 5,
                      out_specs=P())
    with pytest.raises(ValueError, match=r"backend='kernel' needs mailbox="):
        _lower(f, *_tail_args(4, K_TOTAL))


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_multicast_publish_compiles_to_multimem(tmp_path, two_shot):
    """The multicast variant (never run here) publishes with one multimem.st per vector."""
    script = f"""
import functools, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_kimik3 as k3
from tests.test_mailbox import spec, table
mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
f = jax.shard_map(functools.partial(k3.all_reduce, mailbox=spec(4, multicast=True),
                                    peer_table=table(4), axis_name="tp", two_shot={two_shot}),
                  mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
jax.jit(f).trace(jax.ShapeDtypeStruct((32, 7168), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
"""
    ptx = kept_ptx(script, tmp_path, devices=4)
    assert "multimem.st.relaxed.sys.global.v4.f32" in ptx


@pytest.mark.parametrize("b,tp", [(4, 2), (8, 2), (8, 8), (64, 8)])
def test_virtual_tail_lowers_to_the_table_variant(b, tp):
    """oproj_attn_res_virtual with a mailbox: every rank's tail in ONE custom call, the
    table's variant (split at these B, or XLA's dot: its dot_general)."""
    from jax_kimik3 import tuning
    variant = tuning.tail_variant(b, K_TOTAL // tp)
    f = functools.partial(k3.oproj_attn_res_virtual, num_blocks=3, has_delta=True,
                          mailbox=spec(tp, virtual=True), peer_table=table(tp), backend="kernel")
    s = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    text = _lower(f, s((tp, b, K_TOTAL // tp)), s((tp, H, K_TOTAL // tp)), s((b, H)),
                  s((b, 8, H)), s((H,)), s((H,)), s((H,)))
    assert text.count(CALL) == 1
    assert ("dot_general" in text) == (variant == "xla")


MEMORY_MODEL = [  # (what the PTX must hold, why)
    ("ld.relaxed.sys.global.v4.u32", "every poll is a strong system-scope load"),
    ("st.relaxed.sys.global.v4.b32", "publish and re-arm stores are strong at system scope"),
    ("fence.release.sys", "publishing kernels fence (release) before their stores"),
    ("%globaltimer", "waits are bounded by time"),
    ("atom.release.gpu.global.add.u32", "the CTAs of a call's last kernel count their arrivals"),
    ("fence.acquire.gpu", "the last to arrive acquires the others' reads of the counter"),
    ("red.relaxed.gpu.global.add.u32", "the last CTA advances the call counter"),
    ("red.relaxed.gpu.global.or.b32", "a timeout records the missing ranks"),
]


def tail_ptx(tmp_path, variant, *, b=4, two_shot=None):
    """Kept PTX of one rank's tail call at TP 4 (K = 3072, 3 saved blocks, a delta) at B = `b`,
    lowered for CUDA (`two_shot` None: the table's choice)."""
    return kept_ptx(f"""
import jax, jax.numpy as jnp
from jax_kimik3.kernels import oproj
from tests.test_mailbox import spec, table
s = jax.ShapeDtypeStruct
t, r = jnp.asarray(table(4)), jnp.zeros((1,), jnp.int32)
def f(x, w, p, b, g, pw, o):
    return oproj.tail(x, w, p, b, g, pw, o, table=t, ranks=r, spec=spec(4), num_blocks=3,
                      has_delta=True, eps=1e-5, out_eps=1e-5, variant={variant!r},
                      two_shot={two_shot})
args = [s((1, {b}, 3072), jnp.bfloat16), s((1, 7168, 3072), jnp.bfloat16),
        s(({b}, 7168), jnp.bfloat16), s(({b}, 8, 7168), jnp.bfloat16)] + [s((7168,), jnp.bfloat16)] * 3
jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
""", tmp_path)


def attn_res_body(ptx):
    """The one AttnRes kernel body of a tail's PTX."""
    bodies = [body for name, body in entries(ptx) if "AttnRes" in name]
    assert len(bodies) == 1
    return bodies[0]


@pytest.mark.parametrize("two_shot", [False, True])
def test_two_shot_tail_counts_an_owners_nan_as_a_failure(tmp_path, two_shot):
    """After a two-shot reduction the tail's AttnRes kernel tests each gathered vector for NaN
    (what an owner that gave up sends) as bits, so the row fails whole; one-shot does not."""
    body = attn_res_body(tail_ptx(tmp_path, "split", two_shot=two_shot))
    nan_test = re.search(r"setp\.\w+\.u32\s+%p\d+, %r\d+, (2139095040|2139095041);", body)
    assert bool(nan_test) == two_shot


@pytest.mark.parametrize("variant, b", [("split", 4), ("split", HOLDING_MAX_BATCH + 1),
                                         ("xla", 4), ("fused", 4)])
def test_tail_sums_the_saved_blocks_before_the_poll(tmp_path, variant, b):
    """A tail's AttnRes row takes the warp sums of what the poll does not change (the saved
    blocks' partial sums; holding, over three blocks, their pair sums too) before its first
    poll loop, and only p's and the failure's (and the output norm's) after it."""
    def shuffles(variant, b, path):
        body = attn_res_body(tail_ptx(path, variant, b=b))
        poll = body.find("nanosleep.u32")  # the first poll loop's pause
        assert poll > 0
        return body[:poll].count("shfl.sync.bfly"), body[poll:].count("shfl.sync.bfly")

    before, after = shuffles(variant, b, tmp_path)
    assert before > 0 and after > 0, (before, after)
    if variant == "split" and b <= HOLDING_MAX_BATCH:  # the blocks' pair sums come early too
        (tmp_path / "not_holding").mkdir()
        assert before > shuffles("split", HOLDING_MAX_BATCH + 1, tmp_path / "not_holding")[0]


@pytest.mark.parametrize("variant, b, holding", [
    ("split", 4, True), ("split", HOLDING_MAX_BATCH, True), ("split", HOLDING_MAX_BATCH + 1, False),
    ("xla", 4, False)])
def test_tail_holds_its_inputs_over_few_rows(tmp_path, variant, b, holding):
    """A tail's AttnRes kernel over the producer's rows at B <= HOLDING_MAX_BATCH holds what
    it uses again after the poll in registers; over more rows, or XLA's rows at any B, it
    prefetches the prefix and output-norm weight into L1 and reads them again."""
    body = attn_res_body(tail_ptx(tmp_path, variant, b=b))
    assert ("prefetch.global.L1" not in body) == holding


@pytest.mark.parametrize("kind", ["all_reduce", "two_shot", "split", "xla", "fused"])
def test_memory_model_in_ptx(tmp_path, kind):
    """Every mailbox kernel family emits the stores, polls and fences docs/protocol.md
    states (ld.volatile is gone); its pollers put every slot's first poll in flight at once
    and re-arm the slots they read with strong stores only."""
    if kind in ("all_reduce", "two_shot"):
        ptx = kept_ptx(f"""
import jax, jax.numpy as jnp
from jax_kimik3.kernels import lamport_ops
from tests.test_mailbox import spec, table
t, r = jnp.asarray(table(4)), jnp.zeros((1,), jnp.int32)
f = lambda x: lamport_ops.all_reduce(x, t, r, spec=spec(4), two_shot={kind == "two_shot"})
jax.jit(f).trace(jax.ShapeDtypeStruct((1, 8, 7168), jnp.bfloat16)).lower(
    lowering_platforms=("cuda",))
""", tmp_path)
    else:
        ptx = tail_ptx(tmp_path, kind)
    for text, why in MEMORY_MODEL:
        assert text in ptx, why
    assert "fence.acq_rel.sys" not in ptx  # its acquire half would invalidate the SM's L1
    assert "fence.acq_rel.gpu" not in ptx  # its release half would wait for the CTA's stores
    assert "ld.volatile" not in ptx
    publishers = [(name, body) for name, body in entries(ptx) if any(
        k in name for k in ("cutlass_publish_", "OprojProducer", "OprojAttnResFused"))]
    assert publishers
    for name, body in publishers:  # the release fence comes first, before any global access
        first = re.search(r"\b(ld|st|atom|red)\.(global|relaxed|acq|release)", body)
        assert 0 <= body.find("fence.release.sys") < first.start(), name
        # a call's first kernel lets the next one (a dependent launch) start early
        assert ("griddepcontrol.launch_dependents" in body) == ("Fused" not in name), name
    for name, body in entries(ptx):  # a dependent launch waits for the kernel before it ...
        if (name, body) not in publishers:
            wait = body.find("griddepcontrol.wait")
            assert wait >= 0, name
            if "AttnRes" in name:  # ... the tail's AttnRes kernel: before it advances the call
                assert wait < body.find("red.relaxed.gpu.global.add.u32"), name
                assert "ld.relaxed.sys.global.v4.u32" in body[:wait], name  # it polled first
            else:  # ... the others: before they touch the mailbox
                assert not re.search(r"\b(?:ld|st|atom|red)\.(?:relaxed|acq|release)",
                                     body[:wait]), name
    # Every poller issues the first poll of each slot it sums (TP 4; a two-shot consumer
    # polls one gather slot; the fused tail, under its register cap, FUSED_POLLS_AHEAD + 1)
    # after its control words and before it checks any for SENTINEL.
    armed = re.compile(rf"setp\.\w+\.b32\s+%p\d+, %r\d+, {SENTINEL - (1 << 32)};")
    pollers = [(name, body) for name, body in entries(ptx) if armed.search(body)]
    assert pollers
    for name, body in pollers:
        slots = (1 if kind == "two_shot" and "consume" in name
                 else FUSED_POLLS_AHEAD + 1 if "Fused" in name else 4)
        before = body[:armed.search(body).start()]
        assert before.count("ld.relaxed.sys.global.v4.u32") >= 1 + slots, name
        # ... and re-arms what it read with strong stores only: every store of a register
        # that holds SENTINEL is st.relaxed.sys, at least one 16-byte word per slot.
        held = set(re.findall(rf"mov\.b32\s+(%r\d+), {SENTINEL - (1 << 32)};", body))
        rearms = [op for op, regs in re.findall(r"\b(st\.[\w.]+)\s+\[[^\]]*\],\s*([^;]*);", body)
                  if held & set(re.findall(r"%r\d+", regs))]
        assert len(rearms) >= slots and set(rearms) == {"st.relaxed.sys.global.v4.b32"}, (
            name, rearms)
