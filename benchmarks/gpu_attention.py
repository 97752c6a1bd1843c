"""Decode attention on the GPU: kvtool's Triton kernel over the paged store vs 16-bit SDPA.

    python -m benchmarks.gpu_attention            # needs CUDA; table + benchmarks/results/gpu_attention.json
    python -m benchmarks.gpu_attention --quick    # 8K and 32K, batch 1 and 8

For each head shape (Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128; Gemma-3: 8 query
heads, 1 KV head, head_dim 256), context and batch: the GPU kernel time of one decode-attention
call (torch.profiler, mean of 10 after warm-up) for torch SDPA in bf16 over a dense cache, and
for the kernel over float16 blocks and uniform 4- and 2-bit blocks (KIVI layout: per-channel key
scales, per-token value scales); achieved GB/s = bytes the call must read (cache bytes held)
/ kernel time; speed-up over SDPA's kernels; and the 4-bit call's CUDA-event time (median of 20),
which also counts the host's launch. Rows that do not fit in memory are reported as such.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

SHAPES = {"llama3-8b": (32, 8, 128), "gemma3": (8, 1, 256)}
BS, FBS = 128, 16


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


def _kernel_time(fn, repeats: int = 10) -> float:
    """Seconds of GPU kernel time per call (torch.profiler's CUDA time of every kernel the call launches), without
    the host's launch time that CUDA events between calls also count."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()) / repeats / 1e6


def _store(batch, kv_heads, head_dim, context, bits, device):
    """Body-only paged store of `context` tokens per stream: (call kwargs, bytes held)."""
    from kvtool.methods.quant.packing import packed_rows
    from kvtool.runtime.kernels.body_format import BodyFormat

    s = batch * kv_heads
    blocks = context // BS
    table = torch.arange(s * blocks, device=device, dtype=torch.int32).reshape(s, blocks)
    cap = s * blocks
    if bits == 16:
        kb = {"data": torch.randn(cap, BS, head_dim, device=device, dtype=torch.float16)}
        vb = {"data": torch.randn(cap, BS, head_dim, device=device, dtype=torch.float16)}
        fmt = (BodyFormat(16, False, 1), BodyFormat(16, False, 1))
    else:
        rows = packed_rows(BS, bits)
        kb = {"codes": torch.randint(0, 256, (cap, rows, head_dim), device=device, dtype=torch.uint8),
              "scale": torch.rand(cap, head_dim, device=device).half(), "zero": torch.rand(cap, head_dim, device=device).half()}
        vb = {"codes": torch.randint(0, 256, (cap, rows, head_dim), device=device, dtype=torch.uint8),
              "scale": torch.rand(cap, BS, head_dim // 32, device=device).half(),
              "zero": torch.rand(cap, BS, head_dim // 32, device=device).half()}
        fmt = (BodyFormat(bits, True, 1), BodyFormat(bits, False, 32))
    held = sum(t.numel() * t.element_size() for t in [*kb.values(), *vb.values()])
    empty_float = torch.zeros(1, FBS, head_dim, device=device, dtype=torch.float16)
    kwargs = dict(float_k=empty_float, float_v=empty_float, float_table=torch.zeros(s, 1, dtype=torch.int32, device=device),
                  float_len=torch.zeros(s, dtype=torch.int64, device=device), body=(kb, vb), body_table=table,
                  body_len=torch.full((s,), blocks, dtype=torch.int64, device=device), formats=fmt, block_size=BS)
    return kwargs, held


def row(shape, context, batch, device):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    hq, hkv, d = SHAPES[shape]
    out = {"shape": shape, "context": context, "batch": batch}
    try:
        q = torch.randn(batch, hq, 1, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, hkv, context, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        out["sdpa_s"] = _time(sdpa)
        out["sdpa_kernel_s"] = _kernel_time(sdpa)
        out["sdpa_gbps"] = 2 * k.numel() * 2 / out["sdpa_kernel_s"] / 1e9
        sdpa = k = v = None  # free the dense cache before the paged stores are built
        qs = torch.randn(batch * hkv, hq // hkv, d, device=device)
        new = torch.randn(batch * hkv, d, device=device)
        for bits in (16, 4, 2):
            kwargs, held = _store(batch, hkv, d, context, bits, device)
            try:
                seconds = _time(lambda: paged_decode_attention(qs, new, new, **kwargs))
            except Exception as exc:  # a kernel that fails to compile or run: the row says so, the table goes on
                out["error"] = f"{bits}-bit: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                return out
            kernel = _kernel_time(lambda: paged_decode_attention(qs, new, new, **kwargs))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_attention.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_attention needs a CUDA GPU (the Triton kernels' correctness is tested on CPU by the test suite)")
    if args.quick:
        args.contexts, args.batches = [8192, 32768], [1, 8]
    rows = []
    for shape in SHAPES:
        for context in args.contexts:
            for batch in args.batches:
                rows.append(row(shape, context, batch, "cuda"))
                print(json.dumps(rows[-1]), flush=True)  # as it goes: a long grid shows progress
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode attention, {torch.cuda.get_device_name()}")
    for column in ("shape", "context", "batch", "SDPA bf16 us", "fp16 blocks us", "4-bit us", "2-bit us", "4-bit GB/s", "4-bit x SDPA",
                   "2-bit x SDPA", "4-bit call ms"):
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["shape"], str(r["context"]), str(r["batch"]), r["error"], *[""] * 7)
            continue
        us = lambda key: f"{1e6 * r[key]:.0f}"  # noqa: E731
        table.add_row(r["shape"], str(r["context"]), str(r["batch"]), us("sdpa_kernel_s"), us("kvtool_16bit_kernel_s"),
                      us("kvtool_4bit_kernel_s"), us("kvtool_2bit_kernel_s"), f"{r['kvtool_4bit_gbps']:.0f}",
                      f"{r['kvtool_4bit_speedup']:.2f}", f"{r['kvtool_2bit_speedup']:.2f}", f"{1e3 * r['kvtool_4bit_s']:.2f}")
    Console().print(table)
    from kvtool.fileio import write_json_atomic

    machine = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform()}
    write_json_atomic(args.out, {"machine": machine, "rows": rows})
    print(json.dumps(machine))


if __name__ == "__main__":
    main()
