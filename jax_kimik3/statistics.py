"""The softmax statistics of a row's saved blocks as one value: the arrays, the number of
saved blocks they cover and the logits' RMSNorm epsilon they were taken with, so a call that
mixes another number or normalises with another epsilon refuses them."""

from __future__ import annotations

from typing import Any

import jax

from jax_kimik3.config import KIMI_K3


@jax.tree_util.register_pytree_node_class
class AttnResStatistics:
    """mixture [B, H] f32 = Σ e^{z_i−m} b_i and scal [B, 2] f32 = (m, s) over blocks[:, :K],
    K = `num_blocks`, z_i's RMSNorm taken with `eps` (both static: pytree metadata). Unpacks
    as (mixture, scal)."""

    __slots__ = ("mixture", "scal", "num_blocks", "eps")

    def __init__(self, mixture: Any, scal: Any, num_blocks: int,
                 eps: float = KIMI_K3.rms_norm_eps):
        self.mixture, self.scal, self.num_blocks, self.eps = mixture, scal, num_blocks, eps

    def __iter__(self):
        return iter((self.mixture, self.scal))

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return (self.mixture, self.scal)[index]

    def __repr__(self):
        shapes = [getattr(a, "shape", "?") for a in self]
        return (f"AttnResStatistics(mixture{shapes[0]}, scal{shapes[1]}, "
                f"num_blocks={self.num_blocks!r}, eps={self.eps!r})")

    def tree_flatten(self):
        return (self.mixture, self.scal), (self.num_blocks, self.eps)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, *static)


# Exported steps (jax_kimik3.export) keep their argument and result pytrees: name this one.
jax.export.register_pytree_node_serialization(
    AttnResStatistics, serialized_name="jax_kimik3.AttnResStatistics",
    serialize_auxdata=lambda static: f"{static[0]},{float(static[1])!r}".encode(),
    deserialize_auxdata=lambda data: (int(data.split(b",")[0]), float(data.split(b",")[1])))
