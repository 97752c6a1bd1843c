"""Reference attention over ragged streams, returning what eviction policies score with.

Each (sequence, KV head) stream holds its own number of kept tokens. For one
attention call the cache lays them out as a temporary, left-aligned and padded to
the longest stream, followed by the tokens of the current forward:

    keys (B, H_kv, N + t, D) = [ kept tokens of the stream (n_bh valid of N) | t new tokens ]

``old_valid`` (B, H_kv, N) marks the real kept slots; ``new_mask`` (B, t, t) is the
causal/padding mask among the new tokens (True = may attend). The temporary lives
for one call; only the compact per-stream storage persists. The query heads of a
GQA group are stacked on the row axis against their one KV head (never expanded):
q (B, H_kv, G*t, D). Rows are processed in chunks so prefill never holds a full
(G*t) x (N+t) matrix per head at once.

Returns the output (B, t, H_q, D) and, per key slot, the attention it received
summed over the group's query heads: over all rows (``received``) and over the
last ``window`` rows (``received_window``, SnapKV's observation window).
"""

from __future__ import annotations

import torch

ROW_CHUNK = 256


def ragged_attention(
    query: torch.Tensor,  # (B, H_q, t, D) after RoPE
    key: torch.Tensor,  # (B, H_kv, N + t, D)
    value: torch.Tensor,  # (B, H_kv, N + t, D)
    old_valid: torch.Tensor,  # (B, H_kv, N) bool
    new_mask: torch.Tensor,  # (B, t, t) bool
    scaling: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, t, d = query.shape
    hkv, total = key.shape[1], key.shape[2]
    n_old, group = total - t, hq // hkv
    q = query.reshape(b, hkv, group, t, d)  # (B, H_kv, G, t, D)
    out = torch.empty(b, hkv, group, t, d, dtype=query.dtype, device=query.device)
    received = torch.zeros(b, hkv, total, dtype=torch.float32, device=query.device)
    received_window = torch.zeros_like(received)
    first_window_row = max(0, t - window)
    k32, v32 = key.float(), value.float()
    for start in range(0, t, ROW_CHUNK):
        stop = min(t, start + ROW_CHUNK)
        rows = stop - start
        mask = torch.cat(
            [old_valid[:, :, None, :].expand(b, hkv, rows, n_old),  # (B, H_kv, r, N)
             new_mask[:, None, start:stop, :].expand(b, hkv, rows, t)],  # (B, H_kv, r, t)
            dim=-1,
        )  # (B, H_kv, r, N + t)
        logits = torch.einsum("bhgrd,bhkd->bhgrk", q[:, :, :, start:stop].float(), k32) * scaling  # (B, H_kv, G, r, N+t)
        logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with nothing to attend (pads) -> 0
        out[:, :, :, start:stop] = torch.einsum("bhgrk,bhkd->bhgrd", probs, v32).to(query.dtype)
        received += probs.sum(dim=(2, 3))
        if stop > first_window_row:
            lo = max(start, first_window_row) - start
            received_window += probs[:, :, :, lo:].sum(dim=(2, 3))
    return out.reshape(b, hq, t, d).transpose(1, 2), received, received_window
