"""The softmax statistics of a row's saved blocks as one value: the arrays and the number of
saved blocks they cover, so a call that mixes another number refuses them."""

from __future__ import annotations

from typing import Any

import jax


@jax.tree_util.register_pytree_node_class
class AttnResStatistics:
    """mixture [B, H] f32 = Σ e^{z_i−m} b_i and scal [B, 2] f32 = (m, s) over blocks[:, :K],
    K = `num_blocks` (static: pytree metadata). Unpacks as (mixture, scal)."""

    __slots__ = ("mixture", "scal", "num_blocks")

    def __init__(self, mixture: Any, scal: Any, num_blocks: int):
        self.mixture, self.scal, self.num_blocks = mixture, scal, num_blocks

    def __iter__(self):
        return iter((self.mixture, self.scal))

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return (self.mixture, self.scal)[index]

    def __repr__(self):
        shapes = [getattr(a, "shape", "?") for a in self]
        return f"AttnResStatistics(mixture{shapes[0]}, scal{shapes[1]}, num_blocks={self.num_blocks})"

    def tree_flatten(self):
        return (self.mixture, self.scal), self.num_blocks

    @classmethod
    def tree_unflatten(cls, num_blocks, children):
        return cls(*children, num_blocks)


# Exported steps (jax_kimik3.export) keep their argument and result pytrees: name this one.
jax.export.register_pytree_node_serialization(
    AttnResStatistics, serialized_name="jax_kimik3.AttnResStatistics",
    serialize_auxdata=lambda num_blocks: str(num_blocks).encode(),
    deserialize_auxdata=lambda data: int(data.decode()))
