"""The Triton decode kernel against the torch reference.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py
before Triton is imported), so these tests run in CI; on a GPU the same matrix runs on CUDA
(marker ``gpu``). Reference: a dense softmax over the blocks decoded by the formats' own
`decode_blocks` (independent of both the kernel and the store's chunked algebra); end to end,
the triton backend generates the torch backend's tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

from kvtool.calibration import build_quantizers, needs_fit
from kvtool.errors import RuntimeConfigError
from kvtool.methods.quant.fp8 import fp8_max
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.kernels.cpu_decode import numba_available
from kvtool.runtime.store import INT8_SLOTS, decode_int8_slots, encode_int8_slots, slot_scale_group
from tests.tiny_models import featured_model, tiny_model, tiny_tokenizer_free_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

FBS = 16
BS = 32
SIDES = {  # name: (key spec, value spec)
    "float": (QuantSpec(method="none", bits=16, path="keys"), QuantSpec(method="none", bits=16, axis="token", path="values")),
    "uniform-2": (QuantSpec(bits=2, path="keys"), QuantSpec(bits=2, axis="token", path="values")),
    "uniform-3": (QuantSpec(bits=3, path="keys"), QuantSpec(bits=3, axis="token", group_size=16, path="values")),
    "uniform-4": (QuantSpec(bits=4, path="keys"), QuantSpec(bits=4, axis="token", path="values")),
    "uniform-8": (QuantSpec(bits=8, path="keys"), QuantSpec(bits=8, axis="token", path="values")),
    "uniform-4-token-keys-channel-values": (QuantSpec(bits=4, axis="token", path="keys"), QuantSpec(bits=4, axis="channel", path="values")),
    "fp8-dynamic": (QuantSpec(method="fp8", bits=8, granularity="block", path="keys"),
                    QuantSpec(method="fp8", bits=8, fp8_format="e5m2", granularity="block", path="values")),
    "fp8-static": (QuantSpec(method="fp8", bits=8, granularity="head", path="keys"),
                   QuantSpec(method="fp8", bits=8, fp8_format="e5m2", granularity="layer", path="values")),
    "int8-static-channel-int4-layer": (QuantSpec(method="int_static", bits=8, granularity="channel", path="keys"),
                                       QuantSpec(method="int_static", bits=4, granularity="layer", path="values")),
    "int3-static-head-int2-channel": (QuantSpec(method="int_static", bits=3, granularity="head", path="keys"),
                                      QuantSpec(method="int_static", bits=2, granularity="channel", path="values")),
    # nuq keys are stored before RoPE; the kernel matrix checks the stored keys' read (RoPE: see below)
    "nuq-3-1pct": (QuantSpec(method="nuq", bits=3, outlier_fraction=0.01, pre_rope=True, path="keys"),
                   QuantSpec(method="nuq", bits=3, axis="token", group_size=16, outlier_fraction=0.01, path="values")),
    "nuq-2-5pct-4-dense-channel-values": (QuantSpec(method="nuq", bits=2, outlier_fraction=0.05, pre_rope=True, path="keys"),
                                          QuantSpec(method="nuq", bits=4, outlier_fraction=0.0, path="values")),
    # palu latents of rank 3D/8 (made-up orthonormal bases; Hadamard blocks of 8-32, a partial last group at D 64)
    "palu-fp16": (QuantSpec(method="palu", bits=16, pre_rope=True, path="keys"), QuantSpec(method="palu", bits=16, path="values")),
    "palu-3-hadamard-4": (QuantSpec(method="palu", bits=3, hadamard=True, group_size=16, pre_rope=True, path="keys"),
                          QuantSpec(method="palu", bits=4, group_size=16, path="values")),
    "turboquant-3": (QuantSpec(method="turboquant", bits=3, path="keys"), QuantSpec(method="turboquant", bits=3, path="values")),
    "turboquant-4-keys-palu-2-hadamard-values": (
        QuantSpec(method="turboquant", bits=4, path="keys"),
        QuantSpec(method="palu", bits=2, hadamard=True, group_size=32, path="values")),
    "uniform-4-keys-turboquant-2-values": (QuantSpec(bits=4, path="keys"), QuantSpec(method="turboquant", bits=2, path="values")),
    # the outlier split: 2.5 bits (a quarter at 4 bits: Haar rotation of the 3D/4 rest) and 3.5 (half at 4 bits)
    "turboquant-2.5-3.5": (QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.25, path="keys"),
                           QuantSpec(method="turboquant", bits=3, extra_bits=0.5, path="values")),
    "turboquant-3.5-keys-palu-values": (
        QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, path="keys"),
        QuantSpec(method="palu", bits=16, path="values")),
}
# sides that run the diagonal of the head_dim x GQA matrix only (every head_dim and GQA once: CI time)
DIAGONAL_ONLY = [name for name in SIDES if "palu" in name or "turboquant" in name]
DIAGONAL = [(64, 1), (128, 4), (256, 8)]
MATRIX = [(side, d, gqa) for side in SIDES for d in (64, 128, 256) for gqa in (1, 4, 8)
          if side not in DIAGONAL_ONLY or (d, gqa) in DIAGONAL]
KV_HEADS = 2  # streams alternate between two KV heads, so per-head static tables are read per stream
# (float tokens, body blocks) per stream: empty, one token, a block boundary, body-only, long
RAGGED = [(0, 0), (1, 0), (17, 2), (0, 3), (40, 5)]


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it where no GPU is present
# tests that run Triton on CPU tensors need the interpreter (on a GPU machine their CUDA twins run)
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="runs the kernels on CPU tensors: TRITON_INTERPRET=1 only")


def devices():
    out = ["cpu"] if INTERPRETER else []
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return out


def add_sides(monkeypatch, sides: dict) -> None:
    """Make more `SIDES` (name: (key spec, value spec)) known to `build_case` for one test (other test files' formats)."""
    for name, specs in sides.items():
        monkeypatch.setitem(SIDES, name, specs)


def _pool_tables(lengths_per_stream, per_block, generator):
    """Random distinct block ids per stream: table (S, W) int32 (0 past a stream's blocks), pool size."""
    counts = [-(-n // per_block) for n in lengths_per_stream]
    total = sum(counts)
    ids = torch.randperm(max(total, 1) + 3, generator=generator)[:total] + 1  # leave id 0 unused: a wrong read shows
    width = max(max(counts), 1)
    table = torch.zeros((len(counts), width), dtype=torch.int32)
    start = 0
    for s, c in enumerate(counts):
        table[s, :c] = ids[start:start + c].int()
        start += c
    return table, max(total, 1) + 4


def _static_range(granularity: str, spread: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A calibrated-looking (lo, hi) at a granularity: (1, 1), (H, 1) or (H, D), about the data's spread (D,)."""
    rows = 1 if granularity == "layer" else KV_HEADS
    width = spread if granularity == "channel" else spread.max().reshape(1)
    hi = 3 * width * (0.8 + 0.4 * torch.rand(rows, width.numel(), generator=generator))
    lo = -3 * width * (0.8 + 0.4 * torch.rand(rows, width.numel(), generator=generator))
    return lo, hi


def fitted_for(recipe: Recipe, head_dim: int, spreads, generator) -> dict[str, torch.Tensor]:
    """Calibrated tensors ("keys.scale", ...) the recipe's static or codebook formats need, made up for a test."""
    fitted = {}
    for spec, part, spread in ((recipe.keys, "keys", spreads[0]), (recipe.values, "values", spreads[1])):
        if spec.method == "fp8" and spec.is_static:
            _, hi = _static_range(spec.granularity, spread, generator)
            fitted[f"{part}.scale"] = hi / fp8_max(spec.fp8_format)
        elif spec.method == "int_static":
            fitted[f"{part}.lo"], fitted[f"{part}.hi"] = _static_range(spec.granularity, spread, generator)
        elif spec.method == "nuq":
            fitted[f"{part}.codebook"] = (torch.rand(2**spec.bits, generator=generator) * 2 - 1).sort().values
            if spec.axis == "channel":  # the f/2 .. 1 - f/2 quantiles: about 2.5 standard deviations
                lo, hi = _static_range("channel", spread, generator)
                fitted[f"{part}.channel_lo"], fitted[f"{part}.channel_hi"] = lo * 0.8, hi * 0.8
        elif spec.method == "palu":
            fitted.update(palu_basis(part, KV_HEADS, head_dim, 3 * head_dim // 8, generator))
        elif spec.method == "turboquant" and spec.channel_scale != "none":  # a different scale per KV head
            fitted[f"{part}.channel_scale"] = torch.exp(torch.randn(KV_HEADS, head_dim, generator=generator) * 0.7)
        if spec.method == "turboquant" and spec.outlier_channels == "calibrated":  # other channels per KV head
            from kvtool.methods.quant.turboquant import pack_mask

            count = round(head_dim * spec.outlier_channel_fraction)
            picked = torch.stack([torch.randperm(head_dim, generator=generator)[:count] for _ in range(KV_HEADS)])
            fitted[f"{part}.outlier_channels"] = pack_mask(torch.zeros(KV_HEADS, head_dim, dtype=torch.bool).scatter_(-1, picked, True))
    return fitted


def palu_basis(part: str, heads: int, head_dim: int, rank: int, generator) -> dict[str, torch.Tensor]:
    """Made-up Palu tensors, one group per KV head: orthonormal ``basis`` (H, D, r) and a ``bias`` (H, D)."""
    basis = torch.linalg.qr(torch.randn(heads, head_dim, rank, generator=generator)).Q
    return {f"{part}.basis": basis, f"{part}.bias": torch.randn(heads, head_dim, generator=generator) * 0.1}


def _body_rope(source: str, rotary_dim: int, interleaved: bool, body_blocks, bcap: int, btable, generator):
    """A `BodyRope` of made-up positions and the positions (T_i,) of every stream's body tokens it implies."""
    from kvtool.runtime.kernels.body_rope import BodyRope

    s = len(body_blocks)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    n_sink = torch.randint(0, 4, (s,), generator=generator)
    positions = table = None
    if source == "slots":  # evicting store: any positions, per body slot
        positions = torch.randint(0, 5000, (bcap, BS), generator=generator, dtype=torch.int32)
        per_stream = [positions[btable[i, :n].long()].flatten().long() for i, n in enumerate(body_blocks)]
    elif source == "sequence":  # two streams (KV heads) per sequence, increasing positions with gaps (padding)
        width = 4 + max(body_blocks) * BS
        table = torch.randint(1, 3, (-(-s // KV_HEADS), width), generator=generator).cumsum(1).int()
        positions = table
        per_stream = [table[i // KV_HEADS, int(n_sink[i]) + torch.arange(n * BS)].long() for i, n in enumerate(body_blocks)]
    else:
        per_stream = [int(n_sink[i]) + torch.arange(n * BS) for i, n in enumerate(body_blocks)]
    rope = BodyRope(inv_freq=inv_freq, scaling=1.25, interleaved=interleaved, source=source, positions=positions,
                    n_sink=n_sink, streams_per_sequence=KV_HEADS)
    return rope, per_stream


def _rotated(keys: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
    """The torch reference's RoPE (`kvtool.models.rope`) of keys (T, D) at positions (T,)."""
    from kvtool.models.rope import RopeSpec, apply_rope

    spec = RopeSpec(rope.inv_freq, rope.scaling, rope.rotary_dim, rope.interleaved)
    cos, sin = spec.cos_sin(positions[None])  # (1, T, R)
    return apply_rope(keys[None, None], cos, sin, rope.interleaved)[0, 0]


def build_case(side: str, head_dim: int, gqa: int, device: str, softcap=None, sinks=False, seed=0, rope=None, bs=BS,
               fbs=FBS, float_dtype=torch.float16):
    """A random store (float region + body blocks of one format), queries, the new token, and the dense reference.

    rope: (source, rotary_dim, interleaved): body keys are stored before RoPE and rotated at made-up positions.
    bs: tokens per body block (16 only for sides whose codes are bytes: turboquant); fbs: tokens per float block;
    float_dtype: the float blocks' dtype (float16, bfloat16, float8_e4m3fn, or int8: codes with their scales, passed
    as ``float_scales``).
    """
    assert rope is None or bs == BS  # `_body_rope` makes positions for BS-token blocks
    g = torch.Generator().manual_seed(seed)
    key_spec, value_spec = SIDES[side]
    recipe = Recipe(name=side, keys=key_spec, values=value_spec, cache=CacheSpec(block_size=bs))
    key_spread, value_spread = torch.linspace(0.2, 3, head_dim), torch.ones(head_dim)  # keys: channel outliers
    fitted = fitted_for(recipe, head_dim, (key_spread, value_spread), g)
    kq, vq = build_quantizers(recipe, head_dim, torch.float32, fitted)  # decode without rounding to fp16, as attention does
    s = len(RAGGED)
    float_tokens = [f for f, _ in RAGGED]
    body_blocks = [b for _, b in RAGGED]
    ftable, fcap = _pool_tables(float_tokens, fbs, g)
    btable, bcap = _pool_tables([b * bs for b in body_blocks], bs, g)
    float_k = torch.randn(fcap, fbs, head_dim, generator=g)
    float_v = torch.randn(fcap, fbs, head_dim, generator=g)
    float_scales = None
    if float_dtype == INT8_SLOTS:  # codes and their scales, as the store writes them
        (float_k, k_scales), (float_v, v_scales) = (encode_int8_slots(x, slot_scale_group(head_dim)) for x in (float_k, float_v))
        float_scales = (k_scales, v_scales)
        held_k, held_v = decode_int8_slots(float_k, k_scales), decode_int8_slots(float_v, v_scales)
    else:
        float_k, float_v = float_k.to(float_dtype), float_v.to(float_dtype)
        held_k, held_v = float_k.float(), float_v.float()
    raw_k = torch.randn(bcap, 1, bs, head_dim, generator=g) * key_spread
    raw_v = torch.randn(bcap, 1, bs, head_dim, generator=g) * value_spread
    stream_group = torch.arange(s) % KV_HEADS  # (S,) the KV head of each stream
    group = torch.zeros(bcap, dtype=torch.long)  # (cap,) the KV head of each pool block
    for i in range(s):
        group[btable[i, : body_blocks[i]].long()] = stream_group[i]
    kb, vb = kq.encode_blocks(raw_k, group), vq.encode_blocks(raw_v, group)
    dec_k, dec_v = kq.decode_blocks(kb, group)[:, 0].float(), vq.decode_blocks(vb, group)[:, 0].float()  # (cap, bs, D)
    q = torch.randn(s, gqa, head_dim, generator=g) / head_dim**0.5
    new_k, new_v = torch.randn(s, head_dim, generator=g), torch.randn(s, head_dim, generator=g)
    sink_logits = torch.randn(s, gqa, generator=g) if sinks else None
    body_rope, body_pos = _body_rope(*rope, body_blocks, bcap, btable, g) if rope else (None, None)
    reference = []
    for i in range(s):
        f_ids = ftable[i, : -(-float_tokens[i] // fbs)].long()
        fk = held_k[f_ids].reshape(-1, head_dim)[: float_tokens[i]]
        fv = held_v[f_ids].reshape(-1, head_dim)[: float_tokens[i]]
        b_ids = btable[i, : body_blocks[i]].long()
        body_k = dec_k[b_ids].reshape(-1, head_dim)
        if body_rope is not None:
            body_k = _rotated(body_k, body_pos[i], body_rope)
        keys = torch.cat([fk, body_k, new_k[i : i + 1]])
        values = torch.cat([fv, dec_v[b_ids].reshape(-1, head_dim), new_v[i : i + 1]])
        logits = q[i] @ keys.T  # (R, T)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if sinks:
            logits = torch.cat([logits, sink_logits[i][:, None]], dim=1)
            values = torch.cat([values, torch.zeros(1, head_dim)])
        reference.append(torch.softmax(logits, dim=-1) @ values)
    to = lambda x: x.to(device) if torch.is_tensor(x) else {k: v.to(device) for k, v in x.items()}  # noqa: E731
    body = ({**to(kb), **kq.kernel_tensors(device)}, {**to(vb), **vq.kernel_tensors(device)})
    args = dict(
        q=to(q), new_k=to(new_k), new_v=to(new_v), float_k=to(float_k), float_v=to(float_v), float_table=to(ftable),
        float_len=to(torch.tensor(float_tokens)), body=body, body_table=to(btable),
        body_len=to(torch.tensor(body_blocks)), formats=(kq.kernel_format(), vq.kernel_format()), block_size=bs,
        softcap=softcap, sink_logits=None if sink_logits is None else to(sink_logits), stream_group=to(stream_group),
    )
    if float_scales is not None:
        args["float_scales"] = tuple(to(x) for x in float_scales)
    if body_rope is not None:
        moved = {k: to(getattr(body_rope, k)) for k in ("inv_freq", "positions", "n_sink") if getattr(body_rope, k) is not None}
        args["rope"] = dataclasses.replace(body_rope, **moved)
    return args, torch.stack(reference)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side, head_dim, gqa", MATRIX)
def test_decode_kernel_equals_the_dense_reference(side, head_dim, gqa, device):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + gqa)
    out = paged_decode_attention(**args, kernel="general")  # every format, one block at a time
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


SMALL_BLOCK_SIDES = ["turboquant-3", "turboquant-2.5-3.5"]  # block_size 16: codes read as bytes (cache.block_size)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side", SMALL_BLOCK_SIDES)
@pytest.mark.parametrize("head_dim, gqa", [(64, 4), (256, 1)])
def test_decode_kernel_reads_16_token_turboquant_blocks(side, head_dim, gqa, device):
    """TurboQuant bodies of 16-token blocks (a 3-bit block is 6 rows of bytes, a 5-bit outlier instance 10): the
    kernel walks them as it walks 32-token ones, ragged streams included."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + gqa + 3, bs=16)
    assert args["block_size"] == 16
    out = paged_decode_attention(**args, kernel="general")
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


QUERY_SCALE_SIDES = {  # TurboQuant keys with channel_scale: query (codes of k / s, the body scored against q * s)
    "turboquant-3-query-scale": (QuantSpec(method="turboquant", bits=3, channel_scale="query", path="keys"),
                                 QuantSpec(method="turboquant", bits=3, path="values")),
    "turboquant-k3.5-v2.5-query-scale": (
        QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, channel_scale="query",
                  path="keys"),
        QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.5, path="values")),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side", list(QUERY_SCALE_SIDES))
@pytest.mark.parametrize("head_dim, gqa", [(64, 4), (256, 1)])
def test_decode_kernel_scales_the_query_by_the_keys_channel_scale(side, head_dim, gqa, device, monkeypatch):
    """The reference decodes k itself (the codes times s); the kernel scores the codes against q * s, with the row of
    each stream's KV head (streams alternate between two). Unscaled, or one head's row for both, it is wrong."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    monkeypatch.setitem(SIDES, side, QUERY_SCALE_SIDES[side])
    args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + gqa + 7)
    assert args["formats"][0].query_scale
    torch.testing.assert_close(paged_decode_attention(**args, kernel="general").cpu(), reference, rtol=1e-4, atol=1e-4)
    keys, values = args["body"]
    one_head = {**keys, "channel_scale": keys["channel_scale"][:1].expand_as(keys["channel_scale"]).contiguous()}
    out = paged_decode_attention(**{**args, "body": (one_head, values)}, kernel="general").cpu()
    assert (out - reference).abs().max() > 1e-2
    unscaled = dataclasses.replace(args["formats"][0], query_scale=False)
    out = paged_decode_attention(**{**args, "formats": (unscaled, args["formats"][1])}, kernel="general").cpu()
    assert (out - reference).abs().max() > 1e-2


# the formats the tiled fast kernel (`uniform_decode.py`) reads; the others go to the general kernel
UNIFORM_SIDES = ["float", "uniform-2", "uniform-3", "uniform-4", "uniform-8", "uniform-4-token-keys-channel-values"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("precision", ["exact", "half"])
@pytest.mark.parametrize("side, head_dim, gqa", [(side, d, gqa) for side in UNIFORM_SIDES for d, gqa in DIAGONAL])
def test_uniform_kernel_equals_the_dense_reference(side, head_dim, gqa, precision, device):
    """The tiled kernel over float and uniform-code blocks (several blocks per tile, each packed byte read once):
    float32 products match the reference at 1e-4; float16 operands (fp16 / bf16 models) within 2e-3 of the
    largest output, the rounding of keys and probabilities to float16."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention
    from kvtool.runtime.kernels.uniform_decode import covers, uniform_decode_attention

    args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + gqa + 1)
    assert covers(args["formats"], head_dim, BS)
    args.pop("stream_group")  # no static tables in these formats
    out = uniform_decode_attention(**args, precision=precision).cpu()
    if precision == "exact":
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(paged_decode_attention(**args).cpu(), out, rtol=0, atol=0)  # auto picks this kernel
    else:
        assert (out - reference).abs().max() <= 2e-3 * reference.abs().max()
        assert (out - reference).abs().max() > 0  # the products really were float16


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tile_tokens", [16, 32, 128])
@pytest.mark.parametrize("side", ["uniform-2", "uniform-3", "float"])
def test_uniform_kernel_tiles_of_any_width_read_the_same_tokens(side, tile_tokens, device):
    """Tiles of 1 to 8 blocks (a partly filled last tile, 2-bit blocks of 8-row sub-tiles) read every token once."""
    from kvtool.runtime.kernels.uniform_decode import uniform_decode_attention

    args, reference = build_case(side, 64, 4, device, seed=11)
    args.pop("stream_group")
    out = uniform_decode_attention(**args, tile_tokens=tile_tokens, splits=2)
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


def test_uniform_kernel_covers_the_bundled_uniform_recipes_and_nothing_it_cannot_read():
    """kivi-2bit / kivi-4bit / int8 / uncompressed stores take the fast kernel (a regression that sent them back
    to the general one would lose its speed silently); pre-RoPE, codebook, fp8 and mixed-width stores do not."""
    from kvtool.recipe import load_recipe
    from kvtool.runtime.kernels.uniform_decode import covers

    def formats(recipe):
        kq, vq = build_quantizers(recipe, 128, torch.float32, {})
        return kq.kernel_format(), vq.kernel_format()

    for name in ("kivi-2bit", "kivi-4bit", "int8"):
        recipe = load_recipe(name)
        assert covers(formats(recipe), 128, recipe.cache.block_size), name
    assert covers(None, 128, 16)  # float blocks only (uncompressed, float eviction)
    mixed = Recipe(name="mixed", keys=QuantSpec(bits=4, path="keys"), values=QuantSpec(bits=2, axis="token", path="values"))
    assert not covers(formats(mixed), 128, 32)  # first slices of different widths: the general kernel
    for side in ("fp8-dynamic", "nuq-3-1pct", "int8-static-channel-int4-layer", "turboquant-3", "palu-fp16"):
        recipe = Recipe(name=side, keys=SIDES[side][0], values=SIDES[side][1], cache=CacheSpec(block_size=BS))
        fitted = fitted_for(recipe, 128, (torch.ones(128), torch.ones(128)), torch.Generator().manual_seed(0))
        kq, vq = build_quantizers(recipe, 128, torch.float32, fitted)
        assert not covers((kq.kernel_format(), vq.kernel_format()), 128, BS), side
    assert not covers(formats(load_recipe("kivi-4bit")), 96, 32)  # head_dim not a power of two


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("source, side, rotary, interleaved", [
    ("slots", "nuq-3-1pct", 1.0, False),  # evicting store: positions per body slot
    ("sequence", "uniform-4", 1.0, False),  # recorded sequence positions (padding, custom ids)
    ("tokens", "int8-static-channel-int4-layer", 1.0, True),  # slots are positions; Cohere's interleaved pairs
    ("sequence", "fp8-static", 0.5, False),  # partial rotary (Phi-3)
    ("slots", "palu-3-hadamard-4", 1.0, False),  # reconstructed latents, then rotated
    ("sequence", "palu-fp16", 0.5, True),
])
@pytest.mark.parametrize("head_dim, gqa", [(64, 1), (128, 4), (256, 8)])
def test_pre_rope_keys_are_rotated_at_their_true_positions(source, side, rotary, interleaved, head_dim, gqa, device):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    rope = (source, int(head_dim * rotary), interleaved)
    args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + gqa, rope=rope)
    out = paged_decode_attention(**args)
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side, rope", [
    ("uniform-3", None), ("nuq-3-1pct", ("slots", 64, False)), ("palu-3-hadamard-4", ("sequence", 64, False)),
    ("turboquant-2.5-3.5", None), ("fp8-dynamic", None),
])
def test_blocks_read_in_token_tiles_equal_whole_blocks(side, rope, device):
    """A block decoded in tiles of 16 tokens (what long blocks x wide heads get on a GPU) reads the same tokens."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case(side, 64, 4, device, seed=3, rope=rope)
    out = paged_decode_attention(**args, tile=16)
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_bytes_decode_exactly_as_torch_float8(fmt, device):
    """Every finite fp8 bit pattern (subnormals, signed zeros, the max) reads back as torch's own cast."""
    from kvtool.runtime.kernels.body_block import fp8_bytes_to_float
    from kvtool.methods.quant.fp8 import FP8_DTYPES

    everything = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = everything.view(FP8_DTYPES[fmt]).float()
    finite = torch.isfinite(expected)  # the saturating encoder never stores NaN / inf
    out = fp8_bytes_to_float(everything[finite].to(device), fmt).cpu()
    assert torch.equal(out, expected[finite])
    assert torch.equal(torch.signbit(out), torch.signbit(expected[finite]))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("side, kernel", [
    ("uniform-4", "auto"), ("uniform-4", "general"), ("float", "auto"), ("turboquant-3", "auto"), ("palu-3-hadamard-4", "auto"),
])
def test_split_reduction_softcap_and_sinks(side, kernel, splits, device):
    """Flash-decoding splits, Gemma-style soft-capping and learned sinks give the same result, in the tiled
    kernel (uniform, float) and the general one (TurboQuant: each split's rotated value sum is rotated back
    before the merge)."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case(side, 64, 4, device, softcap=5.0, sinks=True, seed=7)
    out = paged_decode_attention(**args, splits=splits, kernel=kernel)
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("splits, merge_values", [(3, 128), (5, 256), (9, 256), (40, 8192), (13, 64)])
@pytest.mark.parametrize("side, kernel", [("uniform-4", "auto"), ("float", "auto"), ("uniform-4", "general")])
def test_merge_reads_partials_in_chunks(side, kernel, splits, merge_values, device, monkeypatch):
    """The merge pass reads SC partials per load: several chunks with a short last one (3 splits at 2 per chunk:
    the tiled kernel's third split holds the longest stream's last body tile; 5 and 9 at 4 per chunk, head_dim 64),
    one chunk mostly masked (40 splits at 128 per chunk, most partials empty: more splits than tiles), one split per
    chunk."""
    from kvtool.runtime.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "MERGE_VALUES", merge_values)
    args, reference = build_case(side, 64, 4, device, softcap=5.0, sinks=True, seed=11)
    out = decode_attention.paged_decode_attention(**args, splits=splits, kernel=kernel)
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


def test_split_count_grows_for_few_streams():
    """Few streams get more programs per stream (up to MAX_SPLITS), each walking at least two tiles; many streams
    share about 1024 programs; a short stream is not split (the counts the H100 split sweep measured best)."""
    from kvtool.runtime.kernels.decode_attention import MAX_SPLITS, splits_for

    assert splits_for(1, 4) == 1
    assert splits_for(1, 2048) == MAX_SPLITS == 256  # Gemma-3 at 32K x batch 1 (one KV head, 16-token tiles)
    assert splits_for(1, 100) == 50
    assert splits_for(4, 4096) == 128
    assert splits_for(8, 512) == 64  # Llama-3-8B at 32K x batch 1 (8 KV heads), Gemma-3 at 32K x 8
    assert splits_for(64, 512) == 16  # Llama-3-8B at 32K x 8: 1024 programs, as before
    assert splits_for(256, 1024) == 4


# --- the append/encode kernel: byte-identical to the quantizers' encode_blocks ---------------------
def _blocks(data: str, head_dim: int, levels: int, seed: int) -> torch.Tensor:
    """(N, 1, BS, D) float32 blocks: ``random`` (channel outliers) or ``adversarial`` (one hard case per block)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.2, 3, head_dim)
    if data == "random":
        return (torch.randn(4, 1, BS, head_dim, generator=g) * spread)
    normal = lambda: torch.randn(BS, head_dim, generator=g)  # noqa: E731
    constant = normal()
    constant[:, : head_dim // 2] = torch.randn(head_dim // 2, generator=g)  # constant channels
    constant[::2] = torch.randn(BS // 2, 1, generator=g)  # constant tokens (every channel group)
    outliers = normal()
    outliers[3, 5], outliers[7, 9], outliers[0] = 1e4, -3e4, outliers[0] * 1000
    outliers[:, 1] = 7e4  # beyond fp16: min / max clamp to +-65504
    ties_channel = torch.randint(0, 2 * levels + 1, (BS, head_dim), generator=g) / 2  # k / 2: exact rounding ties
    ties_channel[0], ties_channel[1] = 0, levels  # scale 1, zero 0 per channel
    ties_token = torch.randint(0, 2 * levels + 1, (BS, head_dim), generator=g) / 2
    ties_token[:, 0::16], ties_token[:, 1::16] = 0, levels  # ... and per group of 16 or more channels
    tiny = normal() * 1e-7  # scales clamp to 1e-6, an fp16 subnormal
    offset = 1000 + normal() * 0.01  # x - fp16(zero) can be negative
    blocks = [normal() * spread, constant, outliers, torch.zeros(BS, head_dim), ties_channel, ties_token, tiny, offset]
    return torch.stack(blocks)[:, None]


def _fp8_blocks(data: str, head_dim: int, fmt: str, seed: int) -> torch.Tensor:
    """fp8 test blocks: random, or zeros / beyond fp16 / underflowing scales / every fp8 value and midpoint (scale 1)."""
    from kvtool.methods.quant.fp8 import FP8_DTYPES

    g = torch.Generator().manual_seed(seed)
    if data == "random":
        return torch.randn(4, 1, BS, head_dim, generator=g) * torch.linspace(0.2, 3, head_dim)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPES[fmt]).float()
    values = values[torch.isfinite(values) & (values >= 0)].unique()  # sorted
    points = torch.cat([values, (values[1:] + values[:-1]) / 2, values[:-1] * 0.75 + values[1:] * 0.25])
    grid = points[torch.randint(0, points.numel(), (BS * head_dim,), generator=g)]
    grid = grid * (torch.randint(0, 2, grid.shape, generator=g) * 2 - 1)
    grid[0] = values.max()  # amax / max = 1: the exact points are the codes' ties
    grid[1 : points.numel() + 1] = points[: BS * head_dim - 1]
    outliers = torch.randn(BS, head_dim, generator=g)
    outliers[2, 3] = 1e6
    blocks = [grid.reshape(BS, head_dim), torch.zeros(BS, head_dim), outliers, torch.randn(BS, head_dim, generator=g) * 1e-30]
    return torch.stack(blocks)[:, None]


def _assert_bytes_equal(out: dict, reference: dict, rows=None) -> None:
    assert set(out) == set(reference)
    for name, expected in reference.items():
        got = out[name] if rows is None else out[name][rows]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name  # bytes, so -0.0 != 0.0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("data", ["random", "adversarial"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_encode_kernel_writes_the_uniform_reference_bytes(bits, axis, head_dim, data, dtype, device):
    from kvtool.methods.quant.uniform import UniformQuantizer
    from kvtool.runtime.kernels.encode_blocks import encode_body_blocks

    quantizer = UniformQuantizer(QuantSpec(bits=bits, axis=axis, group_size=32, path="keys"), head_dim, BS)
    x = _blocks(data, head_dim, 2**bits - 1, seed=bits + head_dim).to(dtype)
    reference = quantizer.encode_blocks(x, torch.zeros(x.shape[0], dtype=torch.long))
    out = encode_body_blocks(x[:, 0].to(device), quantizer.kernel_encode_format())
    _assert_bytes_equal({name: t.cpu() for name, t in out.items()}, reference)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("data", ["random", "adversarial"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("granularity", ["block", "head"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_kernel_writes_the_fp8_reference_bytes(fmt, granularity, head_dim, data, device):
    from kvtool.methods.quant.fp8 import Fp8Quantizer
    from kvtool.runtime.kernels.encode_blocks import encode_body_blocks

    spec = QuantSpec(method="fp8", bits=8, fp8_format=fmt, granularity=granularity, path="keys")
    fitted = {"scale": torch.tensor([[0.01], [3.0]])} if granularity == "head" else None  # head 1: many subnormals
    quantizer = Fp8Quantizer(spec, head_dim, BS, fitted=fitted)
    x = _fp8_blocks(data, head_dim, fmt, seed=head_dim)
    group = torch.arange(x.shape[0]) % KV_HEADS
    reference = quantizer.encode_blocks(x, group)
    out = encode_body_blocks(x[:, 0].to(device), quantizer.kernel_encode_format(), group=group.to(device),
                             static_scale=quantizer.kernel_tensors(device).get("static_scale"))
    _assert_bytes_equal({name: t.cpu() for name, t in out.items()}, reference)


@needs_interpreter
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_encode_kernel_writes_only_the_pool_rows_it_is_given(axis):
    """The store's path: blocks go straight into allocated rows of the body pool, other rows untouched."""
    from kvtool.methods.quant.uniform import UniformQuantizer
    from kvtool.runtime.kernels.encode_blocks import encode_body_blocks

    quantizer = UniformQuantizer(QuantSpec(bits=3, axis=axis, group_size=16, path="keys"), 64, BS)
    x = _blocks("random", 64, 7, seed=1)
    pool = {name: torch.full((9, *shape), 7, dtype=dtype) for name, (shape, dtype) in quantizer.block_spec().items()}
    before = {name: t.clone() for name, t in pool.items()}
    rows = torch.tensor([6, 2, 8, 3])
    encode_body_blocks(x[:, 0], quantizer.kernel_encode_format(), out=pool, rows=rows)
    _assert_bytes_equal(pool, quantizer.encode_blocks(x, torch.zeros(4, dtype=torch.long)), rows)
    untouched = torch.tensor([0, 1, 4, 5, 7])
    _assert_bytes_equal({n: t[untouched] for n, t in pool.items()}, {n: t[untouched] for n, t in before.items()})


def _generate(model, recipe, backend, ids, mask, tokens=6, layer_tensors=None):
    runtime = CompressedRuntime.from_recipe(model, recipe, layer_tensors, backend=backend)
    cache = runtime.new_cache()
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), **with_cache(cache), max_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out, cache


def _static_layer_tensors(model) -> list[dict]:
    """Made-up calibrated tensors for the tiny model's layers (fp8 per-head scales, int_static ranges)."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    one = {
        "keys.codebook": torch.linspace(-1, 1, 8), "keys.channel_lo": torch.full((heads, d), -2.0),  # nuq keys (pre-RoPE)
        "keys.channel_hi": torch.full((heads, d), 2.0),
        "keys.scale": torch.rand(heads, 1, generator=g) * 0.01 + 0.01,  # fp8 head: amax 4.5 .. 9
        "keys.lo": -3 - torch.rand(heads, d, generator=g), "keys.hi": 3 + torch.rand(heads, d, generator=g),  # int channel
        "values.lo": torch.full((1, 1), -2.5), "values.hi": torch.full((1, 1), 2.5),  # int layer
        "values.codebook": torch.linspace(-1, 1, 8) ** 3,  # nuq 3-bit: denser levels near 0
        **palu_basis("keys", heads, d, 3 * d // 8, g), **palu_basis("values", heads, d, 3 * d // 8, g),  # palu per head
        "keys.channel_scale": torch.exp(torch.randn(heads, d, generator=g) * 0.7),  # turboquant channel_scale: query
    }
    return [dict(one) for _ in range(layers)]


GENERATION_RECIPES = {
    "kivi": Recipe(name="kivi", cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32)),
    "streamingllm-3bit": Recipe(
        name="sl3", keys=QuantSpec(bits=3, path="keys"), values=QuantSpec(bits=3, axis="token", group_size=16, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="streamingllm", budget_tokens=64, sink_tokens=4, window=16),
    ),
    "fp8-head-int4-layer": Recipe(
        name="fp8s", keys=QuantSpec(method="fp8", bits=8, granularity="head", path="keys"),
        values=QuantSpec(method="int_static", bits=4, granularity="layer", path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "int8-channel-fp8-e5m2-block": Recipe(
        name="int8c", keys=QuantSpec(method="int_static", bits=8, granularity="channel", path="keys"),
        values=QuantSpec(method="fp8", bits=8, fp8_format="e5m2", granularity="block", path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "uniform-keys-nuq-values": Recipe(
        name="nuqv", keys=QuantSpec(bits=4, path="keys"),
        values=QuantSpec(method="nuq", bits=3, axis="token", group_size=16, outlier_fraction=0.01, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    # keys stored before RoPE, rotated in the kernel: positions recorded per sequence (row 1 is left-padded) ...
    "kvquant-3bit": Recipe(
        name="kvq3", keys=QuantSpec(method="nuq", bits=3, pre_rope=True, outlier_fraction=0.01, path="keys"),
        values=QuantSpec(method="nuq", bits=3, axis="token", group_size=16, outlier_fraction=0.01, path="values"),
        cache=CacheSpec(sink_tokens=1, recent_tokens=0, block_size=32),
    ),
    # ... or per slot, when the cache evicts
    "streamingllm-pre-rope-4bit": Recipe(
        name="slpre", keys=QuantSpec(bits=4, pre_rope=True, path="keys"), values=QuantSpec(bits=4, axis="token", path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="streamingllm", budget_tokens=64, sink_tokens=4, window=16),
    ),
    # palu latents reconstructed in the kernel, pre-RoPE keys rotated there; values quantized after a Hadamard transform
    "palu-3bit-hadamard": Recipe(
        name="palu3", keys=QuantSpec(method="palu", bits=16, pre_rope=True, path="keys"),
        values=QuantSpec(method="palu", bits=3, hadamard=True, group_size=16, path="values"),
        cache=CacheSpec(sink_tokens=1, recent_tokens=0, block_size=32),
    ),
    "turboquant-3bit": Recipe(
        name="tq3", keys=QuantSpec(method="turboquant", bits=3, path="keys"), values=QuantSpec(method="turboquant", bits=3, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "turboquant-2.5bit": Recipe(  # the outlier split: keys 8 of 32 channels at 4 bits (the 24 others Haar-rotated)
        name="tq25", keys=QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.25, path="keys"),
        values=QuantSpec(method="turboquant", bits=2, extra_bits=0.5, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "turboquant-k3.5-v2.5-query-scale-block16": Recipe(  # keys of k / s (the query times s), the split, 16-token blocks
        name="tqqs", keys=QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25,
                                    channel_scale="query", path="keys"),
        values=QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.5, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=0, block_size=16),
    ),
    "turboquant-3bit-block16": Recipe(  # 16-token blocks (turboquant only): a block encoded every 16 steps
        name="tq3b16", keys=QuantSpec(method="turboquant", bits=3, path="keys"),
        values=QuantSpec(method="turboquant", bits=3, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=0, block_size=16),
    ),
}
CASES = [(name, "llama") for name in GENERATION_RECIPES] + [
    ("kvquant-3bit", "phi3"),  # partial rotary
    ("kvquant-3bit", "cohere"),  # interleaved pairs
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name, family", CASES)
def test_triton_backend_generates_the_torch_backends_tokens(name, family, device):
    model = tiny_model("llama", kv_heads=2) if family == "llama" else featured_model(family)
    model = model.to(device)
    recipe = GENERATION_RECIPES[name]
    tensors = _static_layer_tensors(model) if needs_fit(recipe) else None
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=80)
    by_torch, _ = _generate(model, recipe, "torch", ids, mask, layer_tensors=tensors)
    by_triton, cache = _generate(model, recipe, "triton", ids, mask, layer_tensors=tensors)
    assert cache.memory_report()["backend"] == "triton"
    assert cache.memory_report()["kernel_steps"] >= 5 * model.config.num_hidden_layers  # the kernel really ran
    # uniform and fp8 sides are encoded by the Triton encode kernel (the prefill's full blocks at least)
    quantizers = build_quantizers(recipe, 32, torch.float32, (tensors or [{}])[0])
    encoded = any(q.kernel_encode_format() is not None for q in quantizers)
    assert (cache.memory_report()["kernel_encodes"] > 0) == encoded
    assert torch.equal(by_torch.sequences, by_triton.sequences)
    # the logits too: a tiny random model's greedy tokens barely depend on attention
    torch.testing.assert_close(torch.stack(by_triton.logits), torch.stack(by_torch.logits), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", devices())
def test_triton_backend_generates_kivi_4bit_lean_as_the_torch_backend(device):
    """The bundled `kivi-4bit-lean` (128-token key blocks: the tiled kernel reads a block as two 64-token sub-tiles;
    values in 64-channel groups) at head_dim 64: a 200-token prompt fills a body block, generation reads it."""
    from kvtool.recipe import load_recipe

    model = tiny_model("llama", kv_heads=2, head_dim=64).to(device)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=200)
    recipe = load_recipe("kivi-4bit-lean")
    by_torch, _ = _generate(model, recipe, "torch", ids, mask)
    by_triton, cache = _generate(model, recipe, "triton", ids, mask)
    report = cache.memory_report()
    assert report["backend"] == "triton" and report["kernel_steps"] >= 5 * model.config.num_hidden_layers
    assert report["kernel_encodes"] > 0
    assert torch.equal(by_torch.sequences, by_triton.sequences)
    torch.testing.assert_close(torch.stack(by_triton.logits), torch.stack(by_torch.logits), rtol=1e-3, atol=1e-3)


@needs_interpreter
@pytest.mark.parametrize("dtype, precision", [(torch.float32, "exact"), (torch.float16, "half")])
def test_the_runtime_decodes_kivi_with_the_tiled_kernel_at_the_models_precision(dtype, precision, monkeypatch):
    """Every decode step of a kivi store goes through the tiled kernel (if a change sent it back to the general
    kernel, the GPU speed would be lost without any other test failing), with float16 products exactly when the
    model computes in a 16-bit dtype."""
    from kvtool.runtime.kernels import uniform_decode

    calls = []
    real = uniform_decode.uniform_decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("precision"))
        return real(*args, **kwargs)

    monkeypatch.setattr(uniform_decode, "uniform_decode_attention", spy)
    model = tiny_model("llama", kv_heads=2).to(dtype)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=80)
    out, cache = _generate(model, GENERATION_RECIPES["kivi"], "triton", ids, mask, tokens=4)
    layers = model.config.num_hidden_layers
    assert cache.memory_report()["kernel_steps"] == len(calls) >= 3 * layers
    assert set(calls) == {precision}
    assert out.sequences.shape[1] == 80 + 4


def _body_bytes(cache) -> list[dict[str, torch.Tensor]]:
    """Every layer's body blocks in table order, {name: (S, nb, ...)} viewed as bytes."""
    out = []
    for layer in cache.layers:
        store = layer.store
        ids = store.body_block_ids(0, int(store.body_len.max()))
        out.append({f"{part}.{name}": t.contiguous().view(torch.uint8) for part in ("k", "v")
                    for name, t in store.read_body(part, ids).items()})
    return out


@needs_interpreter
def test_the_encode_kernel_writes_the_torch_stores_bytes_and_encodes_while_decoding():
    """Prefill's full blocks land in the body pool byte for byte as the torch backend stores them; blocks that
    fill up while decoding are encoded by the kernel too, and generation still equals torch's."""
    model = tiny_model("llama", kv_heads=2)
    recipe = Recipe(
        name="k2v8", keys=QuantSpec(bits=2, path="keys"),
        values=QuantSpec(method="fp8", bits=8, fp8_format="e5m2", granularity="block", path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    )
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=80)
    _, torch_prefill = _generate(model, recipe, "torch", ids, mask, tokens=1)
    _, triton_prefill = _generate(model, recipe, "triton", ids, mask, tokens=1)
    encoded = triton_prefill.memory_report()["kernel_encodes"]
    assert encoded > 0 and torch_prefill.memory_report()["kernel_encodes"] == 0
    for by_torch, by_triton in zip(_body_bytes(torch_prefill), _body_bytes(triton_prefill)):
        assert by_torch.keys() == by_triton.keys()
        assert all(torch.equal(by_torch[name], by_triton[name]) for name in by_torch)
    by_torch, _ = _generate(model, recipe, "torch", ids, mask, tokens=28)
    by_triton, cache = _generate(model, recipe, "triton", ids, mask, tokens=28)
    assert cache.memory_report()["kernel_encodes"] > encoded  # a decode step flushed a block
    assert torch.equal(by_torch.sequences, by_triton.sequences)
    torch.testing.assert_close(torch.stack(by_triton.logits), torch.stack(by_torch.logits), rtol=1e-3, atol=1e-3)


@needs_interpreter
def test_triton_backend_refuses_formats_the_kernel_cannot_read_and_auto_stays_on_torch_on_cpu():
    model = tiny_model("llama")
    pre_rope = Recipe(name="pre", keys=QuantSpec(bits=4, pre_rope=True, path="keys"))
    assert CompressedRuntime.from_recipe(model, pre_rope, backend="triton").backend == "triton"
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(RuntimeConfigError, match="before RoPE .* changes its frequencies"):
        CompressedRuntime.from_recipe(dynamic, pre_rope, backend="triton")
    assert CompressedRuntime.from_recipe(dynamic, Recipe(name="q4"), backend="triton").backend == "triton"  # post-RoPE
    on_cpu = "numba" if numba_available() else "torch"  # auto on CPU: the Numba kernel, never Triton
    assert CompressedRuntime.from_recipe(model, Recipe(name="q4"), backend="auto").backend == on_cpu


@needs_interpreter
def test_triton_backend_reads_turboquant_and_per_head_palu_and_refuses_their_other_forms():
    """TurboQuant (QJL residual included) runs in the kernel; what still goes to the torch path says why: Palu latents
    of a head group."""
    model = tiny_model("llama", kv_heads=2)
    turbo = lambda **kw: Recipe(name="tq", keys=QuantSpec(method="turboquant", bits=3, path="keys", **kw))  # noqa: E731
    assert CompressedRuntime.from_recipe(model, turbo(), backend="triton").backend == "triton"
    assert CompressedRuntime.from_recipe(model, turbo(extra_bits=0.5), backend="triton").backend == "triton"
    assert CompressedRuntime.from_recipe(model, turbo(qjl=True), backend="triton").backend == "triton"
    g = torch.Generator().manual_seed(0)
    for groups, group_heads in ((2, 1), (1, 0)):  # one basis per KV head, or one for both
        spec = QuantSpec(method="palu", bits=16, pre_rope=True, group_heads=group_heads, path="keys")
        width = 32 * 2 // groups  # head_dim 32 x KV heads per group
        basis = torch.linalg.qr(torch.randn(groups, width, 24, generator=g)).Q
        tensors = [{"keys.basis": basis, "keys.bias": torch.zeros(groups, width)}] * 2
        recipe = Recipe(name="palu", keys=spec)
        if group_heads == 1:
            assert CompressedRuntime.from_recipe(model, recipe, tensors, backend="triton").backend == "triton"
        else:
            with pytest.raises(RuntimeConfigError, match="palu group_heads 0 stores one latent for 2 KV heads"):
                CompressedRuntime.from_recipe(model, recipe, tensors, backend="triton")
            assert CompressedRuntime.from_recipe(model, recipe, tensors, backend="auto").backend == "torch"


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeConfigError, match="CUDA"):
        CompressedRuntime.from_recipe(model, Recipe(name="q4"), backend="triton")
    assert os.environ.get("TRITON_INTERPRET") is None


# --- RocketKV's stage 2: the sparse read -----------------------------------------------------------
def sparse_listing(g, device, head_dim: int, group: int):
    """Float pools and ragged slot lists of 4 streams (empty, one slot, longer than a tile, invalid entries anywhere,
    repeated padding ids), rows and a new token: (k_pool, v_pool (pool, D) fp16 on device, slots (S, 40), valid (S, 40),
    q (S, G, D) scaled, new_k, new_v (S, D)) on the CPU but the pools."""
    pool = 40 * FBS
    k_pool = torch.randn(pool, head_dim, generator=g).half().to(device)
    v_pool = torch.randn(pool, head_dim, generator=g).half().to(device)
    counts = [0, 1, 7, 37]
    s, width = len(counts), 40
    slots = torch.randint(0, pool, (s, width), generator=g)
    valid = torch.zeros(s, width, dtype=torch.bool)
    for stream, n in enumerate(counts):
        valid[stream, torch.randperm(width, generator=g)[:n]] = True  # valid entries scattered among invalid ones
    q = torch.randn(s, group, head_dim, generator=g) * head_dim ** -0.5
    new_k, new_v = torch.randn(s, head_dim, generator=g), torch.randn(s, head_dim, generator=g)
    return k_pool, v_pool, slots, valid, q, new_k, new_v


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("head_dim, group", [(64, 1), (128, 4), (256, 8)])
@pytest.mark.parametrize("softcap, sink", [(None, False), (30.0, True)])
def test_sparse_kernel_equals_a_dense_softmax_over_the_listed_slots(device, head_dim, group, softcap, sink):
    """Ragged lists (empty, one slot, longer than a tile, invalid entries anywhere, repeated padding ids)."""
    from kvtool.runtime.kernels.sparse_decode import sparse_decode_attention

    g = torch.Generator().manual_seed(head_dim + group)
    k_pool, v_pool, slots, valid, q, new_k, new_v = sparse_listing(g, device, head_dim, group)
    s = slots.shape[0]
    sinks = torch.randn(s, group, generator=g) if sink else None
    out = sparse_decode_attention(q.to(device), new_k.to(device), new_v.to(device), k_pool, v_pool, slots.to(device),
                                  valid.to(device), softcap, None if sinks is None else sinks.to(device)).cpu()
    for stream in range(s):
        ids = slots[stream][valid[stream]]
        keys = torch.cat([k_pool.cpu()[ids].float(), new_k[stream : stream + 1]])  # (n + 1, D)
        values = torch.cat([v_pool.cpu()[ids].float(), new_v[stream : stream + 1]])
        logits = q[stream] @ keys.T  # (G, n + 1)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if sinks is not None:
            logits = torch.cat([logits, sinks[stream][:, None]], dim=1)
            values = torch.cat([values, torch.zeros(1, head_dim)])
        want = torch.softmax(logits, dim=-1) @ values
        torch.testing.assert_close(out[stream], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("head_dim, group", [(64, 1), (256, 8)])
def test_sparse_kernel_adds_the_unread_estimate_as_one_more_softmax_term(device, head_dim, group):
    """``unread: estimate``: the kernel sums the keys and values it reads; the estimate made from them joins the
    softmax as one more term (logit -inf: none)."""
    from kvtool.runtime.kernels.sparse_decode import sparse_decode_attention

    g = torch.Generator().manual_seed(head_dim + 7)
    k_pool, v_pool, slots, valid, q, new_k, new_v = sparse_listing(g, device, head_dim, group)
    s = slots.shape[0]
    logit = torch.randn(s, group, generator=g)
    logit[1] = float("-inf")  # a stream with nothing unread: no term
    term_value = torch.randn(s, head_dim, generator=g)
    seen = {}

    def unread(read_k, read_v):  # the layer's estimate from what the kernel read
        seen["k"], seen["v"] = read_k.cpu(), read_v.cpu()
        return logit.to(read_k.device), term_value.to(read_k.device)

    out = sparse_decode_attention(q.to(device), new_k.to(device), new_v.to(device), k_pool, v_pool, slots.to(device),
                                  valid.to(device), unread=unread).cpu()
    for stream in range(s):
        ids = slots[stream][valid[stream]]
        read_keys, read_values = k_pool.cpu()[ids].float(), v_pool.cpu()[ids].float()
        torch.testing.assert_close(seen["k"][stream], read_keys.sum(dim=0), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(seen["v"][stream], read_values.sum(dim=0), rtol=1e-4, atol=1e-4)
        keys = torch.cat([read_keys, new_k[stream : stream + 1]])  # (n + 1, D)
        values = torch.cat([read_values, new_v[stream : stream + 1], term_value[stream : stream + 1]])
        logits = torch.cat([q[stream] @ keys.T, logit[stream][:, None]], dim=1)  # (G, n + 2): the term last
        want = torch.softmax(logits, dim=-1) @ values
        torch.testing.assert_close(out[stream], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
def test_sparse_kernel_adds_a_precomputed_unread_term_with_a_value_per_row(device):
    """``unread: estimate_blocks``: the term (logit (S, R), value (S, R, D)) is known before the kernel runs and joins
    each row's softmax with that row's value; the kernel sums nothing."""
    from kvtool.runtime.kernels.sparse_decode import sparse_decode_attention

    head_dim, group = 64, 4
    g = torch.Generator().manual_seed(31)
    k_pool, v_pool, slots, valid, q, new_k, new_v = sparse_listing(g, device, head_dim, group)
    s = slots.shape[0]
    logit = torch.randn(s, group, generator=g)
    logit[0] = float("-inf")
    term_value = torch.randn(s, group, head_dim, generator=g)
    out = sparse_decode_attention(q.to(device), new_k.to(device), new_v.to(device), k_pool, v_pool, slots.to(device),
                                  valid.to(device), unread=(logit.to(device), term_value.to(device))).cpu()
    for stream in range(s):
        ids = slots[stream][valid[stream]]
        keys = torch.cat([k_pool.cpu()[ids].float(), new_k[stream : stream + 1]])  # (n + 1, D)
        values = torch.cat([v_pool.cpu()[ids].float(), new_v[stream : stream + 1]])
        logits = torch.cat([q[stream] @ keys.T, logit[stream][:, None]], dim=1)  # (G, n + 2): the term last
        p = torch.softmax(logits, dim=-1)
        want = p[:, :-1] @ values + p[:, -1:] * term_value[stream]
        torch.testing.assert_close(out[stream], want, rtol=1e-4, atol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("unread, budget", [("drop", "per_head"), ("estimate", "per_head"), ("estimate_blocks", "shared")])
def test_triton_backend_runs_rocketkv_stage_two_as_the_torch_backend_does(unread, budget):
    """Both stages: the sparse read runs in the kernel at every decode step of the full-attention layers and
    generates the torch backend's tokens and logits, reading the same fraction of the tokens."""
    from kvtool.recipe import load_recipe

    model = tiny_model("llama", kv_heads=2)
    recipe = load_recipe("rocketkv")
    recipe = dataclasses.replace(recipe, sparse_attention=dataclasses.replace(recipe.sparse_attention, min_tokens=8,
                                                                              unread=unread, read_budget=budget))
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=80)
    by_torch, torch_cache = _generate(model, recipe, "torch", ids, mask, tokens=8)
    by_triton, cache = _generate(model, recipe, "triton", ids, mask, tokens=8)
    report = cache.memory_report()
    assert report["backend"] == "triton" and report["kernel_steps"] >= 7 * model.config.num_hidden_layers
    assert report["sparse_read_fraction"] == torch_cache.memory_report()["sparse_read_fraction"] < 0.35
    assert torch.equal(by_torch.sequences, by_triton.sequences)
    torch.testing.assert_close(torch.stack(by_triton.logits), torch.stack(by_torch.logits), rtol=1e-3, atol=1e-3)
