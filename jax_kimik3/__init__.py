"""Kimi K3's decode-step attention tail for JAX: o_proj, its TP all-reduce and Block AttnRes."""

from jax_kimik3.api import attn_res, attn_res_statistics, oproj_attn_res
from jax_kimik3.config import KIMI_K3, CallSite, KimiK3Config, LayerPlan

__all__ = [
    "KIMI_K3",
    "CallSite",
    "KimiK3Config",
    "LayerPlan",
    "attn_res",
    "attn_res_statistics",
    "oproj_attn_res",
]
