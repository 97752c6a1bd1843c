"""What 8-bit formats for the float slots (sinks, recent window, open block) would cost, before building one.

Runs `benchmarks.output_kl` with the runtime's float writes rounded through a format and kept in 16 bits: every
`LayerStore.write_float` (prefill, sinks, the window rewritten at a flush, eviction's refills) and the token the CPU
kernel writes in a decode step. The attention and the block codes then see exactly what an 8-bit store would hold;
the bytes do not change (this measures quality only). ``--where encode``: only what a flush hands to the block
codes is rounded (the attention reads 16 bits), which splits the cost into the codes' part and the attention's.
``--exact-sinks``: sink writes are left alone.

    python -m benchmarks.float_slot_formats --model gemma3-270m --format int8-g32 --samples 8 --seq-len 2048 \\
        --batch-size 4 --recipes recipes/turboquant-k3.5-v2.5-n8.yaml --out kl.json

Formats: ``e4m3`` (no scale: `cache.float_dtype: float8_e4m3`), ``e4m3-token`` (one scale per token, amax / 448),
``int8-token`` (amax / 127 per token), ``int8-gN`` (one float16 scale per N channels of a token; N = 32 is
`cache.float_dtype: int8`, built since: measure it with `benchmarks.output_kl` and a recipe that sets it).
"""

from __future__ import annotations

import argparse
import sys

import torch

import kvtool.runtime.kernels.cpu_decode as cpu_decode
from kvtool.runtime import store as store_module

E4M3_MAX = 448.0


def _scaled(x: torch.Tensor, group: int, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) as (..., D / group, group) and its float16 scale per group (amax / limit)."""
    grouped = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = (grouped.abs().amax(-1, keepdim=True) / limit).half().float().clamp(min=2.0**-24)  # an all-zero group: 0
    return grouped, scale


def rounded(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x (..., D) as a store in ``fmt`` would give it back, in x's dtype."""
    if fmt == "e4m3":
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    if fmt == "e4m3-token":
        grouped, scale = _scaled(x, x.shape[-1], E4M3_MAX)
        out = (grouped / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    elif fmt == "int8-token" or fmt.startswith("int8-g"):  # the store's own int8 slots (`cache.float_dtype: int8`: 32)
        group = x.shape[-1] if fmt == "int8-token" else int(fmt[len("int8-g"):])
        return store_module.decode_int8_slots(*store_module.encode_int8_slots(x, group)).to(x.dtype)
    else:
        raise ValueError(f"unknown format '{fmt}': e4m3, e4m3-token, int8-token or int8-g<channels>")
    return out.reshape(x.shape).to(x.dtype)


def patch(fmt: str, where: str = "all", exact_sinks: bool = False) -> None:
    """Round the runtime's float writes (``where`` "all") or only what a flush encodes ("encode") through ``fmt``."""
    round_kv = lambda data: {n: (rounded(v, fmt) if n in ("k", "v") else v) for n, v in data.items()}  # noqa: E731
    if where == "encode":
        read_float_at = store_module.LayerStore.read_float_at

        def read_rounded(self, names, start, width):
            return round_kv(read_float_at(self, names, start, width))

        store_module.LayerStore.read_float_at = read_rounded  # only `_flush` reads float slots this way
        return
    write_float = store_module.LayerStore.write_float

    def write_rounded(self, start, count, data):
        if exact_sinks and (start < self.layout.sink_tokens).all():  # the sinks' own write
            return write_float(self, start, count, data)
        return write_float(self, start, count, round_kv(data))

    store_module.LayerStore.write_float = write_rounded
    kernel = cpu_decode.cpu_decode_attention

    def kernel_rounded(q, new_k, new_v, *args, **kwargs):
        return kernel(q, rounded(new_k, fmt), rounded(new_v, fmt), *args, **kwargs)

    cpu_decode.cpu_decode_attention = kernel_rounded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", required=True)
    parser.add_argument("--where", choices=["all", "encode"], default="all")
    parser.add_argument("--exact-sinks", action="store_true")
    args, rest = parser.parse_known_args()
    rounded(torch.zeros(1, 64), args.format)  # an unknown format fails here, before a model loads
    patch(args.format, args.where, args.exact_sinks)
    from benchmarks import output_kl

    sys.argv = [sys.argv[0], *rest]
    output_kl.main()


if __name__ == "__main__":
    main()
