"""Block formats at the store's granularity: a per-head format applied to blocks of g heads.

A layer's streams hold g KV heads each (g > 1 only when a Palu latent spans a group of
heads). The other part's format (say uniform values beside grouped Palu keys) encodes one
head per block; `lift_format` makes it store g / h sub-blocks per block, side by side:

    block tensor (factor, *inner shape)   with factor = g / inner.heads_per_block
"""

from __future__ import annotations

import torch

from kvtool.methods.base import BlockQuantizer


def lift_format(fmt, heads: int):
    """``fmt`` itself when its blocks already span ``heads`` heads, else a `LiftedFormat`."""
    return fmt if fmt.heads_per_block == heads else LiftedFormat(fmt, heads)


class LiftedFormat:
    """``inner`` (blocks of h heads) applied to blocks of g = factor x h heads."""

    def __init__(self, inner, heads: int) -> None:
        if heads % inner.heads_per_block:
            raise ValueError(f"{heads} heads per block is not a multiple of {inner.heads_per_block}")
        self.inner, self.heads_per_block = inner, heads
        self.factor = heads // inner.heads_per_block
        self.block_size, self.head_dim, self.dtype = inner.block_size, inner.head_dim, inner.dtype

    def block_spec(self):
        return {name: ((self.factor, *shape), dtype) for name, (shape, dtype) in self.inner.block_spec().items()}

    def block_nbytes(self):
        return self.inner.block_nbytes()

    def bits_per_element(self) -> float:
        return self.inner.bits_per_element()

    def _inner_groups(self, group: torch.Tensor) -> torch.Tensor:
        return (group[:, None] * self.factor + torch.arange(self.factor, device=group.device)).flatten()

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        n, g, s, d = x.shape
        inner = self.inner.encode_blocks(x.reshape(n * self.factor, g // self.factor, s, d), self._inner_groups(group))
        return {name: t.reshape(n, self.factor, *t.shape[1:]) for name, t in inner.items()}

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        n = next(iter(blocks.values())).shape[0]
        flat = {name: t.reshape(n * self.factor, *t.shape[2:]) for name, t in blocks.items()}
        x = self.inner.decode_blocks(flat, self._inner_groups(group))  # (N*factor, h, S, D)
        return x.reshape(n, self.heads_per_block, *x.shape[2:])

    def _split(self, blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{(Sc, nb, factor, ...)} -> {(Sc * factor, nb, ...)}."""
        out = {}
        for name, t in blocks.items():
            sc, nb = t.shape[:2]
            out[name] = t.transpose(1, 2).reshape(sc * self.factor, nb, *t.shape[3:])
        return out

    def chunk_scores(self, query, blocks, group, keys_to_attention=None):
        sc, g, r, d = query.shape
        fn = None
        if keys_to_attention is not None:
            def fn(keys):  # (Sc*factor, h, T, D) -> the same, rotated per stream
                return keys_to_attention(keys.reshape(sc, g, *keys.shape[2:])).reshape(keys.shape)
        q = query.reshape(sc * self.factor, g // self.factor, r, d)
        scores = self.inner.chunk_scores(q, self._split(blocks), self._inner_groups(group), fn)
        return scores.reshape(sc, g, r, -1)

    def chunk_values(self, probs, blocks, group):
        sc, g, r, t = probs.shape
        p = probs.reshape(sc * self.factor, g // self.factor, r, t)
        out = self.inner.chunk_values(p, self._split(blocks), self._inner_groups(group))
        return out.reshape(sc, g, r, -1)

    def chunk_floats(self, blocks, group):
        sc = next(iter(blocks.values())).shape[0]
        x = self.inner.chunk_floats(self._split(blocks), self._inner_groups(group))  # (Sc*factor, h, T, D)
        return x.reshape(sc, self.heads_per_block, *x.shape[2:])

    def _decode_chunk(self, blocks, group):
        """{name: (Sc, nb, factor, ...)} -> (Sc, g, nb * S, D) float32 through `decode_blocks` (`KvtoolLayer.decoded`)."""
        return BlockQuantizer._decode_chunk(self, blocks, group)  # the base's plumbing over this format's decode_blocks
