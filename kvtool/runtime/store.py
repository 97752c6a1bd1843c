"""The paged store of one decoder layer: fixed-size blocks in pools, a block table per stream.

A *stream* is one (sequence, storage group) pair: S = batch x H_kv / g streams per layer,
stream ``s = b * (H_kv / g) + j``; g = heads per stream (1, except Palu latents that span a
group of KV heads). Every stream holds its own tokens at its own length: never padded to
the longest stream, never expanded to query heads. Layout (what the Triton kernels read):

* **float pool** (`BlockPool`): ``k``, ``v`` (cap, fbs, g, D) in the cache's float dtype
  (float8_e4m3fn: written saturating at +-448 by `to_float_slots`, read widened by ``.float()``; int8: codes with
  ``ks``, ``vs`` (cap, fbs, g, D / G) float16 beside them, one scale per G = `slot_scale_group` channels of each
  token, written by `encode_int8_slots` and read through `read_float_values`, `read_float_at` and
  `read_float_blocks`, which decode them),
  plus per-slot metadata where the cache needs it: ``pos`` (cap, fbs) int32 original
  positions, ``score`` (cap, fbs) float32 accumulated attention, ``feature`` (cap, fbs)
  float32 a policy's static token score, ``cls`` (cap, fbs) uint8 FastGen token classes.
  Float blocks hold ``fbs = layout.float_block`` tokens (``cache.float_block_size``, 16 by default). With sparse attention
  (``summary_tokens`` = n > 1) each float block also keeps ``kmax`` / ``kmin`` (cap, fbs / n,
  g, D): per group of n consecutive slots, the per-channel max and min of their keys
  (RocketKV's stage-2 summaries), exact for the group's valid slots; with n = 1 the keys are
  their own summaries and nothing more is kept. With ``token_sums`` (``sparse_attention.unread:
  estimate``) each float block also keeps ``ksum`` and ``vsum`` (cap, g, D): the sums of its valid
  slots' keys and values, so a step that reads a quarter of the tokens knows the rest in sum; with
  ``key_squares`` (``channel_score: query_key``) also ``k2sum`` (cap, g, D) float32, the sum of the
  squared keys, for each channel's spread (``unread: estimate_blocks`` reads the sums block by
  block). A stream's float region holds its sinks (the first ``sink_tokens`` tokens, never
  encoded) then its newest tokens (the KIVI recent window and the last, partly filled block);
  for recipes that quantize nothing it holds every token.
* **body pool** (quantized recipes): the key and the value format's tensors side by side,
  ``k.<name>`` / ``v.<name>`` (cap, *shape) as `BlockQuantizer.block_spec` defines them
  (packed codes with their scales beside them, sparse outliers, latents), plus the same
  per-slot metadata (cap, bs); one block = ``bs = cache.block_size`` tokens of one stream.
* **tables** per stream: ``float_table`` (S, F) and ``body_table`` (S, Bn) int32 block ids
  (entries past a stream's blocks are 0); lengths ``float_len`` (tokens), ``body_len``
  (blocks), ``n_sink`` (sinks at the front of the float region), each (S,) int64, kept on
  the host (numpy) so that every decision about sizes is made without device work, with
  device copies made on demand (`lengths`).

Token order: sinks at float slots [0, n_sink), body blocks in table order, then float
slots [n_sink, float_len); in a cache that evicts nothing, token index = slot for sinks,
``n_sink + j * bs + o`` for body block j offset o, ``i + body_len * bs`` for float slot
i >= n_sink. A cache that evicts stores positions per slot and keeps no order among the
float slots of a stream that quantizes nothing: an evicted token's slot is reused by a
new token (`fill_holes`), so eviction moves O(1) tokens per step.

Writes are in place: appending writes one slot of the stream's open float block (a new
block when it is full); when the float region holds ``recent_tokens + bs`` non-sink tokens,
its oldest ``bs`` are encoded into a new body block and the rest of the window is
rewritten (O(recent) once per ``bs`` tokens). Freed blocks go back to the pool. Nothing
here loops in Python over streams or tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvtool.runtime.pool import BlockPool
from kvtool.runtime.staging import to_device

FLOAT_BLOCK = 16  # tokens per float block unless the recipe says otherwise (`cache.float_block_size`)
FLOAT8_DTYPES = (torch.float8_e4m3fn,)  # float blocks in one byte per value (``cache.float_dtype: float8_e4m3``)
INT8_SLOTS = torch.int8  # float blocks as int8 codes with a float16 scale per channel group (``cache.float_dtype: int8``)
BYTE_SLOT_DTYPES = (*FLOAT8_DTYPES, INT8_SLOTS)  # one byte per value: a kernel attends to a new token as stored
SLOT_SCALE_GROUP = 32  # channels per int8 float-slot scale (fewer where head_dim is not a multiple: `slot_scale_group`)
SLOT_SCALES = {"k": "ks", "v": "vs"}  # int8 float slots: the scale tensor beside each code tensor
META_DTYPES = {"pos": torch.int32, "score": torch.float32, "feature": torch.float32, "cls": torch.uint8}
LENGTHS = ("float_len", "body_len", "n_sink")
SUMMARIES = ("kmax", "kmin", "ksum", "vsum", "k2sum")  # per-block (not per-slot) float pool tensors


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
    summary_tokens: int = 0  # > 0: float blocks keep per-channel key max/min per this many slots (sparse attention)
    token_sums: bool = False  # float blocks keep the sums of their keys and values (sparse attention's unread estimate)
    key_squares: bool = False  # ... and of their squared keys, float32 (sparse attention's channel_score: query_key)
    float_block: int = FLOAT_BLOCK  # tokens per float block


def _ceil_div(a, b):
    return -(-a // b)


def to_float_slots(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a float pool of ``dtype`` stores them: a plain cast, saturating at the format's largest value for
    float8 (torch's cast would turn what lies beyond into nan)."""
    if dtype in FLOAT8_DTYPES:
        limit = torch.finfo(dtype).max
        return values.float().clamp(-limit, limit).to(dtype)
    return values.to(dtype)


def wide_float_dtype(float_dtype: torch.dtype) -> torch.dtype:
    """float16 for one-byte float blocks (float8: exact for every float8 value; int8 codes), else ``float_dtype``: the
    dtype of what sits beside the float slots and must hold more than one byte can (a block's key summaries and token
    sums, the body formats' floats, int8 slots' scales)."""
    return torch.float16 if float_dtype in BYTE_SLOT_DTYPES else float_dtype


def slot_scale_group(head_dim: int) -> int:
    """Channels per scale of int8 float slots: 32, or the largest power of two dividing both 32 and head_dim."""
    return math.gcd(SLOT_SCALE_GROUP, head_dim)


def encode_int8_slots(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values (..., D) -> (codes (..., D) int8 in [-127, 127], scales (..., D / group) float16): symmetric, one scale
    per ``group`` consecutive channels = their largest magnitude / 127, rounded to float16 before the codes are made
    from it (so `decode_int8_slots` returns code x the stored scale; a group of zeros has scale 0 and codes 0). CPU
    tensors are encoded in numpy (`int8_slots_on_host`, the same bits), others by `encode_int8_slots_torch`."""
    if values.device.type == "cpu":
        codes, scales, _ = int8_slots_on_host(values.detach().float().contiguous().numpy(), group)
        return torch.from_numpy(codes), torch.from_numpy(scales)
    return encode_int8_slots_torch(values, group)


def encode_int8_slots_torch(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode_int8_slots` in torch operations (any device)."""
    x = values.float().unflatten(-1, (-1, group))  # (..., D / G, G)
    fp16_max = torch.finfo(torch.float16).max
    scales = (x.abs().amax(dim=-1) / 127.0).clamp(max=fp16_max).to(torch.float16)  # (..., D / G)
    s = scales.float()[..., None]
    codes = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-127, 127).to(torch.int8)
    return codes.flatten(-2), scales


def decode_int8_slots(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes (..., D) int8, scales (..., D / G) -> values (..., D) float32 (code x scale)."""
    g = codes.shape[-1] // scales.shape[-1]
    return (codes.float().unflatten(-1, (-1, g)) * scales.float()[..., None]).flatten(-2)


def int8_slots_on_host(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`encode_int8_slots` of a host array x (..., D) float32, bit for bit as the torch version and without torch's
    per-operation dispatch, which costs more than the arithmetic for the one token per stream a decode step writes:
    (codes (..., D) int8, scales (..., D / group) float16, the values they hold (..., D) float32). One compiled call
    (`cpu_decode_kernel.encode_int8_rows`) where Numba is installed, else numpy (`int8_slots_numpy`)."""
    encode = _compiled_int8_encoder()
    if encode is None:
        return int8_slots_numpy(x, group)
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    codes, held = np.empty(rows.shape, np.int8), np.empty(rows.shape, np.float32)
    bits = np.empty((rows.shape[0], rows.shape[1] // group), np.uint16)
    encode(rows, group, codes, bits, held)
    return codes.reshape(x.shape), bits.view(np.float16).reshape(*x.shape[:-1], -1), held.reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _compiled_int8_encoder():
    """`cpu_decode_kernel.encode_int8_rows` where Numba is installed, else None."""
    from kvtool.runtime.kernels.cpu_decode import numba_available

    if not numba_available():
        return None
    from kvtool.runtime.kernels.cpu_decode_kernel import encode_int8_rows

    return encode_int8_rows


def int8_slots_numpy(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`int8_slots_on_host` in numpy operations (IEEE float32 division, round half to even, float16 rounding to
    nearest even: the torch version's bits)."""
    grouped = x.reshape(*x.shape[:-1], -1, group)  # (..., D / G, G)
    scales = np.minimum(np.abs(grouped).max(axis=-1) / np.float32(127.0), np.float32(65504.0)).astype(np.float16)
    s = scales.astype(np.float32)[..., None]
    positive = s > 0
    codes = np.clip(np.rint(np.where(positive, grouped / np.where(positive, s, np.float32(1.0)), np.float32(0.0))), -127, 127)
    codes = codes.astype(np.int8)
    held = (codes.astype(np.float32) * s).reshape(x.shape)
    return codes.reshape(x.shape), scales, held


def round_trip_float_slots(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``values`` as a float pool of ``dtype`` gives them back (what a kernel must attend to for a token it
    holds in registers while the store keeps its one-byte form)."""
    if dtype == INT8_SLOTS:
        group = slot_scale_group(values.shape[-1])
        if values.device.type == "cpu":
            return torch.from_numpy(int8_slots_on_host(values.detach().float().contiguous().numpy(), group)[2])
        return decode_int8_slots(*encode_int8_slots(values, group))
    return to_float_slots(values, dtype).float()


def _grow_columns(table: torch.Tensor, needed: int) -> torch.Tensor:
    """Widen a (S, W) table to at least ``needed`` columns (doubling)."""
    if needed <= table.shape[1]:
        return table
    width = max(needed, 2 * table.shape[1], 4)
    return torch.cat([table, table.new_zeros(table.shape[0], width - table.shape[1])], dim=1)


def take_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """t[ids] for integer ids of any shape over t's first dimension: (*ids.shape, *t.shape[1:]).

    `torch.index_select` copies whole rows (several times faster on CPU than advanced indexing)."""
    return torch.index_select(t, 0, ids.reshape(-1)).reshape(*ids.shape, *t.shape[1:])


def _pairs(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, j) for j < counts[row], row-major: the entries of a ragged (S, counts) array."""
    rows = np.repeat(np.arange(counts.shape[0]), counts)
    j = np.arange(rows.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows, j


class LayerStore:
    """Pools and tables of one layer (see the module docstring)."""

    def __init__(self, layout: StoreLayout, key_format, value_format, streams: int, device) -> None:
        self.layout, self.key_format, self.value_format = layout, key_format, value_format
        self.device = torch.device(device)
        g, d = layout.heads_per_stream, layout.head_dim
        self.fbs, self.bs = layout.float_block, layout.block_size
        meta = lambda tokens: {name: ((tokens,), META_DTYPES[name]) for name in layout.meta}  # noqa: E731
        kv = {"k": ((self.fbs, g, d), layout.float_dtype), "v": ((self.fbs, g, d), layout.float_dtype)}
        self.scaled_slots = layout.float_dtype == INT8_SLOTS  # int8 codes + float16 scales per channel group
        if self.scaled_slots:
            self.slot_group = slot_scale_group(d)
            kv.update({scale: ((self.fbs, g, d // self.slot_group), torch.float16) for scale in SLOT_SCALES.values()})
        n, sums_dtype = layout.summary_tokens, wide_float_dtype(layout.float_dtype)
        summaries = {name: ((self.fbs // n, g, d), sums_dtype) for name in ("kmax", "kmin")} if n > 1 else {}  # 1: keys
        if layout.token_sums:
            summaries.update({"ksum": ((g, d), sums_dtype), "vsum": ((g, d), sums_dtype)})
            if layout.key_squares:
                summaries["k2sum"] = ((g, d), torch.float32)
        self.float_pool = BlockPool({**kv, **meta(self.fbs), **summaries}, device)
        self.slot_names = tuple(name for name in self.float_pool.tensors if name not in SUMMARIES)  # per-slot tensors
        self._summaries_stale = False  # True after writes the decode fast path does not follow
        self.body_pool = None
        if layout.quantized:
            spec = {f"k.{n}": s for n, s in key_format.block_spec().items()}
            spec.update({f"v.{n}": s for n, s in value_format.block_spec().items()})
            self.body_pool = BlockPool({**spec, **meta(self.bs)}, device)
        self._reset_tables(streams)

    def _reset_tables(self, streams: int) -> None:
        self.float_table = torch.zeros(streams, 0, dtype=torch.int32, device=self.device)
        self.body_table = torch.zeros(streams, 0, dtype=torch.int32, device=self.device)
        self._device: dict[str, torch.Tensor] = {}
        for name in LENGTHS:
            self._set(name, np.zeros(streams, dtype=np.int64))

    def _set(self, name: str, values: np.ndarray) -> None:
        """Replace a host length array (never mutated in place: device copies may share its memory)."""
        setattr(self, name, np.asarray(values, dtype=np.int64).copy())
        self._device.pop(name, None)
        self._quiet = None

    def quiet_appends(self) -> int:
        """Decode steps (one token per stream) from now on that only write the next float slot of each stream, in a
        float block it already has: no sink made, no block encoded, no float block allocated (`appended_one`). Cached
        until a length changes any other way."""
        quiet = self.__dict__.get("_quiet")
        if quiet is None:
            room = self.float_blocks() * self.fbs - self.float_len  # free slots in the streams' last float blocks
            if self.layout.quantized:
                flush_room = self._flush_room()
                room = np.zeros_like(room) if flush_room is None else np.minimum(room, flush_room)
            quiet = self._quiet = int(room.min()) if room.shape[0] else 0
        return quiet

    def can_append_one(self, makes_sinks: bool = False, flushes: bool = False) -> bool:
        """A decode step may write each stream's next float slot in place (then `appended_one`): room in the streams'
        float blocks (`quiet_appends`), or only a full last float block, which `reserve_one` allocates right before
        the write (as the append would); False when a block must be encoded, or a sink is due, and the caller does
        not do it itself after the write (``flushes``: `flush_held`; ``makes_sinks``: `cpu_fastgen` counts them)."""
        if self.quiet_appends() > 0:
            return True
        if not self.streams:
            return False
        if self.layout.quantized:
            flush_room = self._flush_room(makes_sinks)
            return flush_room is not None and (flushes or int(flush_room.min()) > 0)
        return True

    def _flush_room(self, makes_sinks: bool = False) -> np.ndarray | None:
        """(S,) one-token appends each stream of a quantized store takes before its oldest float block is encoded;
        None when the next token of some stream becomes a sink (unless ``makes_sinks``)."""
        new_sinks, _ = self._append_split(np.ones_like(self.float_len))
        if new_sinks.any() and not makes_sinks:
            return None
        return self.layout.recent_tokens + self.bs - 1 - (self.float_len - self.n_sink)

    def reserve_one(self) -> None:
        """Allocate the next float block of every stream whose last one is full, right before a kernel writes the
        step's token (`can_append_one`); `appended_one` then counts the token, and the block with it."""
        if self.quiet_appends() == 0:
            self._ensure_float_blocks(self.float_len + 1)

    def appended_one(self) -> None:
        """Every stream's next float slot was written in place (a kernel did it; `can_append_one` allowed it)."""
        quiet = self.quiet_appends()
        self.float_len = self.float_len + 1  # a new int64 array, as `_set` makes (every decode step of every layer)
        self._device.pop("float_len", None)
        self._quiet = quiet - 1 if quiet > 0 else None  # counted down; after a reserved block it is recomputed

    def lengths(self, name: str) -> torch.Tensor:
        """Device copy (S,) int64 of a host length array, cached until it changes."""
        if name not in self._device:
            self._device[name] = to_device(getattr(self, name), self.device)
        return self._device[name]

    @property
    def streams(self) -> int:
        return self.float_len.shape[0]

    # --- sizes -----------------------------------------------------------------------------------
    def tokens(self) -> np.ndarray:
        """(S,) tokens held per stream."""
        return self.float_len + self.body_len * self.bs

    def float_blocks(self) -> np.ndarray:
        return _ceil_div(self.float_len, self.fbs)

    def metadata_nbytes(self) -> int:
        """Tables, host lengths and their device copies (shared with the host arrays on CPU)."""
        tables = sum(t.numel() * t.element_size() for t in (self.float_table, self.body_table))
        host = sum(getattr(self, name).nbytes for name in LENGTHS)
        device = 0 if self.device.type == "cpu" else sum(t.numel() * 8 for t in self._device.values())
        return tables + host + device

    def summary_nbytes(self, names: tuple[str, ...] = ("kmax", "kmin")) -> int:
        """Bytes of the key max/min summaries (or other per-block tensors of ``names``: ``("ksum", "vsum")`` for the
        token sums) of the float blocks in use (part of `used_nbytes`; 0 without them; one-token key groups are the keys
        themselves)."""
        pool = self.float_pool.tensors
        return sum(self.float_pool.used * pool[name][0].numel() * pool[name].element_size() for name in names if name in pool)

    def used_nbytes(self) -> int:
        """Bytes of blocks in use plus tables and lengths."""
        body = self.body_pool.used_nbytes() if self.body_pool is not None else 0
        return self.float_pool.used_nbytes() + body + self.metadata_nbytes()

    def reserved_nbytes(self) -> int:
        """Bytes allocated: every pool row (free or not), the free maps, tables and lengths."""
        body = self.body_pool.reserved_nbytes() if self.body_pool is not None else 0
        return self.float_pool.reserved_nbytes() + body + self.metadata_nbytes()

    def expected_nbytes(self) -> int:
        """Analytic bytes from the token counts: ceil(float tokens / fbs) float blocks + body blocks + tables."""
        total = int(self.float_blocks().sum()) * self.float_pool.block_nbytes() + self.metadata_nbytes()
        if self.body_pool is not None:
            total += int(self.body_len.sum()) * self.body_pool.block_nbytes()
        return total

    def tensors(self) -> list:
        """Every array the store holds between forwards (for outside accounting)."""
        out = [self.float_table, self.body_table, *list(self._device.values())]
        out += [getattr(self, name) for name in LENGTHS]
        for pool in (self.float_pool, self.body_pool):
            if pool is not None:
                out += list(pool.tensors.values()) + [pool.in_use]
        return out

    # --- reading ----------------------------------------------------------------------------------
    def flat(self, pool: BlockPool, name: str) -> torch.Tensor:
        """A pool tensor viewed per slot: (cap * tokens per block, ...)."""
        return pool.flat(name)

    def float_flat(self, name: str) -> torch.Tensor:
        return self.flat(self.float_pool, name)

    def body_flat(self, name: str) -> torch.Tensor:
        return self.flat(self.body_pool, name)

    def float_block_ids(self, c0: int, c1: int) -> torch.Tensor:
        """(S, c1 - c0) int64 float block ids of table columns [c0, c1) (0 past a stream's blocks)."""
        self.float_table = _grow_columns(self.float_table, c1)
        return self.float_table[:, c0:c1].long()

    def body_block_ids(self, c0: int, c1: int) -> torch.Tensor:
        self.body_table = _grow_columns(self.body_table, c1)
        return self.body_table[:, c0:c1].long()

    def read_blocks(self, pool: BlockPool, names, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: (S, nb * tokens per block, ...)} of block ids (S, nb), token order within blocks."""
        out = {}
        for name in names:
            t = take_rows(pool.tensors[name], ids)  # (S, nb, tokens, ...)
            out[name] = t.reshape(ids.shape[0], -1, *t.shape[3:])
        return out

    def body_pool_side(self, part: str) -> dict[str, torch.Tensor]:
        """{name: (cap, *shape)} body pool tensors of part ``k`` or ``v`` (what the kernels read in place)."""
        return self.body_pool.side(f"{part}.")

    def read_body(self, part: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: (S, nb, *shape)} of part ``k`` or ``v`` for block ids (S, nb)."""
        prefix = f"{part}."
        return {name[2:]: take_rows(t, ids) for name, t in self.body_pool.tensors.items() if name.startswith(prefix)}

    def float_slot_ids(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat float-pool ids of region slots (S, W) (garbage, but in range, past a stream's length)."""
        column = (slots // self.fbs).clamp(max=max(self.float_table.shape[1] - 1, 0))
        if self.float_table.shape[1] == 0:
            return torch.zeros_like(slots)
        return self.float_table.long().gather(1, column) * self.fbs + slots % self.fbs

    def read_float_at(self, names, start: np.ndarray, width: int) -> dict[str, torch.Tensor]:
        """{name: (S, width, ...)} from float slots [start[s], start[s] + width) of each stream (``k`` / ``v`` as
        `read_float_values` gives them)."""
        slots = to_device(start, self.device)[:, None] + torch.arange(width, device=self.device)
        ids = self.float_slot_ids(slots)
        return {name: self.read_float_values(name, ids, per_slot=True) for name in names}

    def read_float_values(self, name: str, ids: torch.Tensor, per_slot: bool = False) -> torch.Tensor:
        """The float pool's ``name`` at block ids (*ids.shape, fbs, ...) or, ``per_slot``, at flat slot ids
        (*ids.shape, ...): keys and values of int8 slots decoded to float32, everything else as held."""
        source = self.float_flat if per_slot else self.float_pool.tensors.__getitem__
        x = take_rows(source(name), ids)
        if self.scaled_slots and name in SLOT_SCALES:
            return decode_int8_slots(x, take_rows(source(SLOT_SCALES[name]), ids))
        return x

    def read_float_blocks(self, names, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """`read_blocks` of the float pool: {name: (S, nb * fbs, ...)} of block ids (S, nb), as `read_float_values`."""
        return {name: self.read_float_values(name, ids).flatten(1, 2) for name in names}

    def as_stored(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Float-slot data {name: values} as the pool holds them: int8 slots' keys and values become codes plus their
        scales (``ks`` / ``vs``), unless the scales are already there (slots copied as they are held)."""
        if not self.scaled_slots:
            return data
        out = dict(data)
        for name, scale in SLOT_SCALES.items():
            if name in data and scale not in data:
                out[name], out[scale] = encode_int8_slots(data[name], self.slot_group)
        return out

    # --- float region: writing ----------------------------------------------------------------------
    def _ensure_float_blocks(self, new_len: np.ndarray) -> None:
        """Allocate the float blocks streams need to hold ``new_len`` tokens."""
        have, need = self.float_blocks(), _ceil_div(new_len, self.fbs)
        extra = np.maximum(need - have, 0)
        total = int(extra.sum())
        if total == 0:
            return
        self.float_table = _grow_columns(self.float_table, int(need.max()))
        ids = self.float_pool.allocate(total)
        rows, j = _pairs(extra)
        rows_t, cols_t = to_device(rows, self.device), to_device(have[rows] + j, self.device)
        self.float_table[rows_t, cols_t] = ids.to(torch.int32)

    def _release_float_beyond(self, new_len: np.ndarray) -> None:
        """Free float blocks past ``new_len`` tokens, then set the lengths."""
        have, keep = self.float_blocks(), _ceil_div(new_len, self.fbs)
        drop = np.maximum(have - keep, 0)
        if drop.sum():
            rows, j = _pairs(drop)
            rows_t, cols_t = to_device(rows, self.device), to_device(keep[rows] + j, self.device)
            self.float_pool.release(self.float_table[rows_t, cols_t].long())
            self.float_table[rows_t, cols_t] = 0
        self._set("float_len", new_len)
        if drop.sum():
            self.shrink()

    def set_float_lengths(self, new_len: np.ndarray) -> None:
        """A compiled step compacted the float region in place (`cpu_fastgen`): hold ``new_len`` (S,) tokens, free
        the float blocks past them."""
        if np.array_equal(new_len, self.float_len):  # nothing freed (FastGen's ``full`` heads, a kept new token)
            return
        self._summaries_stale = True
        self._release_float_beyond(new_len)

    def set_kept_lengths(self, lengths: np.ndarray, freed_body: np.ndarray) -> None:
        """A compiled step compacted a quantized store in place, both regions in order (`cpu_fastgen`, as `keep`):
        lengths (3, S) int64 = float tokens, sinks among them, body blocks; freed_body (N,) int64 the body blocks it
        dropped from the table (released here)."""
        if freed_body.size:
            self.body_pool.release(torch.from_numpy(freed_body).to(self.device))
            self._set("body_len", lengths[2])
            self.shrink()
        if not np.array_equal(lengths[1], self.n_sink):
            self._set("n_sink", lengths[1])
        self.set_float_lengths(lengths[0])

    def write_float(self, start: np.ndarray, count: np.ndarray, data: dict[str, torch.Tensor]) -> None:
        """Write the first count[s] entries of each row of data {name: (S, W, ...)} into float slots
        [start[s], start[s] + count[s]) (blocks allocated as needed); lengths become max(float_len, end)."""
        data = self.as_stored(data)
        width = next(iter(data.values())).shape[1]
        total = int(count.sum())
        end = start + count
        if total and width == 1 and total == self.streams:  # a decode step: one token per stream
            self._write_one_each(start, data)
            return
        self._ensure_float_blocks(np.maximum(self.float_len, end))
        if total:
            if (count == width).all():  # every row written whole: no gather of the sources
                rows_t = torch.arange(self.streams, device=self.device).repeat_interleave(width)
                j_t = torch.arange(width, device=self.device).repeat(self.streams)
                source = {name: values.reshape(-1, *values.shape[2:]) for name, values in data.items()}
            else:
                rows, j = _pairs(count)
                rows_t, j_t = to_device(rows, self.device), to_device(j, self.device)
                source = {name: values[rows_t, j_t] for name, values in data.items()}
            slot = to_device(start, self.device)[rows_t] + j_t
            target = self.float_table[rows_t, slot // self.fbs].long() * self.fbs + slot % self.fbs
            for name, values in source.items():
                flat = self.float_flat(name)
                flat[target] = to_float_slots(values, flat.dtype)
            self._summaries_stale = True
        self._set("float_len", np.maximum(self.float_len, end))

    def _write_one_each(self, start: np.ndarray, data: dict[str, torch.Tensor]) -> None:
        """`write_float` of one token per stream (data {name: (S, 1, ...)}, `as_stored`) at float slot start[s]: a
        decode step.

        The hot path of every decode step, so it does the least: slot ids come from the host table on CPU
        (numpy, no per-op dispatch), each tensor is written by one index_copy_."""
        fbs = self.fbs
        end = start + 1
        self._ensure_float_blocks(end)  # allocates only where a slot lies past the stream's blocks
        column, offset = start // fbs, start % fbs
        if self.device.type == "cpu":
            block_np = self.float_table.numpy()[np.arange(self.streams), column].astype(np.int64)  # (S,)
            target = torch.from_numpy(block_np * fbs + offset)  # (S,) flat slot ids
        else:
            block = self.float_table.gather(1, to_device(column, self.device)[:, None])[:, 0].long()
            target = block * fbs + to_device(offset, self.device)
        stored = {}
        for name, values in data.items():
            flat = self.float_flat(name)
            stored[name] = values = to_float_slots(values[:, 0], flat.dtype)
            if flat.dtype in FLOAT8_DTYPES:  # torch has no float8 index_copy_ on CPU: copy the bytes
                flat, values = flat.view(torch.uint8), values.view(torch.uint8)
            flat.index_copy_(0, target, values)
        if not self._summaries_stale and (self.layout.summary_tokens > 1 or self.layout.token_sums):
            if self.scaled_slots:  # what the slots hold
                k, v = (decode_int8_slots(stored[name], stored[SLOT_SCALES[name]]) for name in ("k", "v"))
            else:
                k, v = (stored[name].to(wide_float_dtype(stored[name].dtype)) for name in ("k", "v"))
            if self.layout.summary_tokens > 1:
                self._absorb_into_summaries(target // fbs, target % fbs, k)
            if self.layout.token_sums:
                self._absorb_into_sums(target // fbs, target % fbs, k, v)
        self._set("float_len", np.maximum(self.float_len, end))

    def fill_holes(self, keep: torch.Tensor, data: dict[str, torch.Tensor], keep_new: torch.Tensor) -> None:
        """Evict from an unordered float region: slots where ``keep`` (S, F) is False are freed, kept new
        tokens (``keep_new`` (S, t) of data {name: (S, t, ...)}) take their places first, then the
        stream's last tokens; a stream with more new tokens than holes grows at its end."""
        data = self.as_stored(data)
        width = keep.shape[1]
        slots = torch.arange(width, device=self.device)
        keep = keep & (slots < self.lengths("float_len")[:, None])
        kept_held, kept_new = keep.sum(dim=1), keep_new.sum(dim=1)
        new_len = (kept_held + kept_new).cpu().numpy()
        n_new = to_device(new_len, self.device)
        grow = int((new_len - self.float_len).max()) if self.streams else 0
        span = max(width, width + grow)
        j = torch.arange(span, device=self.device)
        held = torch.zeros(keep.shape[0], span, dtype=torch.bool, device=self.device)
        held[:, :width] = keep
        target = (j < n_new[:, None]) & ~held  # free slots of the final region
        movers = held & (j >= n_new[:, None])  # kept tokens outside it
        targets = int(target.sum(dim=1).max()) if self.streams else 0
        if targets == 0:
            self._release_float_beyond(new_len)
            return
        self._ensure_float_blocks(np.maximum(self.float_len, new_len))
        order_t = torch.sort((~target).to(torch.int8), dim=1, stable=True).indices[:, :targets]  # target slots, ascending
        order_m = torch.sort((~movers).to(torch.int8), dim=1, stable=True).indices[:, :targets]
        n_movers = movers.sum(dim=1)
        rank = torch.arange(targets, device=self.device)[None]
        from_mover = rank < n_movers[:, None]
        from_new = (rank >= n_movers[:, None]) & (rank < (n_movers + kept_new)[:, None])
        dst = self.float_slot_ids(order_t)
        src = self.float_slot_ids(order_m)
        new_order = torch.sort((~keep_new).to(torch.int8), dim=1, stable=True).indices  # kept new tokens first
        new_index = (rank - n_movers[:, None]).clamp(min=0, max=max(keep_new.shape[1] - 1, 0))
        new_index = new_order.gather(1, new_index) if keep_new.shape[1] else new_index
        rows = torch.arange(keep.shape[0], device=self.device)[:, None].expand(-1, targets)
        self._summaries_stale = True
        for name in self.slot_names:
            flat = self.float_flat(name)
            moved = flat[src[from_mover]]
            flat[dst[from_mover]] = moved
            if name in data and keep_new.shape[1]:
                flat[dst[from_new]] = to_float_slots(data[name][rows[from_new], new_index[from_new]], flat.dtype)
        self._release_float_beyond(new_len)

    # --- key summaries (sparse attention) ---------------------------------------------------------
    def _absorb_into_summaries(self, block: torch.Tensor, offset: torch.Tensor, k: torch.Tensor) -> None:
        """One new key per stream, k (S, g, D), at ``offset`` (S,) of float block ``block`` (S,), into its group's
        max/min (a group's first slot resets them)."""
        pool, n = self.float_pool.tensors, self.layout.summary_tokens
        k = k.to(pool["kmax"].dtype)
        group = offset // n  # (S,)
        first = (offset % n == 0)[:, None, None]
        pool["kmax"][block, group] = torch.where(first, k, torch.maximum(pool["kmax"][block, group], k))
        pool["kmin"][block, group] = torch.where(first, k, torch.minimum(pool["kmin"][block, group], k))

    def _absorb_into_sums(self, block: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new key and value per stream, (S, g, D) each, at ``offset`` (S,) of float block ``block`` (S,), into the
        block's sums (a block's first slot resets them)."""
        first = (offset == 0)[:, None, None]
        parts = (("ksum", k), ("vsum", v), *((("k2sum", k.float().square()),) if self.layout.key_squares else ()))
        for name, x in parts:
            sums = self.float_pool.tensors[name]
            x = x.to(sums.dtype)
            sums[block] = torch.where(first, x, sums[block] + x)

    def refresh_summaries(self) -> None:
        """Recompute every used float block's per-group key max/min and key and value sums from its valid slots."""
        self._summaries_stale = False
        blocks = self.float_blocks()
        width = int(blocks.max()) if self.streams else 0
        n = self.layout.summary_tokens
        if width == 0:
            return
        ids = self.float_block_ids(0, width)  # (S, F)
        held = self._held_blocks(blocks, width)  # (S, F)
        if self.layout.token_sums:
            slots = torch.arange(width * self.fbs, device=self.device).reshape(width, self.fbs)
            valid = (slots[None] < self.lengths("float_len")[:, None, None])[..., None, None]  # (S, F, fbs, 1, 1)
            for part in ("k", "v"):
                x = self.read_float_values(part, ids).float().masked_fill(~valid, 0.0)  # (S, F, fbs, g, D)
                sums = self.float_pool.tensors[f"{part}sum"]
                sums[ids[held]] = x.sum(dim=2)[held].to(sums.dtype)
                if part == "k" and self.layout.key_squares:
                    self.float_pool.tensors["k2sum"][ids[held]] = x.square().sum(dim=2)[held]
        if n < 2:
            return  # n = 1: the keys are their own summaries
        k = self.read_float_values("k", ids).float()  # (S, F, fbs, g, D)
        k = k.reshape(*k.shape[:2], self.fbs // n, n, *k.shape[3:])  # (S, F, fbs / n, n, g, D)
        slots = torch.arange(width * self.fbs, device=self.device).reshape(width, self.fbs // n, n)
        valid = (slots[None] < self.lengths("float_len")[:, None, None, None])[..., None, None]  # (S, F, fbs/n, n, 1, 1)
        pool = self.float_pool.tensors
        dtype = pool["kmax"].dtype
        pool["kmax"][ids[held]] = k.masked_fill(~valid, -torch.inf).amax(dim=3)[held].to(dtype)
        pool["kmin"][ids[held]] = k.masked_fill(~valid, torch.inf).amin(dim=3)[held].to(dtype)

    def _held_blocks(self, blocks: np.ndarray, width: int) -> torch.Tensor:
        """(S, width) bool: which float table columns hold a block of each stream (blocks (S,) per stream)."""
        return torch.arange(width, device=self.device)[None] < to_device(blocks, self.device)[:, None]

    def block_sums(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """((keys, values[, squared keys]) (S, F, g, D) float32 each, tokens (S, F) int64): every stream's float blocks'
        sums in table order (F = most blocks held; zero past a stream's blocks) and how many tokens each holds."""
        if self._summaries_stale:
            self.refresh_summaries()
        blocks = self.float_blocks()
        width = int(blocks.max()) if self.streams else 0
        ids = self.float_block_ids(0, width)  # (S, F)
        held = self._held_blocks(blocks, width)  # (S, F)
        sums = tuple(
            take_rows(self.float_pool.tensors[name], ids).float().masked_fill(~held[..., None, None], 0.0)  # (S, F, g, D)
            for name in (("ksum", "vsum", "k2sum") if self.layout.key_squares else ("ksum", "vsum"))
        )
        first = torch.arange(width, device=self.device)[None] * self.fbs  # (1, F) first slot of each column
        tokens = (self.lengths("float_len")[:, None] - first).clamp(min=0, max=self.fbs)  # (S, F)
        return sums, tokens

    def token_sums(self) -> tuple[torch.Tensor, ...]:
        """(keys, values[, squared keys]) (S, g, D) float32 each: the sums of the keys and values (and squared keys,
        with ``key_squares``) every stream holds, from its float blocks' sums (reads 1 / fbs of the bytes)."""
        return tuple(x.sum(dim=1) for x in self.block_sums()[0])

    def key_summaries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kmax, kmin) (S, F x fbs / n, g, D) of every stream's summary groups in slot order (F = most blocks held);
        group j covers float slots [j n, (j + 1) n). One-token groups: the keys themselves, twice (no copy)."""
        if self._summaries_stale:
            self.refresh_summaries()
        width = int(self.float_blocks().max()) if self.streams else 0
        ids = self.float_block_ids(0, width)  # (S, F)
        pool = self.float_pool.tensors
        if self.layout.summary_tokens == 1:
            keys = self.read_float_values("k", ids).flatten(1, 2)  # (S, F x fbs, g, D)
            return keys, keys
        kmax, kmin = take_rows(pool["kmax"], ids), take_rows(pool["kmin"], ids)  # (S, F, fbs / n, g, D)
        return kmax.flatten(1, 2), kmin.flatten(1, 2)

    # --- appending ---------------------------------------------------------------------------------
    def append(
        self,
        data: dict[str, torch.Tensor],
        counts: np.ndarray,
        positions: torch.Tensor,
        float_positions: Callable[[np.ndarray, int], torch.Tensor],
        encode: Callable[..., dict[str, torch.Tensor]],
    ) -> None:
        """Store the first counts[s] new tokens of each stream (data {name: (S, t, ...)}, k/v (S, t, g, D)).

        Float recipes append in place. Quantized recipes: the first tokens of an empty stream
        become sinks; then, once the float window holds ``recent + bs`` or more non-sink tokens,
        its oldest full blocks are encoded with ``encode(k (N, bs, g, D), v, rows (N,),
        positions (N, bs), ids (N,))`` (positions of new tokens: ``positions`` (S, t); of stored float
        tokens: ``float_positions(start (S,), width)``; ``ids``: the body pool rows allocated for the
        blocks, which ``encode`` may write in place; it returns the tensors it did not write) and
        only the rest stays in float.
        """
        if not self.layout.quantized:
            self.write_float(self.float_len, counts, data)
            return
        t = positions.shape[1]
        new_sinks, flush = self._append_split(counts)
        rest, rest_pos = data, positions
        if new_sinks.any():
            self.write_float(self.n_sink, new_sinks, data)
            self._set("n_sink", self.n_sink + new_sinks)
            shift = (torch.arange(t, device=self.device)[None] + to_device(new_sinks, self.device)[:, None]).clamp(max=t - 1)
            rest = {name: _take(values, shift) for name, values in data.items()}
            rest_pos = _take(positions, shift)
        rest_count = counts - new_sinks
        old = self.float_len - self.n_sink  # non-sink float tokens held
        if flush.sum() == 0:
            self.write_float(self.float_len, rest_count, rest)
            return
        self._flush(rest, rest_pos, rest_count, old, flush, float_positions, encode)

    def _append_split(self, counts) -> tuple[np.ndarray, np.ndarray]:
        """(sinks made, blocks encoded) per stream (S,) when a quantized store appends ``counts`` tokens per stream."""
        empty = (self.float_len == self.n_sink) & (self.body_len == 0)
        new_sinks = np.minimum(np.maximum(self.layout.sink_tokens - self.n_sink, 0) * empty, counts)
        old = self.float_len - self.n_sink  # non-sink float tokens held (the new sinks do not change it)
        flush = np.maximum((old + counts - new_sinks - self.layout.recent_tokens) // self.bs, 0)
        return new_sinks, flush

    def flush_held(self, float_positions: Callable[[np.ndarray, int], torch.Tensor], encode: Callable[..., dict]) -> None:
        """Encode the oldest float blocks of streams holding ``recent_tokens + block_size`` or more non-sink float
        tokens, as `append` does after it writes: for a step whose token a kernel wrote into the float region itself
        (FastGen on the CPU kernel, which then evicted; `append` would have evicted first, then written and encoded
        the same blocks)."""
        zeros = np.zeros_like(self.float_len)
        _, flush = self._append_split(zeros)
        if not flush.any():
            return
        shapes = {"k": (self.layout.heads_per_stream, self.layout.head_dim), "v": (self.layout.heads_per_stream, self.layout.head_dim)}
        dtypes = {"k": torch.float32, "v": torch.float32, "pos": torch.int64}
        rest = {name: torch.empty((self.streams, 0, *shapes.get(name, ())), dtype=dtypes.get(name, META_DTYPES.get(name)),
                                  device=self.device) for name in ("k", "v", *self.layout.meta)}
        rest_pos = torch.empty((self.streams, 0), dtype=torch.int64, device=self.device)
        self._flush(rest, rest_pos, zeros, self.float_len - self.n_sink, flush, float_positions, encode)

    def appends_in_float(self, counts) -> bool:
        """Appending ``counts`` tokens per stream only writes float slots: no sink is made, no block encoded."""
        if not self.layout.quantized:
            return True
        new_sinks, flush = self._append_split(counts)
        return not (new_sinks.any() or flush.any())

    def _flush(self, rest, rest_pos, rest_count, old, flush, float_positions, encode) -> None:
        """Encode the oldest ``flush`` blocks of [held non-sink float tokens, new tokens]; rewrite the rest."""
        bs, t = self.bs, rest_pos.shape[1]
        width = int(old.max())
        names = list(rest)
        held = self.read_float_at(names, self.n_sink, width)
        held_pos = float_positions(self.n_sink, width)
        total = old + rest_count
        v = torch.arange(int(total.max()), device=self.device)[None]
        old_t = to_device(old, self.device)[:, None]
        column = torch.where(v < old_t, v, width + v - old_t).clamp(max=width + t - 1)  # -> cat([held, new])
        joined = {name: torch.cat([held[name].to(rest[name].dtype), rest[name]], dim=1) for name in names}  # float8: widened
        joined_pos = torch.cat([held_pos.long(), rest_pos.long()], dim=1)
        rows_np, block_np = _pairs(flush)
        rows = to_device(rows_np, self.device)
        token = column[rows[:, None], to_device(block_np, self.device)[:, None] * bs + torch.arange(bs, device=self.device)]
        ids = self.body_pool.allocate(rows_np.shape[0])  # (N,) the new blocks' rows: an encode kernel writes them in place
        k, v, pos = joined["k"][rows[:, None], token], joined["v"][rows[:, None], token], joined_pos[rows[:, None], token]
        blocks = encode(k, v, rows, pos, ids)  # what it did not write in place
        meta = {name: joined[name][rows[:, None], token] for name in self.layout.meta}
        self.add_body_blocks(rows_np, {**blocks, **meta}, ids)
        remain = total - flush * bs  # the rest stays in the float window
        keep_cols = to_device(flush * bs, self.device)[:, None] + torch.arange(max(int(remain.max()), 1), device=self.device)
        kept = column.gather(1, keep_cols.clamp(max=column.shape[1] - 1))
        self.write_float(self.n_sink, remain, {name: _take(values, kept) for name, values in joined.items()})
        self._release_float_beyond(self.n_sink + remain)

    # --- body --------------------------------------------------------------------------------------
    def add_body_blocks(self, rows: np.ndarray, blocks: dict[str, torch.Tensor], ids: torch.Tensor | None = None) -> None:
        """Append encoded blocks: rows (N,) stream of each block (grouped per stream, in token order).

        ids: (N,) pool rows already allocated for them (tensors not in ``blocks`` were written there in place).
        """
        n = rows.shape[0]
        if n == 0:
            return
        ids = self.body_pool.allocate(n) if ids is None else ids
        for name, values in blocks.items():
            self.body_pool.tensors[name][ids] = values.to(self.body_pool.tensors[name].dtype)
        counts = np.bincount(rows, minlength=self.streams)
        _, rank = _pairs(counts)
        column = self.body_len[rows] + rank
        self.body_table = _grow_columns(self.body_table, int((self.body_len + counts).max()))
        self.body_table[to_device(rows, self.device), to_device(column, self.device)] = ids.to(torch.int32)
        self._set("body_len", self.body_len + counts)

    # --- eviction of ordered regions (quantized streams) --------------------------------------------
    def keep(self, keep_float: torch.Tensor | None, keep_body: torch.Tensor | None) -> None:
        """Free what is not kept: float slots (S, F) one by one (compacting in order), body blocks (S, Bn) whole."""
        if keep_body is not None and self.body_pool is not None and keep_body.shape[1]:
            cols = torch.arange(keep_body.shape[1], device=self.device)
            held = cols < self.lengths("body_len")[:, None]
            keep_body = keep_body & held
            table = self.body_table[:, : keep_body.shape[1]]
            self.body_pool.release(table[held & ~keep_body].long())
            order = torch.sort((~keep_body).to(torch.int8), dim=1, stable=True).indices  # kept columns first, in order
            body_len = keep_body.sum(dim=1)
            self.body_table[:, : keep_body.shape[1]] = table.gather(1, order).masked_fill(cols >= body_len[:, None], 0)
            self._set("body_len", body_len.cpu().numpy())
            self.shrink()
        if keep_float is None or keep_float.shape[1] == 0:
            return
        width = keep_float.shape[1]
        slots = torch.arange(width, device=self.device)
        keep_float = keep_float & (slots < self.lengths("float_len")[:, None])
        self._set("n_sink", (keep_float & (slots < self.lengths("n_sink")[:, None])).sum(dim=1).cpu().numpy())
        order = torch.sort((~keep_float).to(torch.int8), dim=1, stable=True).indices  # kept slots first, in order
        new_len = keep_float.sum(dim=1).cpu().numpy()
        ids = self.float_slot_ids(order)
        data = {name: take_rows(self.float_flat(name), ids) for name in self.slot_names}
        self.write_float(np.zeros_like(new_len), new_len, data)
        self._release_float_beyond(new_len)

    # --- batch -----------------------------------------------------------------------------------------
    def select_streams(self, rows: torch.Tensor) -> None:
        """Streams become ``rows`` (S',) of the old ones (beams, finished sequences): duplicates are copied."""
        rows_np = rows.cpu().numpy().astype(np.int64)
        old = self.streams
        _, first_index = np.unique(rows_np, return_index=True)
        first = np.zeros(rows_np.shape[0], dtype=bool)
        first[first_index] = True
        unselected = np.ones(old, dtype=bool)
        unselected[rows_np] = False
        pools = [(self.float_pool, "float_table", self.float_blocks())]
        if self.body_pool is not None:
            pools.append((self.body_pool, "body_table", self.body_len))
        rows_t = to_device(rows_np, self.device)
        for pool, attr, blocks in pools:
            table = getattr(self, attr)
            self._release_rows(pool, table, blocks, unselected)
            setattr(self, attr, self._copy_duplicates(pool, table[rows_t], blocks[rows_np], ~first))
        for name in LENGTHS:
            self._set(name, getattr(self, name)[rows_np])
        self.shrink()

    def _release_rows(self, pool: BlockPool, table: torch.Tensor, blocks: np.ndarray, rows: np.ndarray) -> None:
        counts = np.where(rows, blocks, 0)
        if counts.sum():
            r, j = _pairs(counts)
            pool.release(table[to_device(r, self.device), to_device(j, self.device)].long())

    def _copy_duplicates(self, pool: BlockPool, table: torch.Tensor, blocks: np.ndarray, dup: np.ndarray) -> torch.Tensor:
        """Give rows marked ``dup`` fresh copies of their blocks."""
        counts = np.where(dup, blocks, 0)
        n = int(counts.sum())
        if n == 0:
            return table
        table = table.clone()
        r, j = _pairs(counts)
        r_t, j_t = to_device(r, self.device), to_device(j, self.device)
        source = table[r_t, j_t].long()
        ids = pool.allocate(n)
        for t in pool.tensors.values():
            t[ids] = t[source]
        table[r_t, j_t] = ids.to(torch.int32)
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
