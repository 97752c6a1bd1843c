"""CPU decode attention over the paged store in one compiled call per layer (Numba), reading blocks in place.

Why: on a CPU the torch path (`paged_attention.py` with the methods' ``chunk_*``) spends most of a decode step in
the dispatch of many small tensor operations per layer (about a hundred for a KIVI store), not in arithmetic. This
kernel walks one layer's store in a single call: no float copy of the cache is ever made (a body block is unpacked
into one small float32 tile at a time, in cache), and the layer costs one dispatch.

What it reads (the layout of `kvtool.runtime.store`, as the Triton kernels do):

* float blocks: ``float_k`` / ``float_v`` (cap, FBS, D) float16 or bfloat16 bit patterns (uint16), ``float_table``
  (S, F) int32 block ids, ``float_len`` (S,) tokens;
* body blocks of **uniform** codes (KIVI): ``codes`` (cap, BS * bits / 8, D) uint8, bit-sliced and token-split
  (`kvtool.methods.quant.packing`), fp16 ``scale`` / ``zero`` per channel ((cap, D): ``x = code * scale + zero``
  per channel of a block) or per token group ((cap, BS, D / group)); ``body_table`` (S, Bn) int32, ``body_len``
  (S,) blocks. Keys after RoPE only (pre-RoPE keys, other formats, scored eviction, sliding windows: torch).

Per stream (one sequence x one KV head): R query rows (its GQA group, already scaled), two passes over the held
tokens (body blocks, then the float region's slots, then this step's own token: the order does not change the
sums); optional soft-capping (Gemma 2) and learned sink logits (gpt-oss). Scores of a stream are kept whole
(R x tokens float32), so the softmax is not online; its exp is a vectorized polynomial (about 1 ulp) and weights
under e^-60 of the largest are dropped (relative contribution < 1e-26). With ``write`` the call also stores the
step's token in each stream's next float slot. Streams run in parallel (`prange`, one stream per task) on as
many threads as torch uses.

The pure-torch reference is the store's torch path; `tests/test_cpu_decode.py` compares the two over formats,
bits, GQA ratios and ragged lengths (empty and one-token streams included).
"""

from __future__ import annotations

import functools
import importlib.util
import threading

import numpy as np
import torch

from kvtool.methods.quant.packing import slice_widths

FLOAT_DTYPES = (torch.float16, torch.bfloat16)  # the float pool dtypes the kernel reads


def numba_available() -> bool:
    return importlib.util.find_spec("numba") is not None


def covers(formats, float_dtype: torch.dtype, head_dim: int) -> str | None:
    """Why this kernel cannot read a store (None when it can): formats None = float blocks only."""
    if float_dtype not in FLOAT_DTYPES:
        return f"the float blocks are {str(float_dtype).replace('torch.', '')} (the CPU kernel reads float16 and bfloat16)"
    if formats is None:
        return None
    for fmt, side in zip(formats, ("keys", "values")):
        if not fmt.uniform:
            return f"{side}: the CPU kernel reads uniform (KIVI) codes only"
        if fmt.scales == "token" and head_dim % fmt.group:
            return f"{side}: per-token groups of {fmt.group} channels do not tile head_dim {head_dim}"
    return None


@functools.lru_cache(maxsize=None)
def _half_table() -> np.ndarray:
    """(65536,) float32: the value of every float16 bit pattern."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _widths(bits: int) -> np.ndarray:
    """(4,) int64 slice widths of ``bits``-bit codes, lowest bits first, padded with 0 (built once per width: asked
    at every decode step; never written)."""
    out = np.zeros(4, dtype=np.int64)
    widths = slice_widths(bits)
    out[: len(widths)] = widths
    return out


def _u16(t: torch.Tensor) -> np.ndarray:
    """A 16-bit float tensor's bit patterns as a numpy uint16 view (no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)


@functools.lru_cache(maxsize=None)
def _kernel():
    """The compiled kernel (Numba imported on first use; compiled once, then loaded from the on-disk cache).

    Numba's ``workqueue`` threads unless NUMBA_THREADING_LAYER says otherwise: OpenMP worker threads spin after each
    parallel region and would take the cores from torch's own threads between two layers."""
    import os

    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"
    from kvtool.runtime.kernels.cpu_decode_kernel import decode

    return decode


_THREADS = [0]  # the thread count last given to Numba
_ONE_AT_A_TIME = threading.Lock()  # Numba's workqueue threads abort the process if two Python threads launch at once


def _follow_torch_threads() -> None:
    """Run the kernel's streams on as many threads as torch uses (``torch.set_num_threads`` / OMP_NUM_THREADS), so a
    process that limits torch limits the kernel too (and workers sharing a machine do not oversubscribe it)."""
    want = torch.get_num_threads()
    if want != _THREADS[0]:
        import numba

        numba.set_num_threads(max(1, min(want, numba.config.NUMBA_NUM_THREADS)))
        _THREADS[0] = want


@functools.lru_cache(maxsize=None)
def _no_side() -> tuple:
    """The placeholder arguments of a store with no body (never read, never written; built once)."""
    empty8, empty16 = np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1), np.uint16)
    return empty8, empty16, empty16, _widths(8), True, 1


def _side_arrays(side: dict | None, fmt):
    """(codes uint8 3-D, scale uint16 2-D, zero uint16 2-D, widths, per_channel, group) of one body side."""
    if side is None:
        return _no_side()
    codes = side["codes"].numpy()
    cap = codes.shape[0]
    scale = _u16(side["scale"]).reshape(cap, -1)
    zero = _u16(side["zero"]).reshape(cap, -1)
    return codes, scale, zero, _widths(fmt.bits), fmt.scales == "channel", int(fmt.group)


def cpu_decode_attention(
    q: torch.Tensor,  # (S, R, D) float32, already multiplied by the softmax scale
    new_k: torch.Tensor,  # (S, D) float32: this step's token, attended to by every row
    new_v: torch.Tensor,  # (S, D) float32
    float_k: torch.Tensor,  # (cap, FBS, D) float16 / bfloat16 float pool (one head per stream)
    float_v: torch.Tensor,
    float_table: torch.Tensor,  # (S, F) int32
    float_len: np.ndarray,  # (S,) int64 tokens (the store's host lengths)
    body: tuple[dict, dict] | None = None,  # key and value body-pool tensors {name: (cap, ...)}
    body_table: torch.Tensor | None = None,  # (S, Bn) int32
    body_len: np.ndarray | None = None,  # (S,) int64 blocks
    formats=None,  # (key, value) `BodyFormat`
    block_size: int = 0,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,  # (S, R) learned sink logits
    write: bool = False,  # also write new_k / new_v (rounded to the pool's dtype) into each stream's next float slot
) -> torch.Tensor:
    """Attention output (S, R, D) float32 of one decode step over the paged store, on CPU tensors.

    With ``write`` the caller guarantees that slot ``float_len[s]`` of every stream lies in a float block the stream
    already has (`LayerStore.quiet_appends`), and counts the token afterwards (`LayerStore.appended_one`)."""
    s, r, d = q.shape
    q_np = q.contiguous().float().numpy()
    out = np.empty((s, r, d), dtype=np.float32)
    has_body = body is not None and body_table is not None and body_table.shape[1] > 0 and body_len is not None
    ftable = float_table.numpy() if float_table.shape[1] else np.zeros((s, 1), np.int32)
    if has_body:
        btable, blen = body_table.numpy(), np.ascontiguousarray(body_len, dtype=np.int64)
        k_side, v_side = _side_arrays(body[0], formats[0]), _side_arrays(body[1], formats[1])
    else:
        btable, blen = np.zeros((s, 1), np.int32), np.zeros(s, np.int64)
        k_side = v_side = _side_arrays(None, None)
    sinks = sink_logits.float().contiguous().numpy() if sink_logits is not None else np.zeros((1, 1), np.float32)
    new_k_np, new_v_np = new_k.contiguous().float().numpy(), new_v.contiguous().float().numpy()
    if not write:
        new_bits = np.zeros((2, 1, 1), np.uint16)
    elif float_k.dtype == torch.float16:  # numpy rounds to nearest even, as torch's cast does
        new_bits = np.stack((new_k_np, new_v_np)).astype(np.float16).view(np.uint16)
    else:
        new_bits = _u16(torch.stack((new_k, new_v)).to(float_k.dtype))
    kernel = _kernel()
    with _ONE_AT_A_TIME:
        _follow_torch_threads()
        kernel(
            q_np, new_k_np, new_v_np, _u16(float_k), _u16(float_v),
            ftable, np.ascontiguousarray(float_len, dtype=np.int64), btable, blen,
            *k_side, *v_side, int(block_size or 1), int(float_k.shape[1]), _half_table(), float_k.dtype == torch.bfloat16,
            float(softcap or 0.0), sinks, sink_logits is not None, new_bits, bool(write), out,
        )
    return torch.from_numpy(out)
