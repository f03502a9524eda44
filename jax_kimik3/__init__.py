"""Kimi K3's decode-step attention tail for JAX: o_proj, its TP all-reduce and Block AttnRes."""

from jax_kimik3.api import (all_reduce, all_reduce_virtual, attn_res, attn_res_statistics,
                            oproj_attn_res, oproj_attn_res_virtual)
from jax_kimik3.config import KIMI_K3, CallSite, KimiK3Config, LayerPlan
from jax_kimik3.layer import AttentionTail, AttnResWeights, final_attn_res
from jax_kimik3.layout import DEFAULT_TIMEOUT_MS, MailboxLayout, MailboxSpec
from jax_kimik3.mailbox import Mailbox
from jax_kimik3.mesh_mailbox import MeshMailbox
from jax_kimik3.statistics import AttnResStatistics

__all__ = [
    "AttentionTail",
    "AttnResStatistics",
    "AttnResWeights",
    "DEFAULT_TIMEOUT_MS",
    "KIMI_K3",
    "CallSite",
    "KimiK3Config",
    "LayerPlan",
    "Mailbox",
    "MailboxLayout",
    "MailboxSpec",
    "MeshMailbox",
    "all_reduce",
    "all_reduce_virtual",
    "attn_res",
    "attn_res_statistics",
    "final_attn_res",
    "oproj_attn_res",
    "oproj_attn_res_virtual",
]
