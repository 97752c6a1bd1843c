"""FastGen's decode-step eviction compiled with Numba: the torch path's `FastGen.keep` over the layer's whole
`StreamView`, then `LayerStore.fill_holes` (a float store) or `LayerStore.keep` (a quantized one), its reference, in
one pass over each stream's slots.

FastGen re-chooses its kept set after every generated token (its policies are rules, not budgets), so on the torch
path every decode step of every layer gathers the stream's positions, scores and token classes into dense views,
sorts them twice (by age, then by attention) and moves the survivors with several more sorts: about 2.5 ms per layer
at 2K tokens on SmolLM2-135M, twice `DynamicCache`'s whole step. Here the CPU decode kernel has already attended,
written the step's token (its keys, values, position and score) into the stream's next float slot and added the
attention to every held score; what is left is, per stream:

* its policy (``special`` < ``punctuation`` < ``local`` < ``frequent`` < ``full``, each keeping a superset of the one
  before) over every held token: special tokens and sinks, punctuation, positions within the last
  ceil(local_ratio x n) of the sequence's n tokens, the ceil(frequent_ratio x n) held tokens with the most attention
  (the older first among ties, found by a partial sort: `np.partition`), or every token;
* a quantized store's body blocks are kept or freed whole: kept when at least half of their tokens are
  (`whole_units`);
* a sliding-window layer's rule: only what the newest query can still see (p > latest - W; a body block while any of
  its tokens is inside);
* then the store compacted as the torch path does: a float store's kept slots past the new length move, in order,
  into the freed slots below it (`fill_holes`); a quantized store's float slots and body blocks keep their order
  (`LayerStore.keep`), its sinks counted among the kept float slots, freed body blocks returned to the caller.

One call per layer and decode step. The kept sets equal the torch path's for the same scores (tests compare whole
decodes against the torch backend, and each call against `kept_sets`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

SPECIAL_BIT, PUNCT_BIT = 1, 2  # the token-class byte (`kvtool.runtime.layer.SPECIAL`, `PUNCT`)
PUNCTUATION, LOCAL, FREQUENT, FULL = 1, 2, 3, 4  # `kvtool.methods.evict.fastgen`'s policy indices (0: special)


@njit(cache=True)
def keep_count(ratio: float, n: int) -> int:
    """ceil(ratio x n), robust to float rounding (`fastgen.keep_count`)."""
    count = np.ceil(ratio * np.float64(n) - 1e-9)
    return max(int(count), 0)


@njit(cache=True)
def _slot_ids(table, s, count, tokens, ids, at):
    """ids[at : at + count] = flat pool slot ids of stream ``s``'s region slots 0..count-1 (``tokens`` per block)."""
    i = 0
    for c in range((count + tokens - 1) // tokens):
        base = np.int64(table[s, c]) * tokens
        for o in range(min(tokens, count - i)):
            ids[at + i] = base + o
            i += 1


@njit(cache=True)
def _gather(ids, at, n, pos, score, cls, p, sc, c):
    for i in range(at, at + n):
        p[i] = pos[ids[i]]
        sc[i] = score[ids[i]]
        c[i] = cls[ids[i]]


@njit(cache=True)
def _keep_tokens(p, sc, c, n, policy, length, local_ratio, frequent_ratio, keep, values, tied):
    """keep[:n] of one stream's held tokens (positions p, scores sc, classes c) under FastGen ``policy``
    (`kept_sets`); values / tied: scratch of at least ``n``. Returns the newest position held."""
    latest = np.int64(-1)
    for i in range(n):
        latest = max(latest, p[i])
    if policy >= FULL:
        keep[:n] = True
        return latest
    local = keep_count(local_ratio, length) if policy >= LOCAL else 0
    first_local = latest - local  # positions above it are in the local window
    for i in range(n):
        keep[i] = ((c[i] & SPECIAL_BIT) != 0 or (policy >= PUNCTUATION and (c[i] & PUNCT_BIT) != 0)
                   or (policy >= LOCAL and p[i] > first_local))
    if policy == FREQUENT:
        top = min(keep_count(frequent_ratio, length), n)
        if top >= n:
            keep[:n] = True
        elif top > 0:
            values[:n] = sc[:n]
            threshold = np.partition(values[:n], n - top)[n - top]  # the top-th largest
            above = 0
            for i in range(n):
                if sc[i] > threshold:
                    keep[i] = True
                    above += 1
            ties = top - above  # of the tokens scored exactly `threshold`, the oldest
            if ties > 0:
                n_tied = 0
                for i in range(n):
                    if sc[i] == threshold:
                        tied[n_tied] = i
                        n_tied += 1
                age = np.empty(n_tied, np.int64)
                for m in range(n_tied):
                    age[m] = p[tied[m]]
                order = np.argsort(age, kind="mergesort")
                for m in range(ties):
                    keep[tied[order[m]]] = True
    return latest


@njit(cache=True)
def _scratch(float_len, body_len, bs):
    widest = 1
    for s in range(float_len.shape[0]):
        widest = max(widest, float_len[s] + body_len[s] * bs)
    return (np.empty(widest, np.bool_), np.empty(widest, np.int64), np.empty(widest, np.int64),
            np.empty(widest, np.float32), np.empty(widest, np.uint8), np.empty(widest, np.float32),
            np.empty(widest, np.int64))


@njit(cache=True)
def fastgen_decode_evict(table, float_len, fbs, pos, score, cls, slot_bytes, new_cls, groups, policies, lengths,
                         local_ratio, frequent_ratio, window):
    """Evict from a float store after a decode step the CPU kernel wrote (each stream's newest token at slot
    float_len[s] - 1); the kept slots end where `fill_holes` puts them.

    table (S, F) int32 float block ids; float_len (S,) int64 tokens held, the new one included; pos / score / cls
    (slots,) int32 / float32 / uint8 flat float-pool metadata; slot_bytes: every per-slot pool tensor as (slots, bytes)
    uint8 (keys, values, their scales, pos, score, cls), moved whole; new_cls (B, 1) uint8 the new tokens' classes
    per sequence (written here), whose ``groups`` streams are consecutive; policies (S,) int64; lengths (B,) int64
    tokens each sequence has seen; window: a sliding-window layer's W (0: none). Returns the new float_len (S,).
    """
    out = float_len.copy()
    keep, ids, p, sc, c, values, tied = _scratch(float_len, np.zeros_like(float_len), 1)
    for s in range(float_len.shape[0]):
        held = float_len[s]
        if held == 0:
            continue
        cls[np.int64(table[s, (held - 1) // fbs]) * fbs + (held - 1) % fbs] = new_cls[s // groups, 0]
        if policies[s] >= FULL and window == 0:
            continue  # keeps every token
        _slot_ids(table, s, held, fbs, ids, 0)
        _gather(ids, 0, held, pos, score, cls, p, sc, c)
        latest = _keep_tokens(p, sc, c, held, policies[s], lengths[s // groups], local_ratio, frequent_ratio, keep,
                              values, tied)
        if window > 0:
            for i in range(held):
                keep[i] = keep[i] and p[i] > latest - window
        kept = 0
        for i in range(held):
            kept += keep[i]
        target = 0  # the freed slots below `kept` take the kept slots past it, both in order (`fill_holes`)
        for i in range(kept, held):
            if not keep[i]:
                continue
            while keep[target]:
                target += 1
            for tensor in slot_bytes:
                tensor[ids[target], :] = tensor[ids[i], :]
            target += 1
        out[s] = kept
    return out


@njit(cache=True)
def fastgen_decode_evict_blocks(table, float_len, n_sink, sink_tokens, fbs, pos, score, cls, slot_bytes, body_table,
                                body_len, bs, body_pos, body_score, body_cls, new_cls, groups, policies, lengths,
                                local_ratio, frequent_ratio, window, new_lengths, freed):
    """Evict from a quantized store after a decode step the CPU kernel wrote: float slots one by one and body blocks
    whole, both regions keeping their order (`LayerStore.keep`).

    As `fastgen_decode_evict`, plus: n_sink (S,) int64 sinks among the float slots (the store makes ``sink_tokens``:
    a kept new token that finds its stream holding sinks only becomes one, as `LayerStore.append` makes it after the
    torch path's `keep`); body_table (S, Bn) int32 (its kept columns moved first in place, the rest zeroed), body_len
    (S,) int64 blocks of ``bs`` tokens; body_pos / body_score / body_cls their flat metadata. Writes new_lengths
    (3, S) int64: float_len, n_sink, body_len; freed: body block ids released (at least sum(body_len) long). Returns
    how many ids it wrote to ``freed``. The blocks then due are the caller's to encode (`LayerStore.flush_held`).
    """
    keep, ids, p, sc, c, values, tied = _scratch(float_len, body_len, bs)
    n_freed = 0
    for s in range(float_len.shape[0]):
        held, blocks = float_len[s], body_len[s]
        new_lengths[0, s], new_lengths[1, s], new_lengths[2, s] = held, n_sink[s], blocks
        if held == 0:
            continue
        cls[np.int64(table[s, (held - 1) // fbs]) * fbs + (held - 1) % fbs] = new_cls[s // groups, 0]
        if policies[s] >= FULL and window == 0:  # keeps every token; one after sinks only becomes a sink too
            if held - 1 == n_sink[s] and blocks == 0 and n_sink[s] < sink_tokens:
                new_lengths[1, s] += 1
            continue
        body = blocks * bs  # body tokens first, then the float slots
        _slot_ids(body_table, s, body, bs, ids, 0)
        _gather(ids, 0, body, body_pos, body_score, body_cls, p, sc, c)
        _slot_ids(table, s, held, fbs, ids, body)
        _gather(ids, body, held, pos, score, cls, p, sc, c)
        n = body + held
        latest = _keep_tokens(p, sc, c, n, policies[s], lengths[s // groups], local_ratio, frequent_ratio, keep,
                              values, tied)
        kept_blocks = 0
        for b in range(blocks):  # a block stays when at least half of its tokens do (and, windowed, one is visible)
            kept_tokens, visible = 0, False
            for i in range(b * bs, (b + 1) * bs):
                kept_tokens += keep[i]
                visible = visible or p[i] > latest - window
            block = body_table[s, b]
            if kept_tokens * 2 >= bs and (window == 0 or visible):
                body_table[s, kept_blocks] = block
                kept_blocks += 1
            else:
                freed[n_freed] = block
                n_freed += 1
        for b in range(kept_blocks, blocks):
            body_table[s, b] = 0
        kept, sinks = 0, 0
        for i in range(held):  # the float slots in order
            if not keep[body + i] or (window > 0 and p[body + i] <= latest - window):
                continue
            if kept != i:
                for tensor in slot_bytes:
                    tensor[ids[body + kept], :] = tensor[ids[body + i], :]
            if i < n_sink[s]:
                sinks += 1
            elif i == held - 1 and kept == sinks and kept_blocks == 0 and sinks < sink_tokens:
                sinks += 1  # the new token after sinks only: the torch path appends it to an "empty" stream, as one
            kept += 1
        new_lengths[0, s], new_lengths[1, s], new_lengths[2, s] = kept, sinks, kept_blocks
    return n_freed
