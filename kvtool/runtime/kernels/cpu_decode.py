"""CPU decode attention over the paged store in one compiled call per layer (Numba), reading blocks in place.

Why: on a CPU the torch path (`paged_attention.py` with the methods' ``chunk_*``) spends most of a decode step in
the dispatch of many small tensor operations per layer (about a hundred for a KIVI store), not in arithmetic. This
kernel walks one layer's store in a single call: no float copy of the cache is ever made (a body block is unpacked
into one small float32 tile at a time, in cache), and the layer costs one dispatch.

What it reads (the layout of `kvtool.runtime.store`, as the Triton kernels do):

* float blocks: ``float_k`` / ``float_v`` (cap, FBS, D) float16 or bfloat16 bit patterns (uint16), float8 e4m3
  bytes (uint8), or int8 codes with ``float_ks`` / ``float_vs`` (cap, FBS, D / G) float16 scales, one per G
  channels of a token; ``float_table`` (S, F) int32 block ids, ``float_len`` (S,) tokens;
* body blocks of integer codes: ``codes`` (cap, BS * bits / 8, D) uint8, bit-sliced and token-split
  (`kvtool.methods.quant.packing`), with fp16 ``scale`` / ``zero`` per channel ((cap, D): ``x = code * scale +
  zero`` per channel of a block) or per token group ((cap, BS, D / group)) (uniform, KIVI), or calibrated float32
  tables ``static_scale`` / ``static_zero`` (rows 1 or H_kv, columns 1 or D; int_static); or nuq codes (KVQuant):
  ``codes`` as above read as indices into the layer's ``codebook`` (L,) float32, scaled by calibrated per-channel
  tables (keys) or fp16 scale and zero per token group (values), with ``outlier_index`` (cap, k) int16 flat positions
  minus 32768 and ``outlier_value`` (cap, k) fp16 (k sparse values per block, each replacing the dense value at its
  position; `kvtool.methods.quant.outliers`); or fp8 e4m3 / e5m2 bytes
  (cap, BS, D) with one float32 ``scale`` per block or a calibrated table (fp8); ``body_table`` (S, Bn) int32, ``body_len``
  (S,) blocks; ``score`` (cap, FBS) / (cap, BS) float32 and ``pos`` (cap, FBS) int32 per slot when the store
  keeps them (evicting recipes); or TurboQuant blocks on both sides (codebook codes of rotated unit vectors with fp16
  norms, one instance or the outlier split's two, no QJL residual: `cpu_decode_rotated.py`). Body keys stored before
  RoPE (KVQuant's ``keys.pre_rope``) are decoded and rotated at their true positions (the pool's ``pos``, the
  sequence's recorded positions, or the token index) with cos / sin tables computed as the torch path does
  (`rope_tables`); other formats: torch. A sliding-window
  layer's store keeps ``pos`` per slot (float and body pools): tokens at positions <= the query's - W are not
  attended (the window's rule frees body blocks whole, so the oldest held block may be partly outside).

Per stream (one sequence x one KV head): R query rows (its GQA group, already scaled), two passes over the held
tokens (body blocks, then the float region's slots, then this step's own token: the order does not change the
sums); optional soft-capping (Gemma 2) and learned sink logits (gpt-oss). A stream's tokens may be cut into parts
of whole blocks (flash-decoding: each part's softmax maximum, sum and weighted values, merged per stream), which
only matters when a step is spread over threads. Exp is a vectorized polynomial (about 1 ulp); weights under e^-60
of a part's largest are dropped (relative contribution < 1e-26). With ``write`` the call also stores the step's token in each
stream's next float slot (with its position, and its score when the store keeps scores); with ``scoring`` every
held slot's score grows by the attention it received (H2O, TOVA, SnapKV, ... between their cuts). One thread, or
torch's OpenMP threads for a large step (see `cpu_decode_attention`).

The pure-torch reference is the store's torch path; `tests/test_cpu_decode.py` compares the two over formats,
bits, GQA ratios and ragged lengths (empty and one-token streams included).
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import weakref

import numpy as np
import torch

from kvtool.methods.quant.packing import slice_widths
from kvtool.runtime.kernels.body_format import BFLOAT16, FLOAT8_E4M3, FLOAT16, INT8_SCALED, NORM_MODES
from kvtool.runtime.kernels.openmp_team import openmp_team
from kvtool.runtime.store import INT8_SLOTS, int8_slots_on_host, to_float_slots

FLOAT_KINDS = {  # pool dtypes read
    torch.float16: FLOAT16, torch.bfloat16: BFLOAT16, torch.float8_e4m3fn: FLOAT8_E4M3, INT8_SLOTS: INT8_SCALED,
}


def numba_available() -> bool:
    return importlib.util.find_spec("numba") is not None


def reads(fmt) -> bool:
    """The kernel's plain read (`cpu_decode_kernel.py`) takes this body format: integer codes (uniform / KIVI with fp16
    scale and zero per channel or per token group; int_static with calibrated tables) or fp8 e4m3 / e5m2 bytes (one
    float32 scale per block, or calibrated per layer / KV head), with no codebook, outliers, latents, rotation, split or
    QJL residual (TurboQuant's rotated codes: `reads_rotated`)."""
    plain = not fmt.levels and not fmt.outliers and not fmt.rank and not fmt.rotated and not fmt.split and not fmt.qjl
    return plain and fmt.bits < 16 and (fmt.uniform or fmt.scales in ("block", "static"))


def reads_nuq(fmt) -> bool:
    """The kernel's plain read also takes KVQuant's (nuq) codes: integer codes into a codebook of up to 256 levels,
    scaled by calibrated per-channel tables (keys) or fp16 scale and zero per token group (values), with or without
    sparse outliers (fp16 values at int16 positions, one set per block)."""
    others = not fmt.rank and not fmt.rotated and not fmt.split and not fmt.qjl and not fmt.fp8
    return others and 0 < fmt.levels <= 256 and fmt.bits <= 8 and fmt.zero and fmt.scales in ("static", "token")


def reads_rotated(fmt) -> bool:
    """The kernel reads this body format as TurboQuant's (`cpu_decode_rotated.py`): codebook codes of rotated unit
    vectors with a norm per token (fp16, or 8-bit log codes over the block's range), one instance or the outlier
    split's two, without the QJL residual."""
    return fmt.scales in NORM_MODES and (fmt.rotated or fmt.split > 0) and not fmt.qjl and not fmt.rank and not fmt.outliers


def covers(formats, float_dtype: torch.dtype, head_dim: int) -> str | None:
    """Why this kernel cannot read a store (None when it can): formats None = float blocks only."""
    if float_dtype not in FLOAT_KINDS:
        return (f"the float blocks are {str(float_dtype).replace('torch.', '')} (the CPU kernel reads float16, bfloat16, "
                "float8_e4m3 and int8)")
    if formats is None:
        return None
    rotated = [reads_rotated(fmt) for fmt in formats]
    if all(rotated):
        return None
    if any(rotated):
        return "TurboQuant on one side only (the CPU kernel reads TurboQuant keys with TurboQuant values)"
    for fmt, side in zip(formats, ("keys", "values")):
        if not (reads(fmt) or reads_nuq(fmt)):
            return (f"{side}: the CPU kernel reads uniform (KIVI), int_static, fp8, nuq (KVQuant) and TurboQuant (without "
                    "QJL) codes only")
        if fmt.scales == "token" and head_dim % fmt.group:
            return f"{side}: per-token groups of {fmt.group} channels do not tile head_dim {head_dim}"
    return None


@functools.lru_cache(maxsize=None)
def slice_width_table(bits: int) -> np.ndarray:
    """(4,) int64 slice widths of ``bits``-bit codes, lowest bits first, padded with 0 (built once per width: asked
    at every decode step; never written)."""
    out = np.zeros(4, dtype=np.int64)
    widths = slice_widths(bits)
    out[: len(widths)] = widths
    return out


def _u16(t: torch.Tensor) -> np.ndarray:
    """A 16-bit float tensor's bit patterns as a numpy uint16 view (no copy); a float8 tensor's bytes and int8 codes
    as uint8 (the kernel reads int8 codes back as signed): one array type per width, so the kernel is compiled for
    two pool types rather than one per format (each compiled signature costs seconds on first use)."""
    if t.element_size() == 1:
        return t.view(torch.uint8).numpy()
    return t.view(torch.int16).numpy().view(np.uint16)


_VIEWS: dict[tuple[int, str], tuple] = {}  # (id(tensor), kind) -> (weak reference to the tensor, its numpy view)


def _held_view(t: torch.Tensor, kind: str = "") -> np.ndarray:
    """The numpy view of a store tensor (a pool tensor, a block table), made once per tensor object: they live for
    many steps (a pool that grows gets new tensors), and making views costs microseconds per call and layer.
    ``kind``: "" as is, "u16" the bit patterns of a 16-bit float tensor (a float8 one's bytes), "rows" the same
    flattened per pool row, "bytes" any tensor's bytes (uint8) flattened per pool row, "2d" any other tensor
    flattened per row, "3d" a float pool (cap, FBS, 1, D) as (cap, FBS, D).

    A view holds the tensor's memory, so its entry goes the moment the tensor object does (a weak reference's
    callback): a grown pool's old rows and a finished cache's blocks are freed as before."""
    key = (id(t), kind)
    entry = _VIEWS.get(key)
    if entry is not None and entry[0]() is t:
        return entry[1]
    if kind == "bytes":
        view = t.view(torch.uint8).numpy()
    else:
        view = _u16(t) if kind in ("u16", "rows", "3d") else t.numpy()
    if kind in ("rows", "2d", "bytes"):  # explicit sizes: an empty pool (no rows yet) has no -1 to infer
        view = view.reshape(view.shape[0], int(np.prod(view.shape[1:])))
    elif kind == "3d":
        view = view.reshape(view.shape[0], view.shape[1], int(np.prod(view.shape[2:])))

    def forget(ref, key=key):
        if _VIEWS.get(key, (None,))[0] is ref:
            _VIEWS.pop(key, None)

    _VIEWS[key] = (weakref.ref(t, forget), view)
    return view


@functools.lru_cache(maxsize=None)
def _kernel():
    """The compiled kernel (Numba imported on first use; compiled once, then loaded from the on-disk cache): per body
    kind (TurboQuant's rotated one or not), the step (on one thread or torch's OpenMP team) and the work items a step
    spread over Python threads runs."""
    from kvtool.runtime.kernels.cpu_decode_kernel import attend_items, combine_streams, decode_step, part_scratch
    from kvtool.runtime.kernels.cpu_decode_rotated import attend_items_rotated, decode_rotated_step

    return {False: (decode_step, attend_items), True: (decode_rotated_step, attend_items_rotated),
            "scratch": part_scratch, "combine": combine_streams}


# A step spreads over torch's threads from this much work (held tokens x query rows x head_dim over the streams):
# SmolLM2-135M at batch 1 reads 0.3M at 512 tokens (3 streams x 512 x 3 x 64), where one thread and two tie, and 0.6M
# at 1K, where two gain (RESULTS.md, "The CPU kernel on torch's OpenMP threads").
SPREAD_MIN_WORK = 1 << 19
_ONE_AT_A_TIME = threading.Lock()  # one step at a time: the threads of a step share the pool below
_POOL: list = [None, 0]  # a thread pool of a step's helper threads, and its size (made again when torch's count changes)


def _helper_threads(count: int):
    """A pool of ``count`` threads for a step's items (kept between steps: starting threads costs more than a step's
    work on a small model)."""
    if _POOL[1] != count:
        from concurrent.futures import ThreadPoolExecutor

        if _POOL[0] is not None:
            _POOL[0].shutdown(wait=False)
        _POOL[0], _POOL[1] = ThreadPoolExecutor(count, thread_name_prefix="kvtool-cpu-decode"), count
    return _POOL[0]


def _item_ranges(streams: int, parts: int, threads: int) -> np.ndarray:
    """(N, 2) int64: a step's (stream, part) items cut into ``threads`` contiguous ranges [first, last), empty ones
    left out."""
    total = streams * parts
    bounds = [total * i // threads for i in range(threads + 1)]
    return np.array([(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dtype=np.int64).reshape(-1, 2)


@functools.lru_cache(maxsize=None)
def _no_team() -> tuple:
    """`decode_step`'s team arguments of a step on one thread: no addresses, one thread, no ranges (built once)."""
    return (0, 0, 0), 1, np.zeros((1, 2), np.int64)


def _decode_on_python_threads(kernels: dict, rotated: bool, threads: int, args: tuple, scratch: tuple) -> None:
    """A decode step spread where torch has no OpenMP team (``parallel=True``): its items cut into ``threads`` ranges,
    run at once on this thread and helper threads (the compiled items release the GIL), then every stream's merge
    here. ``args`` and ``scratch`` are `decode_step`'s."""
    (q, new_k, new_v, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
     k_side, v_side, rope, window, bs, float_kind, softcap, sink_logits, has_sink, new_bits, write, float_score,
     body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts, out) = args
    weights, part_max, part_sum, part_acc = scratch
    items = kernels[rotated][1]
    shared = (q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head, k_side,
              v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc)
    ranges = _item_ranges(q.shape[0], parts, threads).tolist()
    helpers = [_helper_threads(threads - 1).submit(items, a, b, *shared) for a, b in ranges[1:]]
    if ranges:
        items(*ranges[0], *shared)
    for done in helpers:
        done.result()
    kernels["combine"](
        q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len, bs, softcap, sink_logits,
        has_sink, new_bits, write, float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts,
        weights, part_max, part_sum, part_acc, out,
    )


MODES = {"channel": 1, "token": 2, "block": 3, "static": 4}  # the kernel's scale modes (`side_vectors`)


@functools.lru_cache(maxsize=None)
def _no_side() -> tuple:
    """The placeholder side of a store with no body (never read; built once)."""
    empty8, empty16, empty32 = np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.float32)
    no_levels, no_outliers = np.zeros(0, np.float32), np.zeros((1, 0), np.uint16)
    return (empty8, empty16, empty16, slice_width_table(8), 1, 1, 0, 0, empty32, empty32, True, no_levels, no_outliers,
            no_outliers)


def _rotated_side(side: dict, fmt) -> tuple:
    """A TurboQuant side as `cpu_decode_rotated` takes it: (outlier channels d_o (0: no split), outlier codes, codes
    (cap, rows, d) uint8, outlier norms, norms (cap, 2 BS) uint8 (fp16 norms' bytes) or (cap, BS + 4) uint8 8-bit
    codes, outlier masks (cap, D / 8) uint8, outlier codebook, codebook float32, outlier rotation (d_o, d_o), rotation (d_r, d_r) float32, their Hadamard signs
    (a ``split_rotation: kronecker`` instance's rotation as its m x m factor beside its signs, `_fast_rotation`),
    outlier slice widths, slice widths, query scale (H_kv, D) float32 of keys with ``channel_scale: query``, else
    (0, D), and whether the masks are one per KV head (``outlier_channels: calibrated``: (H_kv, D / 8), read at the
    stream's head) rather than one per block); the outlier entries are placeholders without a split."""
    codes = _held_view(side["codes"])
    d_o, d_r = int(fmt.split), codes.shape[2]
    norm_view = "bytes" if fmt.scales == "norm" else "2d"  # fp16 norms' bytes, or 8-bit codes then the block's range
    norm = _held_view(side["norm"], norm_view)
    book = side["codebook"].numpy()
    if d_o == 0:
        placeholder = _no_side()  # the outlier instance's entries: never read (built once)
        empty8, empty32 = placeholder[0], placeholder[8]
        rotation = side["rotation"].numpy()
        return (0, empty8, codes, empty8[0], norm, empty8[0], empty32[0], book, empty32, rotation, empty32[0, :0],
                _signs(rotation), slice_width_table(1), slice_width_table(fmt.bits), _query_scale(side, codes.shape[2]), False)
    tables = side["split_tables"].numpy()  # outlier codebook, then P_o and P_r flattened
    levels = 2**fmt.split_bits
    rot_o = tables[levels : levels + d_o * d_o].reshape(d_o, d_o)
    rot_r = tables[levels + d_o * d_o : levels + d_o * d_o + d_r * d_r].reshape(d_r, d_r)
    (rot_o, signs_o), (rot_r, signs_r) = _fast_rotation(rot_o), _fast_rotation(rot_r)
    return (d_o, _held_view(side["outlier_codes"]), codes, _held_view(side["outlier_norm"], norm_view), norm,
            _held_view(side["outlier_mask"], "2d"), tables[:levels], book, rot_o, rot_r, signs_o, signs_r,
            slice_width_table(fmt.split_bits), slice_width_table(fmt.bits), _query_scale(side, d_o + d_r), bool(fmt.static_mask))


def _query_scale(side: dict, d: int) -> np.ndarray:
    """(H_kv, D) float32 ``channel_scale`` of TurboQuant keys with ``channel_scale: query``, else (0, D): none."""
    scale = side.get("channel_scale")
    return scale.numpy() if scale is not None else np.zeros((0, d), np.float32)


_SIGNS: dict[bytes, np.ndarray] = {}  # a rotation's first row -> its Hadamard signs (or none)


def _signs(rotation: np.ndarray) -> np.ndarray:
    """(d,) float32 s / sqrt(d) when the rotation (d, d) is H diag(s) (TurboQuant's randomized Hadamard rotation of a
    power-of-two instance, d >= 8; the kernel then runs the fast transform, unnormalized), else (0,): the matrix is
    read. Found once per rotation, keyed by its first row (H diag(s) is determined by it; a Haar-random matrix's first
    row is never +-1 / sqrt(d) throughout), so the cache holds a few small arrays, never a model's tensors."""
    key = rotation[0].tobytes()
    signs = _SIGNS.get(key)
    if signs is not None:
        return signs
    from kvtool.methods.lowrank.hadamard import hadamard_matrix, is_power_of_two

    d = rotation.shape[0]
    signs = np.zeros(0, np.float32)
    if d >= 8 and is_power_of_two(d):
        candidate = np.sign(rotation[0]).astype(np.float32)  # H's first row is constant
        if np.allclose(rotation, hadamard_matrix(d).numpy() * candidate[None, :], atol=1e-6):
            signs = (candidate / np.sqrt(np.float32(d))).astype(np.float32)
    _SIGNS[key] = signs
    return signs


_KRONECKER: dict[bytes, tuple[np.ndarray | None, np.ndarray]] = {}  # a rotation's first row and M grid -> (M or None, signs)


def _fast_rotation(rotation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(matrix, signs) of a split instance's rotation P (d, d) as the kernel reads it: H diag(s) (a power of two):
    (P, s / sqrt(d)), the fast transform; (M kron H_n) diag(s) (``split_rotation: kronecker``, `kronecker_orthogonal`):
    (M (m, m), s / sqrt(n)), m fast transforms of n and one m x m product per column; else (P, (0,)): the dense
    product. The Kronecker form is recovered from P itself (signs from its first row, with M's first-row signs folded
    in; M from P's entries at multiples of n) and checked against it whole, once: cached by the first row and the
    entries at multiples of n (n = d & -d), which determine either form (the cache keeps the verdict, never P: the
    matrix returned is the caller's); a step pays one lookup per side."""
    d = rotation.shape[0]
    n = d & -d  # the largest power of two dividing d (d itself for a power of two)
    key = rotation[0].tobytes() + rotation[::n, ::n].tobytes()
    found = _KRONECKER.get(key)
    if found is None:
        found = _KRONECKER[key] = _find_kronecker(rotation, n)
    mix, signs = found
    return (rotation if mix is None else mix), signs


def _find_kronecker(rotation: np.ndarray, n: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(M, s / sqrt(n)) when P = (M kron H_n) diag(s), else (None, `_signs(P)`): see `_fast_rotation`."""
    from kvtool.methods.lowrank.hadamard import hadamard_matrix

    d = rotation.shape[0]
    m = d // n
    signs = _signs(rotation)
    found = (None, signs)
    if signs.shape[0] != d and n >= 8 and m > 1:
        s = np.sign(rotation[0]).astype(np.float32)
        if np.all(s != 0):
            mix = (rotation[::n, ::n] * np.float32(np.sqrt(n)) / s[None, ::n]).astype(np.float32)  # (m, m)
            if np.allclose(rotation, np.kron(mix, hadamard_matrix(n).numpy()) * s[None, :], atol=1e-5):
                found = (np.ascontiguousarray(mix), (s / np.sqrt(np.float32(n))).astype(np.float32))
    return found


_SIDES: dict[int, tuple] = {}  # id of a TurboQuant side's codes tensor -> (weak refs to its tensors, format, arrays)


def _held_rotated_side(side: dict, fmt) -> tuple:
    """`_rotated_side`, made once per set of side tensors and format: a layer reads the same pool tensors and
    rotations for many steps (a grown pool has new ones), and finding a rotation's fast form keys on its bytes
    (measured inside SmolLM2-135M: 25 us per side and step made each time, 11 us held; a plain side's `_side_arrays`
    costs 9 us either way and is made each time). Weak references, as in `_held_view`: an entry never keeps a tensor
    alive, and goes with its codes."""
    values = tuple(side.values())
    key = id(side["codes"])
    entry = _SIDES.get(key)
    if entry is not None and entry[1] is fmt and len(entry[0]) == len(values) and all(
        ref() is v for ref, v in zip(entry[0], values)
    ):
        return entry[2]
    arrays = _rotated_side(side, fmt)
    codes_at = list(side).index("codes")

    def forget(ref, key=key, codes_at=codes_at):  # (holds no tensor, nor the side)
        held = _SIDES.get(key)
        if held is not None and held[0][codes_at] is ref:
            _SIDES.pop(key, None)

    refs = tuple(weakref.ref(v, forget) if i == codes_at else weakref.ref(v) for i, v in enumerate(values))
    _SIDES[key] = (refs, fmt, arrays)
    return arrays


def _side_arrays(side: dict | None, fmt) -> tuple:
    """One body side as the kernel takes it: (codes uint8 (cap, rows, D), fp16 scale / zero bits (cap, n) or
    placeholders, slice widths, scale mode, token group, fp8 mantissa bits and bias (0, 0: integer codes), float32
    table (block scales (cap, 1), or the calibrated scale table), float32 zero table, has zero, nuq codebook (L,)
    float32 (L = 0: the codes are the values), outlier positions' int16 bits and values' float16 bits (cap, k) uint16
    (k = 0: none))."""
    if side is None:
        return _no_side()
    placeholder = _no_side()
    empty16, empty32 = placeholder[1], placeholder[8]
    levels, out_index, out_value = placeholder[11:]
    if fmt.levels:
        levels = side["codebook"].numpy()  # (L,) float32 (`kernel_tensors`)
    if fmt.outliers:
        out_index, out_value = _held_view(side["outlier_index"], "rows"), _held_view(side["outlier_value"], "rows")
    mode = MODES[fmt.scales]
    mantissa, bias = fmt.fp8_layout()
    codes = _held_view(side["codes"])
    scale16 = _held_view(side["scale"], "rows") if mode in (1, 2) else empty16
    zero16 = _held_view(side["zero"], "rows") if mode in (1, 2) else empty16
    if mode == 3:
        table = _held_view(side["scale"], "2d")  # (cap, 1)
    elif mode == 4:
        table = _held_view(side["static_scale"], "2d")  # (1 or H_kv, 1 or D)
    else:
        table = empty32
    table_zero = _held_view(side["static_zero"], "2d") if mode == 4 and fmt.zero else empty32
    return (codes, scale16, zero16, slice_width_table(fmt.bits if not mantissa else 8), mode, int(fmt.group), int(mantissa),
            int(bias), table, table_zero, bool(fmt.zero), levels, out_index, out_value)


@functools.lru_cache(maxsize=None)
def _no_rope() -> tuple:
    """The placeholder RoPE of a store whose body keys are stored after RoPE (never read; built once)."""
    empty = np.zeros((1, 1), np.float32)
    return (0, empty, empty, 0, False, np.zeros((1, 1), np.int32), np.zeros(1, np.int64), 1)


_ROPE_TABLES: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # (frequencies, scaling, layout) -> cos, sin (P, R)
ROPE_SOURCES = {"slots": 1, "sequence": 2, "tokens": 3}  # where the true positions of body tokens are read


def rope_tables(rope, needed: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (P, R) float32 of positions 0 .. P - 1 (P >= ``needed``) for a layer's RoPE (`BodyRope`), by the
    same operations as `RopeSpec.cos_sin` (float32 position x frequency, the model's layout, attention scaling), so a
    rotated key equals the torch path's. Kept per distinct RoPE (Gemma 3 has two) and grown by doubling: at 8K
    positions and head_dim 64 one table pair is 4 MB."""
    key = (rope.inv_freq.cpu().numpy().tobytes(), float(rope.scaling), bool(rope.interleaved))
    tables = _ROPE_TABLES.get(key)
    if tables is None or tables[0].shape[0] < needed:
        rows = max(1024, 1 << (max(needed, 1) - 1).bit_length())
        freqs = torch.arange(rows, dtype=torch.int64)[:, None].float() * rope.inv_freq.cpu().float()  # (P, R/2)
        emb = torch.repeat_interleave(freqs, 2, dim=-1) if rope.interleaved else torch.cat((freqs, freqs), dim=-1)
        tables = _ROPE_TABLES[key] = ((emb.cos() * rope.scaling).numpy(), (emb.sin() * rope.scaling).numpy())
    return tables


def _rope_arrays(rope, blen: np.ndarray, block_size: int) -> tuple:
    """A `BodyRope` as the kernel takes it: (source, cos (P, R), sin (P, R), rotary dim R, interleaved, positions
    int32 (slots: the pool's (cap, BS); sequence: (B, W); tokens: placeholder), n_sink (S,) int64, streams per
    sequence), the tables covering every position the call reads."""
    source = ROPE_SOURCES[rope.source]
    n_sink = rope.n_sink.cpu().numpy().astype(np.int64, copy=False) if rope.n_sink is not None else np.zeros(1, np.int64)
    if source == 3:
        positions = _no_rope()[5]
        needed = int((n_sink + blen * block_size).max()) if blen.shape[0] else 0
    else:
        positions = _held_view(rope.positions)
        needed = int(positions.max()) + 1 if positions.size else 0
    cos, sin = rope_tables(rope, needed)
    return (source, cos, sin, int(cos.shape[1]), bool(rope.interleaved), positions, n_sink, int(rope.streams_per_sequence))


def cpu_decode_attention(
    q: torch.Tensor | np.ndarray,  # (S, R, D) float32, already multiplied by the softmax scale (a tensor or host array)
    new_k: torch.Tensor | np.ndarray,  # (S, D) float32: this step's token, attended to by every row
    new_v: torch.Tensor | np.ndarray,  # (S, D) float32
    float_k: torch.Tensor,  # (cap, FBS, D) or (cap, FBS, 1, D) float16 / bfloat16 / float8 / int8 float pool (one head
    # per stream)
    float_v: torch.Tensor,
    float_table: torch.Tensor,  # (S, F) int32
    float_len: np.ndarray,  # (S,) int64 tokens (the store's host lengths)
    body: tuple[dict, dict] | None = None,  # key and value body-pool tensors {name: (cap, ...)} and static tables
    body_table: torch.Tensor | None = None,  # (S, Bn) int32
    body_len: np.ndarray | None = None,  # (S,) int64 blocks
    formats=None,  # (key, value) `BodyFormat`
    stream_head: torch.Tensor | None = None,  # (S,) KV head of each stream (per-head calibrated tables; default 0)
    block_size: int = 0,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,  # (S, R) learned sink logits
    write: bool = False,  # also write new_k / new_v (rounded to the pool's dtype) into each stream's next float slot
    scores: tuple | None = None,  # (float pool score (cap, FBS), body pool score (cap, BS) or None) float32
    scoring: bool = False,  # add this step's attention to the held slots' scores (else the new slot's score is 0)
    positions: tuple | None = None,  # (float pool pos (cap, FBS) int32, this step's position per sequence (B,))
    rope=None,  # `body_rope.BodyRope`: body keys stored before RoPE, rotated at their true positions in the kernel
    window: tuple | None = None,  # a sliding-window layer: (W, query position per stream (S,), float pool pos
    # (cap, FBS) int32, body pool pos (cap, BS) int32 or None); held tokens at positions <= query - W are not attended
    parallel: bool | None = None,  # spread the work over torch's threads: None when it is large enough (see below)
    parts: int | None = None,  # pieces each stream's tokens are cut into (None: 1; spread, enough for every thread)
    float_scales: tuple | None = None,  # int8 float pools: (key, value) scales (cap, FBS[, 1], D / G) float16
) -> torch.Tensor:
    """Attention output (S, R, D) float32 of one decode step over the paged store, on CPU tensors.

    With ``write`` the caller guarantees that slot ``float_len[s]`` of every stream lies in a float block the stream
    already has (`LayerStore.can_append_one`, `reserve_one`), and counts the token afterwards (`appended_one`).
    ``scores`` (a store that keeps scores, with ``write``): with ``scoring`` every held slot's score grows by the
    attention it received, summed over its stream's rows, and the new slot's score is set to its own (as the torch
    path's `attend_stored` with `_accumulate` leaves them); without, the new slot's score is 0. ``positions`` (an
    evicting store, with ``write``): the new slot's position.

    Threads: ``parallel=None`` (the default) spreads the step's work items over ``torch.get_num_threads()`` threads
    when torch's OpenMP threads can run them (`openmp_team`) and the step reads at least `SPREAD_MIN_WORK` (held
    tokens x query rows x head_dim, summed over the streams); else it runs on this thread: a smaller step gains
    nothing from a second thread (SmolLM2-135M at 512 tokens, batch 1: a tie). ``True`` spreads any step (on Python
    threads where there is no OpenMP team: on a machine whose cores torch keeps busy that is slower than serial),
    ``False`` never does."""
    s, r, d = q.shape
    if (scores is not None or positions is not None) and not write:
        raise ValueError("scores and positions are written with the new token: pass write=True")
    q_np = _host(q)
    out = np.empty((s, r, d), dtype=np.float32)
    has_body = body is not None and body_table is not None and body_table.shape[1] > 0 and body_len is not None
    ftable = _held_view(float_table) if float_table.shape[1] else np.zeros((s, 1), np.int32)
    rotated = has_body and reads_rotated(formats[0])
    if has_body:
        btable, blen = _held_view(body_table), np.ascontiguousarray(body_len, dtype=np.int64)
        side_arrays = _held_rotated_side if rotated else _side_arrays
        k_side, v_side = side_arrays(body[0], formats[0]), side_arrays(body[1], formats[1])
    else:
        btable, blen = np.zeros((s, 1), np.int32), np.zeros(s, np.int64)
        k_side = v_side = _side_arrays(None, None)
    rope_arrays = _rope_arrays(rope, blen, int(block_size)) if rope is not None and has_body else _no_rope()
    heads = _held_view(stream_head) if stream_head is not None else np.zeros(s, np.int64)
    sinks = sink_logits.float().contiguous().numpy() if sink_logits is not None else np.zeros((1, 1), np.float32)
    new_k_np, new_v_np = _host(new_k), _host(new_v)
    if float_k.dtype == INT8_SLOTS and float_scales is None:
        raise ValueError("int8 float pools are read with their scales: pass float_scales")
    if not write:
        new_bits = np.zeros((2, 1, 1), np.uint8 if float_k.element_size() == 1 else np.uint16)  # the pools' type
    elif float_k.dtype == torch.float16:  # numpy rounds to nearest even, as torch's cast does
        halves = np.empty((2, s, d), np.float16)
        halves[0], halves[1] = new_k_np, new_v_np
        new_bits = halves.view(np.uint16)
    elif float_k.dtype == INT8_SLOTS:  # codes here, their scales below (as the store encodes them)
        codes, scale_bits, _ = int8_slots_on_host(np.stack((new_k_np, new_v_np)), d // float_scales[0].shape[-1])
        new_bits = codes.view(np.uint8)
    else:  # bfloat16; float8 saturating, as the store writes it
        new_bits = _u16(to_float_slots(torch.from_numpy(np.stack((new_k_np, new_v_np))), float_k.dtype))
    if float_k.dtype == INT8_SLOTS:
        float_ks, float_vs = (_held_view(t, "3d") for t in float_scales)
        if write:  # the token's scales at the slot the kernel writes its codes to
            fbs = float_ks.shape[1]
            lengths = np.asarray(float_len, dtype=np.int64)
            blocks = ftable[np.arange(s), lengths // fbs]
            for pool, scales in zip((float_ks, float_vs), scale_bits.view(np.uint16)):
                pool[blocks, lengths % fbs] = scales
    else:
        float_ks = float_vs = _no_scales()
    no_score, no_pos = _no_meta()
    float_score = _held_view(scores[0]) if scores is not None else no_score
    body_score = _held_view(scores[1]) if scores is not None and scores[1] is not None and has_body else no_score
    new_score = np.zeros(s if scores is not None else 1, np.float32)
    score_mode = 0 if scores is None else (2 if scoring else 1)
    float_pos = _held_view(positions[0]) if positions is not None else no_pos
    new_pos = np.zeros(1, np.int32)
    if positions is not None:  # a sequence's streams are consecutive
        new_pos = np.repeat(np.asarray(positions[1], dtype=np.int32), s // len(positions[1]))
    window_arrays = _window_arrays(window, has_body)
    kernels = _kernel()
    lengths = np.ascontiguousarray(float_len, dtype=np.int64)
    with _ONE_AT_A_TIME:
        threads = torch.get_num_threads()  # as many as torch uses (a process that limits torch limits the kernel too)
        if parallel is None:  # (the held tokens summed in Python: numpy's sum costs microseconds on a few streams)
            spread = (threads > 1 and (sum(lengths.tolist()) + sum(blen.tolist()) * int(block_size or 1)) * r * d
                      >= SPREAD_MIN_WORK and openmp_team() is not None)
        else:
            spread = parallel and threads > 1
        if parts is None:
            parts = -(-2 * threads // s) if spread and s < 2 * threads else 1  # few streams: split their tokens
        args = (
            q_np, new_k_np, new_v_np, _held_view(float_k, "3d"), _held_view(float_v, "3d"), float_ks, float_vs,
            ftable, lengths, btable, blen, heads, k_side, v_side, rope_arrays,
            window_arrays, int(block_size or 1), FLOAT_KINDS[float_k.dtype],
            float(softcap or 0.0), sinks, sink_logits is not None, new_bits, bool(write),
            float_score, body_score, new_score, score_mode, float_pos, new_pos, positions is not None, parts, out,
        )
        scratch = kernels["scratch"](q_np, lengths, blen, int(block_size or 1), parts)  # the items' outputs
        team = openmp_team() if spread else None
        if spread and team is None:
            _decode_on_python_threads(kernels, rotated, threads, args, scratch)
        elif spread:
            kernels[rotated][0](*args, *scratch, (team.gomp_parallel, team.thread_num, team.num_threads), threads,
                                _item_ranges(s, parts, threads))
            team.runs += 1
        else:
            kernels[rotated][0](*args, *scratch, *_no_team())
    return torch.from_numpy(out)


def _host(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A float32 C-ordered host array of a CPU tensor or array (the same object when it already is one)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, dtype=np.float32)
    return x.contiguous().float().numpy()


def _window_arrays(window: tuple | None, has_body: bool) -> tuple:
    """A sliding window as the kernel takes it: (W, query positions (S,) int64, float pool pos (cap, FBS) int32, body
    pool pos (cap, BS) int32); W = 0 and placeholders without one."""
    if window is None:
        return _no_window()
    size, query_pos, float_pos, body_pos = window
    query = np.ascontiguousarray(np.asarray(query_pos, dtype=np.int64))
    body = _held_view(body_pos) if has_body and body_pos is not None else _no_window()[3]
    return (int(size), query, _held_view(float_pos), body)


@functools.lru_cache(maxsize=None)
def _no_window() -> tuple:
    """The placeholder window of a layer that sees every held token (never read; built once)."""
    return (0, np.zeros(1, np.int64), np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32))


@functools.lru_cache(maxsize=None)
def _no_scales() -> np.ndarray:
    """The placeholder scales of a float pool that has none (never read; built once)."""
    return np.zeros((1, 1, 1), np.uint16)


@functools.lru_cache(maxsize=None)
def _no_meta() -> tuple:
    """Placeholder score (float32) and position (int32) pools of a call that writes neither (built once)."""
    return np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int32)
