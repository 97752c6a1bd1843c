"""Benchmark: how Palu's latents are mixed before their per-token codes (``hadamard`` vs ``rotate_basis``).

    python -m benchmarks.palu_rotation                       # SmolLM2-135M, ranks 128 96 72 of 192, 3 and 4 bits
    python -m benchmarks.palu_rotation --models gemma3-270m --ranks 256 192 128

Per model: one whitened Palu basis per layer and part at full rank (all KV heads jointly, keys before
RoPE, the bundled `palu-30-*` layout), calibrated as `kvtool calibrate` does; then held-out windows
run through the model and every layer's keys and values are coded by the real `PaluQuantizer` at
each rank and latent width, with the first r basis columns mixed four ways:

* ``none``: the latents in the SVD's order (variance falling);
* ``hadamard``: the recipe field ``hadamard`` (Walsh-Hadamard blocks of the largest power of two
  dividing r, at most 64, at decode time);
* ``random``: a random orthogonal r x r rotation folded into the basis (seed 0);
* ``rotate_basis``: the recipe field (`latent_rotation`: DCT x Walsh-Hadamard folded into the basis).

Columns: the codes' SQNR against the rank-r projection (what the mixing changes) and the total SQNR
against the model's K/V (projection and codes: what `kvtool calibrate` reports), pooled over layers
(signal and error summed), past the first token of each window (the recipes keep it as a float sink).
Writes benchmarks/results/palu_rotation.json. Needs ../shared and the pretrained models
(``python ../shared/models/fetch_pretrained.py``).
"""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import MODELS, PRETRAINED, SHARED
from kvtool.api import calibrate_loaded
from kvtool.capture import stream_batches
from kvtool.data import DataSpec, token_windows
from kvtool.fileio import write_json_atomic
from kvtool.methods.lowrank.palu import PaluQuantizer, latent_rotation
from kvtool.models.adapter import adapter_for
from kvtool.models.loading import load_model
from kvtool.recipe import CacheSpec, CalibrationSpec, QuantSpec, Recipe

MIXINGS = ("none", "hadamard", "random", "rotate_basis")
BLOCK = 32  # tokens per coded block


def full_rank_recipe(samples: int, seq_len: int) -> Recipe:
    common = dict(method="palu", bits=16, rank_fraction=1.0, group_heads=0, whiten=True, rank_allocation="uniform")
    return Recipe(
        name="palu-full-rank",
        keys=QuantSpec(path="keys", pre_rope=True, **common),
        values=QuantSpec(path="values", axis="token", **common),
        cache=CacheSpec(block_size=BLOCK, sink_tokens=1, recent_tokens=0),
        calibration=CalibrationSpec(samples=samples, seq_len=seq_len, seed=0),
    )


class Collect:
    """Observer: every layer's pre-RoPE keys and values past the first token, (B, H, T-1, D) per window batch."""

    def __init__(self) -> None:
        self.parts: dict[tuple[int, str], list[torch.Tensor]] = {}

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        for part, x in (("keys", keys_pre_rope), ("values", values)):
            self.parts.setdefault((layer, part), []).append(x[:, :, 1:].detach().float().cpu())

    def blocks(self, layer: int, part: str) -> torch.Tensor:
        """(1, H, n_blocks, BLOCK, D): all collected tokens of a layer and part, whole blocks only."""
        x = torch.cat([t.permute(1, 0, 2, 3).reshape(t.shape[1], -1, t.shape[-1]) for t in self.parts[(layer, part)]], dim=1)
        h, n, d = x.shape
        n_blocks = n // BLOCK
        return x[:, : n_blocks * BLOCK].reshape(h, n_blocks, BLOCK, d).unsqueeze(0)


def mixed_quantizer(part: str, basis: torch.Tensor, bias: torch.Tensor, rank: int, bits: int, mixing: str, head_dim: int):
    """A `PaluQuantizer` (bits < 16) or the float projection (bits 16) over the first ``rank`` columns, mixed."""
    columns = basis[:, :, :rank].double()  # (G, gD, r)
    if mixing == "random":
        q, r = torch.linalg.qr(torch.randn(rank, rank, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
        columns = columns @ (q * torch.sign(torch.diagonal(r))[None, :])
    elif mixing == "rotate_basis":
        columns = columns @ latent_rotation(rank)
    spec = QuantSpec(method="palu", bits=bits, pre_rope=part == "keys", axis="channel" if part == "keys" else "token",
                     group_heads=0, group_size=128, hadamard=mixing == "hadamard" and bits < 16, path=part)
    fitted = {"basis": columns.float(), "bias": bias.float()}
    return PaluQuantizer(spec, head_dim, BLOCK, torch.float32, fitted)


def measure(model, tokenizer, name: str, args) -> list[dict]:
    calib_text = str(SHARED / {**MODELS, **PRETRAINED}[name][1])
    artifact = calibrate_loaded(model, tokenizer, calib_text, full_rank_recipe(args.calib_samples, args.calib_seq_len))
    adapter = adapter_for(model)
    head_dim, layers = adapter.geometry.head_dim, adapter.geometry.num_layers
    eval_text = str(SHARED / {**MODELS, **PRETRAINED}[name][2])
    windows = token_windows(tokenizer, DataSpec.parse(eval_text), samples=args.samples, seq_len=args.seq_len, mode="sequential")
    collect = Collect()
    with torch.no_grad():
        stream_batches(model, adapter, windows, [collect], batch_size=1)
    totals: dict[tuple, list[float]] = {}
    for layer in range(layers):
        tensors = artifact.layer_tensors(layer)
        for part in ("keys", "values"):
            basis, bias = tensors[f"{part}.basis"], tensors[f"{part}.bias"]
            blocks = collect.blocks(layer, part)  # float32, as the runtime codes them; sums in float64
            width = basis.shape[1]
            for rank in args.ranks:
                if rank > width:
                    continue
                projected = mixed_quantizer(part, basis, bias, rank, 16, "none", head_dim).roundtrip(blocks).double()
                for bits in args.bits:
                    for mixing in MIXINGS:
                        coded = mixed_quantizer(part, basis, bias, rank, bits, mixing, head_dim).roundtrip(blocks).double()
                        sums = totals.setdefault((part, rank, bits, mixing), [0.0, 0.0, 0.0, 0.0])
                        sums[0] += float(projected.square().sum())
                        sums[1] += float((coded - projected).square().sum())
                        sums[2] += float(blocks.double().square().sum())
                        sums[3] += float((coded - blocks.double()).square().sum())
    rows = []
    for (part, rank, bits, mixing), (proj, code_err, signal, total_err) in totals.items():
        rows.append({"model": name, "part": part, "rank": rank, "bits": bits, "mixing": mixing,
                     "codes_sqnr_db": 10 * math.log10(proj / max(code_err, 1e-30)),
                     "total_sqnr_db": 10 * math.log10(signal / max(total_err, 1e-30))})
    return rows


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows: figures depend on it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"], choices=list(MODELS) + list(PRETRAINED))
    parser.add_argument("--ranks", nargs="+", type=int, default=[128, 96, 72], help="latent dimensions kept per layer (of H_kv x head_dim)")
    parser.add_argument("--bits", nargs="+", type=int, default=[3, 4], choices=[2, 3, 4, 8])
    parser.add_argument("--samples", type=int, default=2, help="held-out windows")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per held-out window")
    parser.add_argument("--calib-samples", type=int, default=16, help="calibration windows (the bundled palu recipes: 16)")
    parser.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/palu_rotation.json"))
    args = parser.parse_args()
    if min(args.ranks) < 1:
        raise SystemExit(f"--ranks must be positive, got {args.ranks}")
    console, rows = Console(), []
    for name in args.models:
        model, tokenizer = load_model(str(SHARED / {**MODELS, **PRETRAINED}[name][0]))
        rows += measure(model, tokenizer, name, args)
        machine = {"platform": platform.platform(), "processor": cpu_model(), "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "device": "cpu"}
        write_json_atomic(args.out, {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    table = Table(title="Palu latent codes: SQNR (dB) against the rank-r projection / against K or V, pooled over layers")
    for column in ("model", "part", "rank", "bits", *MIXINGS):
        table.add_column(column, justify="right")
    cells = {(r["model"], r["part"], r["rank"], r["bits"], r["mixing"]): r for r in rows}
    for model, part, rank, bits in dict.fromkeys(key[:4] for key in cells):
        table.add_row(model, part, str(rank), str(bits), *(
            f"{cells[(model, part, rank, bits, m)]['codes_sqnr_db']:.1f} / {cells[(model, part, rank, bits, m)]['total_sqnr_db']:.1f}"
            for m in MIXINGS))
    console.print(table)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
