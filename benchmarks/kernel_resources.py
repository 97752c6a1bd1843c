"""Registers, spills and instruction mix of the tiled decode kernel on an NVIDIA GPU, read without one.

    python -m benchmarks.kernel_resources                  # sm_90 (H100 / H200): the default plans of 2/4/8/16 bits
    python -m benchmarks.kernel_resources --bits 4 --head-dims 128 --tiles 32 64 --warps 2 4 --stages 2 3

Triton compiles `uniform_decode._uniform_partials` for the target from this machine (same constants as
the runtime: `uniform_decode.plan_tiles`, float16 products with the inline-PTX code path), and the
tools in Triton's wheel read the binary: registers per thread and stack bytes (spills) from
`cuobjdump -res-usage`, the SASS instructions from `nvdisasm`. On an H100 the tiled kernel was
register-bound (255 registers, 12.5% occupancy: `benchmarks/RESULTS.md`), so this is the number to
move first, and it costs no device time. The occupancy column is the register limit alone (64K
registers and 64 warps per SM; shared memory and the allocation granularity ignored). The local
Triton version may allocate differently from the GPU machine's: compare plans, not versions.
Table + benchmarks/results/kernel_resources.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

KEY_GROUP = 32  # KIVI layout: per-channel keys, per-token values in groups of 32 channels


def _formats(bits: int):
    from kvtool.runtime.kernels.body_format import BodyFormat

    if bits == 16:
        return BodyFormat(16, False, 1), BodyFormat(16, False, 1)
    return BodyFormat(bits, True, 1), BodyFormat(bits, False, KEY_GROUP)


def _signature(fn, bits: int, constants: dict) -> dict:
    """Triton types of the kernel's arguments (pointers by what they hold; tables int32, lengths int64)."""
    halves = {"fk_ptr", "fv_ptr", "fks_ptr", "fvs_ptr", "ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr"}
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in ("q_ptr", "m_out", "l_out", "acc_out"):
            sig[name] = "*fp32"
        elif name in halves:
            sig[name] = "*fp16"
        elif name in ("kd_ptr", "vd_ptr"):
            sig[name] = "*fp16" if bits == 16 else "*u8"
        elif name.endswith("table_ptr"):
            sig[name] = "*i32"
        elif name.endswith("len_ptr"):
            sig[name] = "*i64"
        elif name == "softcap":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_plan(bits: int, head_dim: int, rows: int, tile: int | None, warps: int | None, stages: int | None,
                 block_size: int = 32, arch: int = 90):
    """(plan, compiled kernel) of the tiled kernel for one store shape, compiled for sm_``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvtool.runtime.kernels.uniform_decode import _uniform_partials, plan_tiles

    # bits 16: a float16 body (method none), the same tile walk as codes
    plan = plan_tiles(_formats(bits), head_dim, block_size, rows, 16, "half", True, False, tile, warps, stages)
    # the GPU's code path, whatever this process runs; float16 float blocks (FG = 0: no int8 slot scales)
    constants = {**dict(plan.constants), "ASM": bits in (2, 4, 8), "FG": 0}
    fn = _uniform_partials
    sig = _signature(fn, bits, constants)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if sig[name].startswith("*") or name.endswith("table_stride")}  # as the launcher specializes them
    source = ASTSource(fn=fn, signature=sig, constexprs={k: v for k, v in constants.items() if k in fn.arg_names},
                       attrs=aligned)
    options = {"num_warps": plan.num_warps, **({} if plan.num_stages is None else {"num_stages": plan.num_stages})}
    return plan, triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resources(kernel) -> dict:
    """Registers, stack bytes, shared bytes and SASS instruction counts of a compiled kernel."""
    tools = _tools()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {usage[:200]}")
    ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass))
    registers, stack, shared = (int(x) for x in found.groups())
    return {"registers": registers, "stack_bytes": stack, "shared_bytes": shared, "sass_instructions": sum(ops.values()),
            "instructions": dict(ops.most_common())}


def occupancy(registers: int, warps: int) -> float:
    """Fraction of an SM's 64 warps resident when registers alone limit (64K registers per SM)."""
    blocks = 65536 // max(registers * warps * 32, 1)
    return min(64, blocks * warps) / 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", nargs="+", type=int, default=[2, 4, 8, 16], choices=[2, 3, 4, 8, 16])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--rows", type=int, default=4, help="query rows per KV head (GQA group)")
    parser.add_argument("--tiles", nargs="+", type=int, default=[0], help="tokens per product (0: the default plan)")
    parser.add_argument("--warps", nargs="+", type=int, default=[0], help="warps per program (0: the default plan)")
    parser.add_argument("--stages", nargs="+", type=int, default=[0], help="pipeline stages (0: the default plan)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 H100/H200, 80 A100")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernel_resources.json"))
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("benchmarks.kernel_resources compiles for a GPU: run it without TRITON_INTERPRET=1")
    if not (_tools() / "cuobjdump").exists():
        raise SystemExit(f"{_tools()} has no cuobjdump: this Triton wheel ships no NVIDIA tools for this platform")
    rows = []
    for bits in args.bits:
        for d in args.head_dims:
            for tile in args.tiles:
                for warps in args.warps:
                    for stages in args.stages:
                        plan, kernel = compile_plan(bits, d, args.rows, tile or None, warps or None, stages or None,
                                                    args.block_size, args.arch)
                        constants = dict(plan.constants)
                        row = {"bits": bits, "head_dim": d, "tile_tokens": constants["NB"] * constants["TS"],
                               "warps": plan.num_warps, "stages": plan.num_stages, **resources(kernel)}
                        row["occupancy"] = occupancy(row["registers"], plan.num_warps)
                        rows.append(row)
                        print({k: v for k, v in row.items() if k != "instructions"}, flush=True)
    from rich.console import Console
    from rich.table import Table

    import triton

    table = Table(title=f"tiled decode kernel on sm_{args.arch} (Triton {triton.__version__}, compiled here)")
    for column in ("bits", "head_dim", "tokens/tile", "warps", "stages", "registers", "stack B", "SASS instr", "occupancy"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["bits"]), str(r["head_dim"]), str(r["tile_tokens"]), str(r["warps"]), str(r["stages"]),
                      str(r["registers"]), str(r["stack_bytes"]), str(r["sass_instructions"]), f"{r['occupancy']:.1%}")
    Console().print(table)
    from kvtool.fileio import write_json_atomic

    write_json_atomic(args.out, {"arch": args.arch, "triton": triton.__version__, "rows": rows})


if __name__ == "__main__":
    main()
