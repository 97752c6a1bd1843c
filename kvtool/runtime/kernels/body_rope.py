"""RoPE in the decode kernel for keys stored before RoPE (KVQuant's ``keys.pre_rope``).

Body keys are encoded before RoPE; the torch path rotates the decoded keys at each token's
true position (`KvtoolLayer._chunks`: `CacheContext.body_positions`, then `RopeTable.rotate`).
The kernel does the same in registers: it reads each body token's position in place, loads the
key block a second time at the partner channels (``c +- R/2``, or ``c ^ 1`` interleaved) and
returns ``k * cos + rotate(k) * sin`` with ``cos, sin = cos/sin(pos * inv_freq) * scaling``.

Where the positions come from (`BodyRope.source`, what the store keeps):

* ``"slots"`` (1): a store that evicts keeps ``pos`` (cap, BS) int32 per body slot: read at the block id;
* ``"sequence"`` (2): a cache that evicts nothing records each sequence's positions
  (`SequencePositions.table` (B, W) int32); body token j of stream s is the sequence's token
  ``n_sink[s] + j``, the sequence is ``s // streams_per_sequence``;
* ``"tokens"`` (3): nothing recorded: the token index is the position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SOURCES = {"slots": 1, "sequence": 2, "tokens": 3}


@dataclass(frozen=True, eq=False)
class BodyRope:
    """What the kernel needs to rotate pre-RoPE body keys: RoPE of the layer and where positions live."""

    inv_freq: torch.Tensor  # (R/2,) float32 on the device
    scaling: float  # attention_scaling (yarn, longrope; 1.0 for plain RoPE)
    interleaved: bool  # pairs (2i, 2i+1) turn instead of halves (i, i + R/2)
    source: str  # one of SOURCES
    positions: torch.Tensor | None = None  # slots: (cap, BS) int32; sequence: (B, W) int32
    n_sink: torch.Tensor | None = None  # (S,) int64 sinks before a stream's body (sequence, tokens)
    streams_per_sequence: int = 1

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()


@triton.jit
def body_positions(pos_ptr, pos_stride, nsink_ptr, s, row, col, tb, block, BS: tl.constexpr, SOURCE: tl.constexpr):
    """Positions (BS,) float32 of body column ``col`` (block id ``block``) of stream ``s`` (sequence ``row``)."""
    if SOURCE == 1:
        pos = tl.load(pos_ptr + block * BS + tb)
    else:
        token = tl.load(nsink_ptr + s) + col * BS + tb
        if SOURCE == 2:
            pos = tl.load(pos_ptr + row * pos_stride + token)
        else:
            pos = token
    return pos.to(tl.float32)


@triton.jit
def partner_channels(c, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(partner channel, sign) of every channel: rotate(k)[c] = sign * k[partner]; (c, 0) past the rotary dims."""
    HALF: tl.constexpr = ROTARY // 2
    if INTERLEAVED:
        partner = tl.where(c < ROTARY, c ^ 1, c)
        sign = tl.where(c % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(c < HALF, c + HALF, tl.where(c < ROTARY, c - HALF, c))
        sign = tl.where(c < HALF, -1.0, 1.0)
    return partner, tl.where(c < ROTARY, sign, 0.0)


@triton.jit
def rotate_keys(k, k_partner, sign, pos, c, freq_ptr, scaling, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """RoPE of pre-RoPE keys k (BS, BD) at positions pos (BS,): k * cos + sign * k[partner] * sin."""
    HALF: tl.constexpr = ROTARY // 2
    index = tl.where(c < ROTARY, (c // 2) if INTERLEAVED else (c % HALF), 0)
    freq = tl.load(freq_ptr + index)  # (BD,)
    angle = pos[:, None] * freq[None, :]  # (BS, BD), as torch: float32 position x frequency
    cos = tl.cos(angle) * scaling
    sin = tl.sin(angle) * scaling
    rotated = k * cos + (sign[None, :] * k_partner) * sin
    return tl.where((c < ROTARY)[None, :], rotated, k)

