"""CPU: the library's catalog (jax_kimik3/kernels/catalog.py) holds every kernel call that the
canonical decode step (jax_kimik3.decode) makes, at every TP, at the batches where the
tail's tables change, with and without statistics ahead; and what the library compiles of a
call that reads its batch at run time was traced at a symbolic batch (traced only: nothing
compiles)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

import jax_kimik3 as k3
from jax_kimik3 import backend, decode
from jax_kimik3.kernels import catalog, launch, oproj

pytest.importorskip("cutlass")
LAYERS = 13  # through the first block write after the embedding (layer 12)
# The edges of tuning.py's tables and of the producer's B tiles.
BATCHES = (1, 4, 5, 8, 9, 16, 17, 24, 25, 32, 33, 63, 64)
H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks


def _symbolic(inputs):
    return any(not isinstance(d, int) for x in inputs if x is not None for d in x.shape)


@pytest.fixture(scope="module")
def catalog_calls():
    """name → (Call, whether its first trace, the one the library compiles, was symbolic)."""
    seen = {}

    def record(call, fn, inputs):
        seen.setdefault(call.name, (call, _symbolic(inputs)))

    with backend.kernel_mode_set("jit"), launch.recording(record):
        for _, function, args in catalog.decode_calls(num_layers=LAYERS):
            jax.make_jaxpr(function)(*args)
    return seen


@pytest.mark.parametrize("tp", catalog.TP_VALUES)
def test_decode_steps_call_only_catalog_kernels(catalog_calls, tp):
    """The step as a user runs it (the tables choose), traced at each edge batch."""
    params = decode.param_shapes(LAYERS)
    s = jax.ShapeDtypeStruct
    made = set()
    with backend.kernel_mode_set("jit"), launch.recording(lambda c, fn, i: made.add(c.name)):
        for stats_ahead in (False, True):
            step = decode.make_step(AbstractMesh((tp,), ("tp",)), params, LAYERS, "kernel",
                                    k3.MailboxSpec(k3.MailboxLayout(tp)), stats_ahead)
            for b in BATCHES:
                step.trace(params, s((b, H), jnp.bfloat16), s((b, NB, H), jnp.bfloat16),
                           s((tp, tp + 1, 2), jnp.uint32))
    assert made and made <= set(catalog_calls), sorted(made - set(catalog_calls))


def test_pre_attention_with_statistics_at_every_layer_is_in_the_catalog(catalog_calls):
    """A loop of its own that passes statistics at every pre-attention, layer 0's (of no saved
    block) too, where the canonical step passes none, finds each call in the library."""
    s = jax.ShapeDtypeStruct
    b = jax.export.symbolic_shape("b", constraints=(f"b <= {k3.KIMI_K3.mailbox_capacity}",))[0]
    rows, f32 = s((b, H), jnp.bfloat16), s((b, H), jnp.float32)
    vector = s((H,), jnp.bfloat16)
    made = set()
    with backend.kernel_mode_set("jit"), launch.recording(lambda c, fn, i: made.add(c.name)):
        for layer in range(LAYERS):
            tail = k3.AttentionTail(k3.KIMI_K3.layer(layer), backend="kernel")
            site = tail.plan.pre_attention

            def pre_attention(prefix, blocks, g, w, o, delta, mixture, scal, tail=tail, site=site):
                stats = k3.AttnResStatistics(mixture, scal, site.num_blocks)
                return tail.pre_attention(k3.AttnResWeights(g, w, o), prefix, blocks,
                                          delta if site.has_delta else None, stats)

            jax.make_jaxpr(pre_attention)(rows, s((b, NB, H), jnp.bfloat16), vector, vector,
                                          vector, rows, f32, s((b, 2), jnp.float32))
    assert made and made <= set(catalog_calls), sorted(made - set(catalog_calls))


def test_batch_read_at_run_time_is_traced_symbolic(catalog_calls):
    """A call whose kernel reads the batch at run time is first traced at a symbolic batch
    (the library compiles that trace: one object for every batch); only the fused tail,
    compiled per batch, is traced at a concrete one."""
    for call, symbolic in catalog_calls.values():
        assert symbolic == (call.variant.family != "fused"), call.description


def test_regions_cover_every_batch_once():
    """The tail regions of every TP partition 1..64 into runs, and a region's symbolic batch
    decides the tables as each of its batches does."""
    for tp in catalog.TP_VALUES:
        for ahead in (False, True):
            regions = catalog.tail_regions(tp, ahead)
            batches = [b for _, first, last in regions for b in range(first, last + 1)]
            assert batches == list(range(1, k3.KIMI_K3.mailbox_capacity + 1))
            k = k3.KIMI_K3.o_proj_local_features(tp)
            for choice, first, last in regions:
                b = catalog.region_batch(choice, first, last)
                assert oproj.choose(b, k, tp, ahead) == choice


def test_recording_sees_what_jax_had_cached():
    """A second recording of the same catalog entries in one process sees every call again
    (a cached trace makes no launch: recording clears JAX's caches first)."""
    def names():
        seen = set()
        with backend.kernel_mode_set("jit"), launch.recording(lambda c, fn, i: seen.add(c.name)):
            for _, function, args in catalog.decode_calls((2,), 2):
                jax.make_jaxpr(function)(*args)
        return seen

    first = names()
    assert first and names() == first


def test_a_tabled_fused_tail_runs_split_where_it_cannot(monkeypatch):
    """A table entry naming the fused tail (one-shot, without statistics ahead; none does
    today) runs it where it can, and the split tail where two-shot or statistics ahead is
    asked for or tabled (TP 8 runs two-shot from B = 24)."""
    from jax_kimik3 import tuning
    monkeypatch.setitem(tuning.TAIL_VARIANTS, 1536, ((64, "fused"),))
    split = functools.partial(oproj.TailChoice, "split")
    assert oproj.choose(8, 1536, 8, False) == oproj.TailChoice("fused", False, batch=8)
    assert oproj.choose(8, 1536, 8, True) == split(False, oproj.tiles(8))
    assert oproj.choose(8, 1536, 8, False, two_shot=True) == split(True, oproj.tiles(8))
    assert oproj.choose(32, 1536, 8, False) == split(True, oproj.tiles(32))
