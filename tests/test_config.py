"""The Kimi K3 layer plan against a table written out by hand."""

import math

import pytest

import jax_kimik3 as k3

# Written out, not computed: layers that start a block, and the MLA layers.
WRITE_LAYERS = {0: 0, 12: 1, 24: 2, 36: 3, 48: 4, 60: 5, 72: 6, 84: 7}
MLA_LAYERS = {3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 75, 79, 83,
              87, 91, 92}
SPOT_PREV_VALID = {0: 0, 1: 1, 11: 1, 12: 1, 13: 2, 24: 2, 25: 3, 84: 7, 85: 8, 92: 8}


def _hand_table():
    """(write, write_idx, prev_valid, mla) per layer: blocks completed before the layer."""
    rows = []
    for i in range(93):
        prev_valid = sum(1 for w in WRITE_LAYERS if w < i)
        rows.append((i in WRITE_LAYERS, WRITE_LAYERS.get(i, -1), prev_valid, i in MLA_LAYERS))
    return rows


def test_model_facts():
    cfg = k3.KIMI_K3
    assert (cfg.hidden_size, cfg.num_layers, cfg.attn_res_block_size) == (7168, 93, 12)
    assert cfg.num_attn_res_blocks == 8
    assert cfg.o_proj_local_features(8) == 1536 and cfg.o_proj_local_features(16) == 768
    assert cfg.rms_norm_eps == 1e-5 and cfg.mailbox_capacity == 64


@pytest.mark.parametrize("i", range(93))
def test_layer_plan(i):
    write, write_idx, prev_valid, mla = _hand_table()[i]
    plan = k3.KIMI_K3.layer(i)
    assert (plan.is_block_write_layer, plan.block_write_idx, plan.prev_valid_blocks,
            plan.is_mla) == (write, write_idx, prev_valid, mla)
    if i in SPOT_PREV_VALID:
        assert plan.prev_valid_blocks == SPOT_PREV_VALID[i]
    pre, post = plan.pre_attention, plan.post_attention
    assert (pre.res_norm, pre.res_proj, pre.out_norm) == (
        "self_attention_res_norm", "self_attention_res_proj", "input_layernorm")
    assert (pre.num_blocks, pre.has_delta, pre.write_idx) == (prev_valid, i > 0, write_idx)
    assert (post.res_norm, post.res_proj, post.out_norm) == (
        "mlp_res_norm", "mlp_res_proj", "post_attention_layernorm")
    assert (post.num_blocks, post.has_delta, post.write_idx) == (
        prev_valid + write, not write, -1)


def test_final_call_site():
    final = k3.KIMI_K3.final()
    assert (final.res_norm, final.res_proj, final.out_norm) == (
        "output_attn_res_norm", "output_attn_res_proj", "norm")
    assert (final.num_blocks, final.has_delta, final.write_idx) == (8, True, -1)
    assert k3.KIMI_K3.final(13).num_blocks == 2 and k3.KIMI_K3.final(12).num_blocks == 1


def test_plan_is_consistent_across_layers():
    """A block written at a pre-attention site is the next block that later sites mix."""
    for plan in k3.KIMI_K3.layers():
        if plan.is_block_write_layer:
            assert plan.block_write_idx == plan.pre_attention.num_blocks
            assert plan.post_attention.num_blocks == plan.block_write_idx + 1
    assert len(k3.KIMI_K3.layers()) == 93 and math.ceil(93 / 12) == 8


def test_post_attention_mixes_the_blocks_of_the_next_site():
    """Statistics ahead rest on this: layer i's post-attention mixes exactly the saved blocks
    that the next call site mixes (layer i + 1's pre-attention, or the final call)."""
    for n in range(1, 94):
        for i in range(n):
            following = (k3.KIMI_K3.layer(i + 1).pre_attention if i + 1 < n
                         else k3.KIMI_K3.final(n))
            assert k3.KIMI_K3.layer(i).post_attention.num_blocks == following.num_blocks, (n, i)


@pytest.mark.parametrize("index", [-1, 93])
def test_layer_out_of_range(index):
    with pytest.raises(ValueError, match=rf"layer index={index} must be in \[0, 92\]"):
        k3.KIMI_K3.layer(index)


@pytest.mark.parametrize("call,pattern", [
    (lambda: k3.KIMI_K3.layer(2.5), r"layer index=2.5 must be an integer"),
    (lambda: k3.KIMI_K3.layer(True), r"layer index=True must be an integer"),
    (lambda: k3.KIMI_K3.layer("3"), r"layer index='3' must be an integer"),
    (lambda: k3.KIMI_K3.final(2.5), r"num_layers=2.5 must be an integer"),
    (lambda: k3.KIMI_K3.final(0), r"num_layers=0 must be in \[1, 93\]"),
    (lambda: k3.KIMI_K3.final(94), r"num_layers=94 must be in \[1, 93\]"),
    (lambda: k3.KIMI_K3.o_proj_local_features(5), r"tp=5 must divide o_proj_in_features=12288"),
    (lambda: k3.KIMI_K3.o_proj_local_features(0), r"tp=0 must be >= 1"),
    (lambda: k3.KIMI_K3.o_proj_local_features(2.0), r"tp=2.0 must be an integer"),
    (lambda: k3.KimiK3Config(attn_res_block_size=0), r"attn_res_block_size=0 must be >= 1"),
    (lambda: k3.KimiK3Config(num_layers=2.5), r"num_layers=2.5 must be an integer"),
    (lambda: k3.KimiK3Config(hidden_size=True), r"hidden_size=True must be an integer"),
    (lambda: k3.KimiK3Config(rms_norm_eps=0.0), r"rms_norm_eps=0.0 must be a finite number > 0"),
    (lambda: k3.KimiK3Config(rms_norm_eps=float("nan")), r"rms_norm_eps=nan must be a finite"),
    (lambda: k3.KimiK3Config(rms_norm_eps=float("inf")), r"rms_norm_eps=inf must be a finite"),
    (lambda: k3.KimiK3Config(mailbox_capacity=-1), r"mailbox_capacity=-1 must be >= 1"),
], ids=["layer float", "layer bool", "layer str", "final float", "final 0", "final 94",
        "tp 5", "tp 0", "tp float", "block size 0", "layers float", "hidden bool", "eps 0",
        "eps nan", "eps inf", "capacity -1"])
def test_bad_config_plan_and_tp(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_kernel_geometry_tiles_the_hidden_size():
    """An AttnRes row is CLUSTER CTAs of whole warps, a vector per thread (VECTOR elements in a
    tail, STANDALONE_VECTOR in the standalone kernels); the flat Lamport kernels and the
    producer's rows and B tiles divide what they cover."""
    from jax_kimik3.kernels import geometry as g

    h = k3.KIMI_K3.hidden_size
    for vector in (g.VECTOR, g.STANDALONE_VECTOR):
        threads = g.cta_threads(vector)
        assert g.CLUSTER * threads * vector == h and threads % g.WARP == 0
    assert g.FLAT_THREADS % g.WARP == 0 and h % g.VECTOR == 0
    assert h % g.ROWS == 0 and k3.KIMI_K3.mailbox_capacity % g.TOKENS == 0
