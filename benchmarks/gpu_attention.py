"""Decode attention on the GPU: kvtool's Triton kernels over the paged store vs 16-bit SDPA.

    python -m benchmarks.gpu_attention            # needs CUDA; table + benchmarks/results/gpu_attention.json
    python -m benchmarks.gpu_attention --quick    # 8K and 32K, batch 1 and 8
    python -m benchmarks.gpu_attention --sweep    # tile / warps / pipeline stages of the tiled kernel, 4 shapes
    python -m benchmarks.gpu_attention --general  # also the general kernel (one block at a time) on 4-bit blocks
    python -m benchmarks.gpu_attention --split-sweep  # 4-bit decode time per split count at few-stream shapes

For each head shape (Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128; Gemma-3: 8 query
heads, 1 KV head, head_dim 256), context and batch: the GPU kernel time of one decode-attention
call (torch.profiler, mean of 10 after warm-up) for torch SDPA in bf16 over a dense cache, and
for kvtool's kernel (`paged_decode_attention`, which takes the tiled `uniform_decode` kernel for
these formats, with float16 operands as a bf16 model's runtime does) over float16 blocks and
uniform 4- and 2-bit blocks (KIVI layout: per-channel key scales, per-token value scales, group
32; `--block-size` tokens per block, 32 as the bundled kivi recipes); achieved GB/s = bytes the
call must read (cache bytes held) / kernel time; speed-up over SDPA's kernels; and the 4-bit
call's CUDA-event time (median of 20), which also counts the host's launch. Every row checks
stream 0's output against a dense float32 softmax over its blocks decoded in torch. Rows that do
not fit in memory are reported as such.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

SHAPES = {"llama3-8b": (32, 8, 128), "gemma3": (8, 1, 256)}
FBS = 16
SWEEP_SHAPES = [("llama3-8b", 32768, 8), ("gemma3", 32768, 8), ("llama3-8b", 8192, 32), ("gemma3", 131072, 1)]  # (shape, context, batch)


def _time(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / 1e3


def _kernel_times(fn, repeats: int = 10) -> dict[str, float]:
    """Seconds of GPU time per call of each kernel the call launches (torch.profiler's CUDA time), without the
    host's launch time that CUDA events between calls also count."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return {event.key: event.self_device_time_total / repeats / 1e6 for event in prof.key_averages()
            if event.self_device_time_total > 0}


def _kernel_time(fn, repeats: int = 10) -> float:
    """Seconds of GPU kernel time per call, all kernels together (`_kernel_times`)."""
    return sum(_kernel_times(fn, repeats).values())


def _store(batch, kv_heads, head_dim, context, bits, device, BS):
    """Body-only paged store of `context` tokens per stream: (call kwargs, bytes held)."""
    from kvtool.methods.quant.packing import packed_rows
    from kvtool.runtime.kernels.body_format import BodyFormat

    s = batch * kv_heads
    blocks = context // BS
    table = torch.randperm(s * blocks, device=device).to(torch.int32).reshape(s, blocks)  # scattered, as a pool is
    cap = s * blocks
    if bits == 16:
        kb = {"data": torch.randn(cap, BS, head_dim, device=device, dtype=torch.float16)}
        vb = {"data": torch.randn(cap, BS, head_dim, device=device, dtype=torch.float16)}
        fmt = (BodyFormat(16, False, 1), BodyFormat(16, False, 1))
    else:
        rows = packed_rows(BS, bits)
        levels = 2**bits - 1  # codes of keys of spread ~1 per channel, values of spread ~1 per token
        kb = {"codes": torch.randint(0, 256, (cap, rows, head_dim), device=device, dtype=torch.uint8),
              "scale": (torch.rand(cap, head_dim, device=device) * 2 / levels).half(),
              "zero": (-torch.rand(cap, head_dim, device=device)).half()}
        vb = {"codes": torch.randint(0, 256, (cap, rows, head_dim), device=device, dtype=torch.uint8),
              "scale": (torch.rand(cap, BS, head_dim // 32, device=device) * 2 / levels).half(),
              "zero": (-torch.rand(cap, BS, head_dim // 32, device=device)).half()}
        fmt = (BodyFormat(bits, True, 1), BodyFormat(bits, False, 32))
    held = sum(t.numel() * t.element_size() for t in [*kb.values(), *vb.values()])
    empty_float = torch.zeros(1, FBS, head_dim, device=device, dtype=torch.float16)
    kwargs = dict(float_k=empty_float, float_v=empty_float, float_table=torch.zeros(s, 1, dtype=torch.int32, device=device),
                  float_len=torch.zeros(s, dtype=torch.int64, device=device), body=(kb, vb), body_table=table,
                  body_len=torch.full((s,), blocks, dtype=torch.int64, device=device), formats=fmt, block_size=BS)
    return kwargs, held


def _stream0_reference(kwargs, qs, new, bits):
    """Stream 0's attention (R, D) float32 by a dense softmax over its blocks decoded in torch."""
    from kvtool.methods.quant.packing import unpack_codes

    kb, vb = kwargs["body"]
    ids = kwargs["body_table"][0].long()
    bs = kwargs["block_size"]
    if bits == 16:
        k, v = kb["data"][ids].float(), vb["data"][ids].float()
    else:
        k = unpack_codes(kb["codes"][ids], bits, bs).float() * kb["scale"][ids, None].float() + kb["zero"][ids, None].float()
        group = k.shape[-1] // vb["scale"].shape[-1]
        v = unpack_codes(vb["codes"][ids], bits, bs).float()
        v = v * vb["scale"][ids].float().repeat_interleave(group, -1) + vb["zero"][ids].float().repeat_interleave(group, -1)
    d = k.shape[-1]
    keys = torch.cat([k.reshape(-1, d), new[:1]])
    values = torch.cat([v.reshape(-1, d), new[:1]])
    return torch.softmax(qs[0] @ keys.T, dim=-1) @ values


def row(shape, context, batch, device, block_size=32, general=False):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    hq, hkv, d = SHAPES[shape]
    out = {"shape": shape, "context": context, "batch": batch, "block_size": block_size}
    try:
        q = torch.randn(batch, hq, 1, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, hkv, context, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        out["sdpa_s"] = _time(sdpa)
        out["sdpa_kernel_s"] = _kernel_time(sdpa)
        out["sdpa_gbps"] = 2 * k.numel() * 2 / out["sdpa_kernel_s"] / 1e9
        sdpa = k = v = None  # free the dense cache before the paged stores are built
        qs = torch.randn(batch * hkv, hq // hkv, d, device=device) / d**0.5
        new = torch.randn(batch * hkv, d, device=device)
        for bits in (16, 4, 2):
            kwargs, held = _store(batch, hkv, d, context, bits, device, block_size)
            call = lambda: paged_decode_attention(qs, new, new, **kwargs, precision="half")  # noqa: E731
            try:
                seconds = _time(call)
                reference = _stream0_reference(kwargs, qs, new, bits)
                error = float((call()[0] - reference).abs().max() / reference.abs().max())
            except Exception as exc:  # a kernel that fails to compile or run: the row says so, the table goes on
                out["error"] = f"{bits}-bit: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                return out
            out[f"kvtool_{bits}bit_max_error"] = error  # relative to the largest output of stream 0
            if error > 5e-3:
                out["error"] = f"{bits}-bit: stream 0 differs from the dense reference by {error:.2e} of its largest value"
                return out
            kernels = _kernel_times(call)
            kernel = sum(kernels.values())
            out[f"kvtool_{bits}bit_kernels_us"] = {name: round(t * 1e6, 2) for name, t in kernels.items()}  # partials, merge
            if general and bits == 4:
                general_call = lambda: paged_decode_attention(qs, new, new, **kwargs, kernel="general")  # noqa: E731
                out["general_4bit_kernel_s"] = _kernel_time(general_call)
            out[f"kvtool_{bits}bit_s"] = seconds
            out[f"kvtool_{bits}bit_kernel_s"] = kernel
            out[f"kvtool_{bits}bit_gbps"] = held / kernel / 1e9
            out[f"kvtool_{bits}bit_speedup"] = out["sdpa_kernel_s"] / kernel
            kwargs = None  # free this store before the next one
            torch.cuda.empty_cache()
    except torch.cuda.OutOfMemoryError:
        out["error"] = "out of memory"
        torch.cuda.empty_cache()
    return out


def _checked_timing(config: dict, call, reference: torch.Tensor, held: int) -> dict:
    """One tuning configuration's row: stream 0 checked against the dense reference, then the kernel time of the call
    (all kernels, and the merge pass's share); an error (compile, launch, a wrong result) goes in the row."""
    try:
        error = float((call()[0] - reference).abs().max() / reference.abs().max())
        kernels = _kernel_times(call)
    except Exception as exc:
        row = {**config, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    else:
        total = sum(kernels.values())
        merge = sum(t for name, t in kernels.items() if "merge" in name)
        row = {**config, "us": total * 1e6, "merge_us": merge * 1e6, "gbps": held / total / 1e9, "max_error": error}
        if error > 5e-3:
            row["error"] = f"stream 0 differs from the dense reference by {error:.2e} of its largest value"
    print(json.dumps(row), flush=True)
    return row


# (tokens per product (0: the default plan), warps, stages) tried by `--sweep`. Two other designs were measured and
# removed (benchmarks/RESULTS.md, "GPU: two kernel designs that lost", commit fcf3379): a block-by-block walk in
# two-dimensional tiles (slower on codes in 7 of 8 shape x bits rows, up to 6x) and register caps (maxnreg 128-192:
# the spills cost more than the occupancy gains)
SWEEP = [(0, 2, 2), (16, 2, 2), (64, 2, 2), (0, 4, 2), (0, 2, 3)]


def sweep(shape: str, context: int, batch: int, block_size: int, device, configs=SWEEP) -> list[dict]:
    """Kernel time of the tiled kernel per (tokens per product, warps, pipeline stages, bits) at one shape; each
    configuration's stream 0 is checked against the dense reference first."""
    from kvtool.runtime.kernels.uniform_decode import uniform_decode_attention

    hq, hkv, d = SHAPES[shape]
    qs = torch.randn(batch * hkv, hq // hkv, d, device=device) / d**0.5
    new = torch.randn(batch * hkv, d, device=device)
    rows = []
    for bits in (4, 2, 16):
        kwargs, held = _store(batch, hkv, d, context, bits, device, block_size)
        reference = _stream0_reference(kwargs, qs, new, bits)
        for tile, warps, stages in configs:
            config = {"shape": shape, "context": context, "batch": batch, "bits": bits, "tile": tile, "warps": warps,
                      "stages": stages}
            call = lambda: uniform_decode_attention(  # noqa: E731
                qs, new, new, **kwargs, precision="half", tile_tokens=tile or None, num_warps=warps, num_stages=stages)
            rows.append(_checked_timing(config, call, reference, held))
        kwargs = None
        torch.cuda.empty_cache()
    return rows


SPLIT_SHAPES = [("llama3-8b", 8192, 1), ("llama3-8b", 32768, 1), ("llama3-8b", 32768, 8), ("gemma3", 32768, 1),
                ("gemma3", 131072, 1), ("gemma3", 32768, 8)]  # (shape, context, batch): few streams, where splits matter
SPLIT_COUNTS = [0, 32, 64, 128, 256, 512, 1024]  # 0: `splits_for`'s choice


def split_sweep(block_size: int, device, bits: int = 4) -> list[dict]:
    """Kernel time (partials + merge) of the tiled kernel per split count at few-stream shapes, each count's stream 0
    checked against the dense reference: how many programs per stream a short batch needs."""
    from kvtool.runtime.kernels.uniform_decode import uniform_decode_attention

    rows = []
    for shape, context, batch in SPLIT_SHAPES:
        hq, hkv, d = SHAPES[shape]
        qs = torch.randn(batch * hkv, hq // hkv, d, device=device) / d**0.5
        new = torch.randn(batch * hkv, d, device=device)
        kwargs, held = _store(batch, hkv, d, context, bits, device, block_size)
        reference = _stream0_reference(kwargs, qs, new, bits)
        for splits in SPLIT_COUNTS:
            call = lambda: uniform_decode_attention(qs, new, new, **kwargs, precision="half", splits=splits or None)  # noqa: E731
            config = {"shape": shape, "context": context, "batch": batch, "bits": bits, "splits": splits or "auto"}
            rows.append(_checked_timing(config, call, reference, held))
        kwargs = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--block-size", type=int, default=32, help="tokens per body block (bundled kivi recipes: 32)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--general", action="store_true", help="also time the general kernel on 4-bit blocks")
    parser.add_argument("--sweep", action="store_true", help="tune tile / warps / stages at SWEEP_SHAPES and stop")
    parser.add_argument("--sweep-shapes", type=int, default=len(SWEEP_SHAPES), help="sweep the first N of SWEEP_SHAPES")
    parser.add_argument("--split-sweep", action="store_true",
                        help="time 4-bit decode per split count (SPLIT_COUNTS) at few-stream shapes (SPLIT_SHAPES) and stop")
    parser.add_argument("--profile-one", action="store_true",
                        help="run the 4-bit kernel a few times at Llama-3-8B 32K x 8 and stop (for a profiler such as ncu)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_attention.json"))
    args = parser.parse_args()
    if args.profile_one:
        from kvtool.runtime.kernels.decode_attention import paged_decode_attention

        hq, hkv, d = SHAPES["llama3-8b"]
        kwargs, _ = _store(8, hkv, d, 32768, 4, "cuda", args.block_size)
        qs, new = torch.randn(8 * hkv, hq // hkv, d, device="cuda") / d**0.5, torch.randn(8 * hkv, d, device="cuda")
        for _ in range(5):
            paged_decode_attention(qs, new, new, **kwargs, precision="half")
        torch.cuda.synchronize()
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_attention needs a CUDA GPU (the Triton kernels' correctness is tested on CPU by the test suite)")
    from kvtool.fileio import write_json_atomic

    machine = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform()}
    if args.split_sweep:
        rows = split_sweep(args.block_size, "cuda")
        write_json_atomic(args.out.with_name("gpu_attention_splits.json"), {"machine": machine, "rows": rows})
        return
    if args.sweep:
        rows = []
        for shape, context, batch in SWEEP_SHAPES[: args.sweep_shapes]:
            rows += sweep(shape, context, batch, args.block_size, "cuda")
        for shape, context, batch in SWEEP_SHAPES[: args.sweep_shapes]:
            for bits in (4, 2, 16):
                timed = [r for r in rows if (r["shape"], r["context"], r["batch"], r["bits"]) == (shape, context, batch, bits)
                         and "us" in r and "error" not in r]
                if timed:
                    default = next((r for r in timed if (r["tile"], r["warps"], r["stages"]) == SWEEP[0]), None)
                    best = min(timed, key=lambda r: r["us"])
                    print("best:", json.dumps({**best, "default_us": default and default["us"]}))
        write_json_atomic(args.out.with_name("gpu_attention_sweep.json"), {"machine": machine, "rows": rows})
        return
    if args.quick:
        args.contexts, args.batches = [8192, 32768], [1, 8]
    rows = []
    for shape in args.shapes:
        for context in args.contexts:
            for batch in args.batches:
                rows.append(row(shape, context, batch, "cuda", args.block_size, args.general))
                print(json.dumps(rows[-1]), flush=True)  # as it goes: a long grid shows progress
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode attention, {torch.cuda.get_device_name()}")
    columns = ("shape", "context", "batch", "SDPA bf16 us", "fp16 blocks us", "4-bit us", "2-bit us", "fp16 GB/s", "4-bit GB/s",
               "2-bit GB/s", "4-bit x SDPA", "2-bit x SDPA", "4-bit call ms", "4-bit merge us", "general 4-bit us")
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["shape"], str(r["context"]), str(r["batch"]), r["error"], *[""] * (len(columns) - 4))
            continue
        us = lambda key: f"{1e6 * r[key]:.0f}" if key in r else ""  # noqa: E731
        merge = lambda r: f"{sum(t for name, t in r['kvtool_4bit_kernels_us'].items() if 'merge' in name):.0f}"  # noqa: E731
        table.add_row(r["shape"], str(r["context"]), str(r["batch"]), us("sdpa_kernel_s"), us("kvtool_16bit_kernel_s"),
                      us("kvtool_4bit_kernel_s"), us("kvtool_2bit_kernel_s"), f"{r['kvtool_16bit_gbps']:.0f}",
                      f"{r['kvtool_4bit_gbps']:.0f}", f"{r['kvtool_2bit_gbps']:.0f}", f"{r['kvtool_4bit_speedup']:.2f}",
                      f"{r['kvtool_2bit_speedup']:.2f}", f"{1e3 * r['kvtool_4bit_s']:.2f}", merge(r), us("general_4bit_kernel_s"))
    Console().print(table)
    write_json_atomic(args.out, {"machine": machine, "rows": rows})
    print(json.dumps(machine))


if __name__ == "__main__":
    main()
