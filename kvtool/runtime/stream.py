"""One (sequence, KV head) stream of an evicting cache: only the kept tokens, at its own length.

Layout of one stream holding n kept tokens (oldest first), H = 1 head, D = head_dim:

    head:  first kept tokens up to ``cache.sink_tokens``, float          (n_head, D)
    body:  N blocks of ``block_size`` tokens encoded by the quantizers    {name: (1, 1, N, ...)}
    tail:  the newest kept tokens, float (KIVI residual)                  (n_tail, D)
    meta:  positions int32 (n,), accumulated attention float32 (n,),
           FastGen token classes uint8 (n,) where the policy needs them

When nothing is quantized (keys and values ``none``) every token lives in the
tail and can be freed one by one. With a quantized body, tail tokens are freed
one by one and body blocks whole (their codes share per-block scales); prefill
selection happens before anything is encoded, so it is token-exact. Every edit
builds new tensors (``cat``/``index_select``), never writes in place, so streams
duplicated for beam search may share storage safely.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

SPECIAL, PUNCT = 1, 2  # bits of the FastGen token-class byte


@dataclass
class StreamCodec:
    """What a stream needs to encode/decode: the layer's quantizers and layout settings."""

    key_quantizer: object
    value_quantizer: object
    quantized: bool
    head_tokens: int
    recent_tokens: int
    block: int
    store_dtype: torch.dtype
    compute_dtype: torch.dtype
    to_stored_keys: Callable  # (keys (n, D), positions (n,)) -> keys in the body's domain
    from_stored_keys: Callable  # inverse


@dataclass
class TokenStream:
    head_k: torch.Tensor  # (n_head, D)
    head_v: torch.Tensor
    tail_k: torch.Tensor  # (n_tail, D)
    tail_v: torch.Tensor
    positions: torch.Tensor  # (n,) int32
    attention: torch.Tensor | None  # (n,) float32, when the policy scores by attention
    classes: torch.Tensor | None  # (n,) uint8, when the policy needs token classes
    body_k: dict | None = None  # {name: (1, 1, N, ...)}
    body_v: dict | None = None

    @classmethod
    def empty(cls, d: int, dtype: torch.dtype, device, scores: bool, classes: bool) -> "TokenStream":
        z = torch.empty(0, d, dtype=dtype, device=device)
        meta = torch.empty(0, device=device)
        return cls(
            z, z, z, z, meta.to(torch.int32),
            meta.float() if scores else None, meta.to(torch.uint8) if classes else None,
        )

    def copy(self) -> "TokenStream":
        return replace(self)

    # --- sizes ------------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.positions.shape[0]

    def body_blocks(self) -> int:
        return 0 if self.body_k is None else next(iter(self.body_k.values())).shape[2]

    def units(self, block: int) -> torch.Tensor:
        """(n,) unit id per token: each float token its own unit, each body block one unit."""
        n_head, n_body, n_tail = self.head_k.shape[0], self.body_blocks() * block, self.tail_k.shape[0]
        head = torch.arange(n_head)
        body = n_head + torch.arange(n_body) // block
        tail = n_head + self.body_blocks() + torch.arange(n_tail)
        return torch.cat([head, body, tail])

    def tensors(self) -> list[torch.Tensor]:
        out = [self.head_k, self.head_v, self.tail_k, self.tail_v, self.positions]
        out += [t for t in (self.attention, self.classes) if t is not None]
        for body in (self.body_k, self.body_v):
            out += list((body or {}).values())
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # --- read ---------------------------------------------------------------------------------------
    def materialize(self, codec: StreamCodec) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K/V (n, D) of every kept token in order (the torch reference path)."""
        if self.body_k is None and self.head_k.shape[0] == 0:  # float-only stream: nothing to decode or join
            return self.tail_k.to(codec.compute_dtype), self.tail_v.to(codec.compute_dtype)
        parts_k, parts_v = [self.head_k], [self.head_v]
        if self.body_k is not None:
            d = self.head_k.shape[-1]
            body_k = codec.key_quantizer.decode(self.body_k).reshape(-1, d)  # (N*S, D)
            start = self.head_k.shape[0]
            parts_k.append(codec.from_stored_keys(body_k, self.positions[start : start + body_k.shape[0]]))
            parts_v.append(codec.value_quantizer.decode(self.body_v).reshape(-1, d))
        parts_k.append(self.tail_k)
        parts_v.append(self.tail_v)
        k = torch.cat([p.to(codec.compute_dtype) for p in parts_k])
        v = torch.cat([p.to(codec.compute_dtype) for p in parts_v])
        return k, v

    # --- write --------------------------------------------------------------------------------------
    def append(self, k, v, positions, attention, classes, codec: StreamCodec) -> None:
        """Add new tokens (t, D) with their metadata, then encode full blocks beyond the recent window."""
        filling_head = codec.quantized and self.tail_k.shape[0] == 0 and self.body_k is None  # head = the oldest tokens
        n_head = min(max(codec.head_tokens - self.head_k.shape[0], 0), k.shape[0]) if filling_head else 0
        k, v = k.to(codec.store_dtype), v.to(codec.store_dtype)
        if n_head:
            self.head_k = torch.cat([self.head_k, k[:n_head]])
            self.head_v = torch.cat([self.head_v, v[:n_head]])
        self.tail_k = torch.cat([self.tail_k, k[n_head:]])
        self.tail_v = torch.cat([self.tail_v, v[n_head:]])
        self.positions = torch.cat([self.positions, positions.to(torch.int32)])
        if self.attention is not None:
            self.attention = torch.cat([self.attention, attention.float()])
        if self.classes is not None:
            self.classes = torch.cat([self.classes, classes.to(torch.uint8)])
        if codec.quantized:
            self.flush(codec)

    def add_attention(self, received: torch.Tensor) -> None:
        """Accumulate attention (n,) received by the kept tokens in the latest forward."""
        if self.attention is not None:
            self.attention = self.attention + received.float()

    def flush(self, codec: StreamCodec) -> None:
        """Encode the oldest full blocks of the tail beyond ``recent_tokens`` into the body."""
        n_blocks = max(0, (self.tail_k.shape[0] - codec.recent_tokens) // codec.block)
        if n_blocks == 0:
            return
        cut, d = n_blocks * codec.block, self.tail_k.shape[-1]
        first = self.head_k.shape[0] + self.body_blocks() * codec.block
        keys = codec.to_stored_keys(self.tail_k[:cut], self.positions[first : first + cut])
        k_blocks = keys.reshape(1, 1, n_blocks, codec.block, d)  # (1, 1, N, S, D)
        v_blocks = self.tail_v[:cut].reshape(1, 1, n_blocks, codec.block, d)
        self.body_k = _cat_blocks(self.body_k, codec.key_quantizer.encode(k_blocks))
        self.body_v = _cat_blocks(self.body_v, codec.value_quantizer.encode(v_blocks))
        self.tail_k, self.tail_v = self.tail_k[cut:].clone(), self.tail_v[cut:].clone()

    def keep(self, mask: torch.Tensor, block: int) -> None:
        """Free every token whose ``mask`` (n,) is False; body blocks go whole (mask must be uniform per block)."""
        if bool(mask.all()):
            return
        n_head, n_body = self.head_k.shape[0], self.body_blocks() * block
        index = torch.nonzero(mask).flatten()  # kept token slots, in order
        head_idx = index[index < n_head]
        tail_idx = index[index >= n_head + n_body] - (n_head + n_body)
        self.head_k, self.head_v = self.head_k.index_select(0, head_idx), self.head_v.index_select(0, head_idx)
        self.tail_k, self.tail_v = self.tail_k.index_select(0, tail_idx), self.tail_v.index_select(0, tail_idx)
        if n_body:
            blocks = mask[n_head : n_head + n_body].reshape(-1, block)
            if not bool((blocks == blocks[:, :1]).all()):
                raise ValueError("a quantized block can only be kept or freed whole")
            keep_blocks = torch.nonzero(blocks[:, 0]).flatten()
            if keep_blocks.numel() == 0:
                self.body_k = self.body_v = None
            else:
                self.body_k = {name: t.index_select(2, keep_blocks) for name, t in self.body_k.items()}
                self.body_v = {name: t.index_select(2, keep_blocks) for name, t in self.body_v.items()}
        self.positions = self.positions.index_select(0, index)
        if self.attention is not None:
            self.attention = self.attention.index_select(0, index)
        if self.classes is not None:
            self.classes = self.classes.index_select(0, index)


def _cat_blocks(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {name: torch.cat([old[name], new[name]], dim=2) for name in new}
