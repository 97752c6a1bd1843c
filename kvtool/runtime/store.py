"""The paged store of one decoder layer: fixed-size blocks in pools, a block table per stream.

A *stream* is one (sequence, storage group) pair: S = batch x H_kv / g streams per layer,
stream ``s = b * (H_kv / g) + j``; g = heads per stream (1, except Palu latents that span a
group of KV heads). Every stream holds its own tokens at its own length: never padded to
the longest stream, never expanded to query heads. Layout (what the Triton kernels read):

* **float pool** (`BlockPool`): ``k``, ``v`` (cap, fbs, g, D) in the cache's float dtype,
  plus per-slot metadata where the cache needs it: ``pos`` (cap, fbs) int32 original
  positions, ``score`` (cap, fbs) float32 accumulated attention, ``feature`` (cap, fbs)
  float32 a policy's static token score, ``cls`` (cap, fbs) uint8 FastGen token classes.
  Float blocks hold ``fbs = FLOAT_BLOCK`` (16) tokens: freed tokens leave at most 15 unused
  slots per stream, whatever the body block size.
  A stream's float region holds, in token order, its sinks (the first
  ``sink_tokens`` tokens, never encoded) then its newest tokens (the KIVI recent window,
  and the last, partly filled block); for recipes that quantize nothing it holds every token.
* **body pool** (quantized recipes): the key and the value format's tensors side by side,
  ``k.<name>`` / ``v.<name>`` (cap, *shape) as `BlockQuantizer.block_spec` defines them
  (packed codes with their scales beside them, sparse outliers, latents), plus the same
  per-slot metadata; one block = ``bs`` tokens of one stream, in token order.
* **tables** per stream (entries past a stream's blocks are 0): ``float_table`` (S, F) int32 block ids and ``float_len`` (S,) tokens;
  ``body_table`` (S, Bn) int32 and ``body_len`` (S,) blocks; ``n_sink`` (S,) sinks at the
  front of the float region.

Token order of a stream: float slots [0, n_sink), body blocks in table order, float slots
[n_sink, float_len); in a cache that evicts nothing, token index = slot for sinks,
``n_sink + j * bs + o`` for body block j offset o, ``i + body_len * bs`` for float slot i >= n_sink.
Slot ``i`` of the float region is block ``float_table[i // fbs]``, offset ``i % fbs``; body
blocks hold ``bs = cache.block_size`` tokens each.

Writes are in place: appending a token writes one slot of the stream's open float block
(a new block when it is full); when the float region holds ``recent_tokens + bs``
non-sink tokens, its oldest ``bs`` are encoded into a new body block and the float
region is rewritten (O(recent) once per ``bs`` tokens). Eviction drops body blocks whole
and float tokens one by one, compacting the float region in order; freed blocks go back
to the pool. Nothing here loops in Python over streams or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvtool.runtime.pool import BlockPool

FLOAT_BLOCK = 16  # tokens per float block
META_DTYPES = {"pos": torch.int32, "score": torch.float32, "feature": torch.float32, "cls": torch.uint8}


@dataclass(frozen=True)
class StoreLayout:
    """Geometry and options of one layer's store."""

    block_size: int  # body block: tokens sharing per-block scales
    heads_per_stream: int  # g
    head_dim: int
    float_dtype: torch.dtype
    quantized: bool  # True: a body of encoded blocks exists
    sink_tokens: int  # float sinks (quantized recipes)
    recent_tokens: int  # float recent window (quantized recipes)
    meta: tuple[str, ...] = ()  # per-slot metadata kept: subset of META_DTYPES


def _grow_columns(table: torch.Tensor, needed: int) -> torch.Tensor:
    """Widen a (S, W) table to at least ``needed`` columns (doubling)."""
    if needed <= table.shape[1]:
        return table
    width = max(needed, 2 * table.shape[1], 4)
    return torch.cat([table, table.new_zeros(table.shape[0], width - table.shape[1])], dim=1)


def slot_ids(table: torch.Tensor, bs: int, start: int, stop: int) -> torch.Tensor:
    """Flat pool slot ids (S, stop - start) of region slots [start, stop) (garbage past a stream's length)."""
    j = torch.arange(start, stop, device=table.device)
    column = (j // bs).clamp(max=max(table.shape[1] - 1, 0))
    blocks = table.long()[:, column] if table.shape[1] else torch.zeros(table.shape[0], stop - start, dtype=torch.long, device=table.device)
    return blocks * bs + j % bs


class LayerStore:
    """Pools and tables of one layer (see the module docstring)."""

    def __init__(self, layout: StoreLayout, key_format, value_format, streams: int, device) -> None:
        self.layout, self.key_format, self.value_format = layout, key_format, value_format
        self.device = torch.device(device)
        fbs, g, d = FLOAT_BLOCK, layout.heads_per_stream, layout.head_dim
        self.fbs, self.bs = fbs, layout.block_size
        meta = {name: ((fbs,), META_DTYPES[name]) for name in layout.meta}
        self.float_pool = BlockPool({"k": ((fbs, g, d), layout.float_dtype), "v": ((fbs, g, d), layout.float_dtype), **meta}, device)
        self.body_pool = None
        if layout.quantized:
            spec = {f"k.{n}": s for n, s in key_format.block_spec().items()}
            spec.update({f"v.{n}": s for n, s in value_format.block_spec().items()})
            body_meta = {name: ((self.bs,), META_DTYPES[name]) for name in layout.meta}
            self.body_pool = BlockPool({**spec, **body_meta}, device)
        self._reset_tables(streams)

    def _reset_tables(self, streams: int) -> None:
        z = lambda: torch.zeros(streams, dtype=torch.int64, device=self.device)  # noqa: E731
        self.float_table = torch.zeros(streams, 0, dtype=torch.int32, device=self.device)
        self.body_table = torch.zeros(streams, 0, dtype=torch.int32, device=self.device)
        self.float_len, self.body_len, self.n_sink = z(), z(), z()

    @property
    def streams(self) -> int:
        return self.float_len.shape[0]

    # --- sizes -----------------------------------------------------------------------------------
    def tokens(self) -> torch.Tensor:
        """(S,) tokens held per stream."""
        return self.float_len + self.body_len * self.layout.block_size

    def _table_tensors(self) -> list[torch.Tensor]:
        return [self.float_table, self.body_table, self.float_len, self.body_len, self.n_sink]

    def table_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._table_tensors())

    def used_nbytes(self) -> int:
        """Bytes of blocks in use plus the tables."""
        body = self.body_pool.used_nbytes() if self.body_pool is not None else 0
        return self.float_pool.used_nbytes() + body + self.table_nbytes()

    def reserved_nbytes(self) -> int:
        """Bytes allocated: every pool row (free or not), the free maps and the tables."""
        body = self.body_pool.reserved_nbytes() if self.body_pool is not None else 0
        return self.float_pool.reserved_nbytes() + body + self.table_nbytes()

    def expected_nbytes(self) -> int:
        """Analytic bytes from the token counts: ceil(float tokens / fbs) float blocks + body blocks + tables."""
        fbs = self.fbs
        float_blocks = int(((self.float_len + fbs - 1) // fbs).sum())
        total = float_blocks * self.float_pool.block_nbytes() + self.table_nbytes()
        if self.body_pool is not None:
            total += int(self.body_len.sum()) * self.body_pool.block_nbytes()
        return total

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the store holds between forwards (for outside accounting)."""
        out = self._table_tensors() + list(self.float_pool.tensors.values()) + [self.float_pool.in_use]
        if self.body_pool is not None:
            out += list(self.body_pool.tensors.values()) + [self.body_pool.in_use]
        return out

    # --- float region ----------------------------------------------------------------------------
    def float_slots(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Flat float-pool slot ids (S, stop - start) of float slots [start, stop)."""
        stop = int(self.float_len.max()) if stop is None else stop
        return slot_ids(self.float_table, self.fbs, start, stop)

    def float_flat(self, name: str) -> torch.Tensor:
        """A float-pool tensor viewed per slot: (cap * bs, ...)."""
        t = self.float_pool.tensors[name]
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])

    def body_flat(self, name: str) -> torch.Tensor:
        t = self.body_pool.tensors[name]
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])

    def _ensure_float_blocks(self, new_len: torch.Tensor) -> None:
        """Allocate the float blocks streams need to hold ``new_len`` (S,) tokens."""
        bs = self.fbs
        have = (self.float_len + bs - 1) // bs
        need = (new_len + bs - 1) // bs
        extra = (need - have).clamp(min=0)
        total = int(extra.sum())
        if total == 0:
            return
        self.float_table = _grow_columns(self.float_table, int(need.max()))
        ids = self.float_pool.allocate(total)
        rows = torch.repeat_interleave(torch.arange(self.streams, device=self.device), extra)
        first = torch.repeat_interleave(have, extra)
        offset = torch.arange(total, device=self.device) - torch.repeat_interleave(torch.cumsum(extra, 0) - extra, extra)
        self.float_table[rows, first + offset] = ids.to(torch.int32)

    def _release_float_beyond(self, new_len: torch.Tensor) -> None:
        """Free float blocks past ``new_len`` (S,) tokens, then set the lengths."""
        bs = self.fbs
        have = (self.float_len + bs - 1) // bs
        keep = (new_len + bs - 1) // bs
        cols = torch.arange(self.float_table.shape[1], device=self.device)
        drop = (cols >= keep[:, None]) & (cols < have[:, None])
        self.float_pool.release(self.float_table[drop].long())
        self.float_table[drop] = 0  # invariant: table entries past a stream's blocks are 0
        self.float_len = new_len.clone()
        self.shrink()

    def write_float(self, start: torch.Tensor, count: torch.Tensor, data: dict[str, torch.Tensor]) -> None:
        """Write tokens into float slots [start, start + count) of each stream (blocks allocated as needed).

        data: {"k", "v": (S, W, g, D), meta name: (S, W)}; row s uses its first ``count[s]`` entries.
        Lengths become max(float_len, start + count).
        """
        width = next(iter(data.values())).shape[1]
        if width == 0:
            return
        end = start + count
        self._ensure_float_blocks(torch.maximum(self.float_len, end))
        j = torch.arange(width, device=self.device)
        valid = j < count[:, None]  # (S, W)
        slot = start[:, None] + j  # (S, W) region slot
        column = (slot // self.fbs).clamp(max=self.float_table.shape[1] - 1)
        flat = self.float_table.long().gather(1, column) * self.fbs + slot % self.fbs
        target = flat[valid]
        for name, values in data.items():
            self.float_flat(name)[target] = values[valid].to(self.float_flat(name).dtype)
        self.float_len = torch.maximum(self.float_len, end)

    def read_float(self, names, start: int, stop: int) -> dict[str, torch.Tensor]:
        """{name: (S, stop - start, ...)} gathered from float slots [start, stop) (garbage past a stream's length)."""
        ids = self.float_slots(start, stop)
        return {name: self.float_flat(name)[ids] for name in names}

    def read_float_at(self, names, start: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        """{name: (S, width, ...)} from float slots [start[s], start[s] + width) of each stream."""
        bs = self.fbs
        slot = start[:, None] + torch.arange(width, device=self.device)
        column = (slot // bs).clamp(max=max(self.float_table.shape[1] - 1, 0))
        ids = self.float_table.long().gather(1, column) * bs + slot % bs if self.float_table.shape[1] else slot * 0
        return {name: self.float_flat(name)[ids] for name in names}

    def append(
        self,
        data: dict[str, torch.Tensor],
        counts: torch.Tensor,
        positions: torch.Tensor,
        float_positions: Callable[[torch.Tensor, int], torch.Tensor],
        encode: Callable[..., dict[str, torch.Tensor]],
    ) -> None:
        """Store the first counts[s] new tokens of each stream (data {name: (S, t, ...)}, k/v (S, t, g, D)).

        Float recipes append in place. Quantized recipes: the first tokens of an empty stream
        become sinks; then, once the float window holds ``recent + bs`` or more non-sink tokens,
        its oldest full blocks are encoded with ``encode(k (N, g, bs, D), v, rows (N,),
        positions (N, bs))`` (positions of new tokens: ``positions`` (S, t); of stored float
        tokens: ``float_positions(start (S,), width)``) and only the rest stays in float.
        """
        if not self.layout.quantized:
            self.write_float(self.float_len.clone(), counts, data)
            return
        bs, recent = self.layout.block_size, self.layout.recent_tokens
        empty = (self.float_len == self.n_sink) & (self.body_len == 0)
        new_sinks = torch.minimum((self.layout.sink_tokens - self.n_sink).clamp(min=0) * empty, counts)
        if int(new_sinks.sum()):
            self.write_float(self.n_sink.clone(), new_sinks, data)
            self.n_sink = self.n_sink + new_sinks
        t = counts.new_tensor(next(iter(data.values())).shape[1])
        shift = torch.arange(int(t), device=self.device)[None] + new_sinks[:, None]  # (S, t) new tokens after the sinks
        rest = {name: _take(values, shift.clamp(max=max(int(t) - 1, 0))) for name, values in data.items()}
        rest_pos = _take(positions, shift.clamp(max=max(int(t) - 1, 0)))
        rest_count = counts - new_sinks
        old = self.float_len - self.n_sink  # non-sink float tokens held
        flush = ((old + rest_count - recent) // bs).clamp(min=0)  # blocks to encode per stream
        if int(flush.sum()) == 0:
            self.write_float(self.float_len.clone(), rest_count, rest)
            return
        width = int(old.max())
        held = self.read_float_at(list(data), self.n_sink, width)
        held_pos = float_positions(self.n_sink, width)
        # the non-sink tokens in order: held ones, then new ones; v -> column of cat([held, rest])
        total = old + rest_count
        v = torch.arange(int(total.max()), device=self.device)[None]
        column = torch.where(v < old[:, None], v, width + v - old[:, None]).clamp(max=width + int(t) - 1)
        joined = {name: torch.cat([held[name], rest[name]], dim=1) for name in data}
        joined_pos = torch.cat([held_pos.long(), rest_pos.long()], dim=1)
        rows = torch.repeat_interleave(torch.arange(self.streams, device=self.device), flush)
        block = torch.arange(rows.shape[0], device=self.device) - torch.repeat_interleave(torch.cumsum(flush, 0) - flush, flush)
        token = column[rows[:, None], block[:, None] * bs + torch.arange(bs, device=self.device)]  # (N, bs)
        blocks = encode(joined["k"][rows[:, None], token], joined["v"][rows[:, None], token], rows, joined_pos[rows[:, None], token])
        meta = {name: joined[name][rows[:, None], token] for name in self.layout.meta}
        self.add_body_blocks(rows, {**blocks, **meta})
        keep_from = flush * bs  # the rest stays in the float window
        remain = total - keep_from
        kept_cols = column.gather(1, (keep_from[:, None] + torch.arange(int(remain.max()), device=self.device)).clamp(max=column.shape[1] - 1))
        remainder = {name: _take(values, kept_cols) for name, values in joined.items()}
        self.write_float(self.n_sink.clone(), remain, remainder)
        self._release_float_beyond(self.n_sink + remain)

    # --- body --------------------------------------------------------------------------------------
    def add_body_blocks(self, rows: torch.Tensor, blocks: dict[str, torch.Tensor]) -> None:
        """Append encoded blocks: rows (N,) stream of each block (grouped per stream, in token order)."""
        n = rows.shape[0]
        if n == 0:
            return
        ids = self.body_pool.allocate(n)
        for name, values in blocks.items():
            self.body_pool.tensors[name][ids] = values.to(self.body_pool.tensors[name].dtype)
        counts = torch.bincount(rows, minlength=self.streams)
        rank = torch.arange(n, device=self.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        column = self.body_len[rows] + rank
        self.body_table = _grow_columns(self.body_table, int((self.body_len + counts).max()))
        self.body_table[rows, column] = ids.to(torch.int32)
        self.body_len = self.body_len + counts

    def body_block_ids(self, start: int, stop: int) -> torch.Tensor:
        """(S, stop - start) int64 body block ids of table columns [start, stop) (garbage past body_len)."""
        cols = torch.arange(start, stop, device=self.device).clamp(max=max(self.body_table.shape[1] - 1, 0))
        return self.body_table.long()[:, cols]

    def read_body(self, part: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: (S, nb, *shape)} of part ``k`` or ``v`` for block ids (S, nb)."""
        prefix = f"{part}."
        return {name[2:]: t[ids] for name, t in self.body_pool.tensors.items() if name.startswith(prefix)}

    # --- eviction -------------------------------------------------------------------------------------
    def keep(self, keep_float: torch.Tensor | None, keep_body: torch.Tensor | None) -> None:
        """Free what is not kept: float slots (S, F) one by one (compacting in order), body blocks (S, Bn) whole."""
        if keep_body is not None and self.body_pool is not None and keep_body.shape[1]:
            cols = torch.arange(keep_body.shape[1], device=self.device)
            held = cols < self.body_len[:, None]
            keep_body = keep_body & held
            self.body_pool.release(self.body_table[:, : keep_body.shape[1]][held & ~keep_body].long())
            order = torch.sort((~keep_body).to(torch.int8), dim=1, stable=True).indices  # kept columns first, in order
            self.body_len = keep_body.sum(dim=1)
            compacted = self.body_table[:, : keep_body.shape[1]].gather(1, order)
            self.body_table[:, : keep_body.shape[1]] = compacted.masked_fill(cols >= self.body_len[:, None], 0)
            self.shrink()
        if keep_float is None or keep_float.shape[1] == 0:
            return
        width = keep_float.shape[1]
        held = torch.arange(width, device=self.device) < self.float_len[:, None]
        keep_float = keep_float & held
        if bool((keep_float == held).all()):
            return
        sinks = torch.arange(width, device=self.device) < self.n_sink[:, None]
        self.n_sink = (keep_float & sinks).sum(dim=1)
        order = torch.sort((~keep_float).to(torch.int8), dim=1, stable=True).indices  # kept slots first, in order
        src = self.float_slots(0, width).gather(1, order)  # (S, F)
        new_len = keep_float.sum(dim=1)
        names = list(self.float_pool.tensors)
        data = {name: self.float_flat(name)[src] for name in names}
        self.write_float(torch.zeros_like(new_len), new_len, data)
        self._release_float_beyond(new_len)

    # --- batch -----------------------------------------------------------------------------------------
    def select_streams(self, rows: torch.Tensor) -> None:
        """Streams become ``rows`` (S',) of the old ones (beams, finished sequences): duplicates are copied."""
        rows = rows.to(self.device).long()
        old = self.streams
        first = torch.zeros(rows.shape[0], dtype=torch.bool, device=self.device)
        seen = torch.full((old,), -1, dtype=torch.long, device=self.device)
        seen.scatter_reduce_(0, rows, torch.arange(rows.shape[0], device=self.device), reduce="amin", include_self=False)
        first[seen[seen >= 0]] = True
        unselected = torch.ones(old, dtype=torch.bool, device=self.device)
        unselected[rows] = False
        fbs = self.fbs
        self._release_rows(self.float_pool, self.float_table, (self.float_len + fbs - 1) // fbs, unselected)
        if self.body_pool is not None:
            self._release_rows(self.body_pool, self.body_table, self.body_len, unselected)
        self.float_table = self._copy_duplicates(self.float_pool, self.float_table[rows], ((self.float_len + fbs - 1) // fbs)[rows], ~first)
        if self.body_pool is not None:
            self.body_table = self._copy_duplicates(self.body_pool, self.body_table[rows], self.body_len[rows], ~first)
        else:
            self.body_table = self.body_table[rows]
        self.float_len, self.body_len = self.float_len[rows], self.body_len[rows]
        self.n_sink = self.n_sink[rows]

    def _release_rows(self, pool: BlockPool, table: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        held = torch.arange(table.shape[1], device=self.device) < blocks[:, None]
        pool.release(table[held & rows[:, None]].long())

    def _copy_duplicates(self, pool: BlockPool, table: torch.Tensor, blocks: torch.Tensor, dup: torch.Tensor) -> torch.Tensor:
        """Give rows marked ``dup`` fresh copies of their blocks."""
        held = (torch.arange(table.shape[1], device=self.device) < blocks[:, None]) & dup[:, None]
        n = int(held.sum())
        if n == 0:
            return table
        table = table.clone()
        source = table[held].long()
        ids = pool.allocate(n)
        for t in pool.tensors.values():
            t[ids] = t[source]
        table[held] = ids.to(torch.int32)
        return table

    def shrink(self) -> None:
        """Compact pools whose reserved rows exceed 1.25 x used + one block per stream."""
        for pool, attr in ((self.float_pool, "float_table"), (self.body_pool, "body_table")):
            if pool is None:
                continue
            plan = pool.shrink_plan(self.streams)
            if plan is None:
                continue
            old, new, capacity = plan
            remap = torch.arange(pool.capacity, device=self.device)
            remap[old] = new
            setattr(self, attr, remap[getattr(self, attr).long()].to(torch.int32))
            pool.apply_moves(old, new, capacity)

    def reset(self, streams: int) -> None:
        self.float_pool.clear()
        if self.body_pool is not None:
            self.body_pool.clear()
        self._reset_tables(streams)


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (S, T, ...) gathered along dim 1 at index (S, W)."""
    rows = torch.arange(values.shape[0], device=values.device)[:, None]
    return values[rows, index]


def stream_rows(batch: int, groups: int, device) -> torch.Tensor:
    """(batch * groups,) sequence index of every stream."""
    return torch.arange(batch, device=device).repeat_interleave(groups)


KeysTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (keys, positions) -> keys
