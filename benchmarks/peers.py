"""Benchmark: kvpress presses and transformers' QuantizedCache (quanto) beside kvtool, same windows, same protocol.

kvpress 0.5.5 pins transformers<5.3, so the peers run in their own environment (created once, outside
the repository; torch first so pip does not pull a CUDA build):

    python -m venv /work/peers-venv && /work/peers-venv/bin/pip install torch==2.13.0 \\
        && /work/peers-venv/bin/pip install kvpress optimum-quanto

One command per side, then one to put them side by side:

    OMP_NUM_THREADS=1 PYTHONPATH=. /work/peers-venv/bin/python -m benchmarks.peers --side peers --model smollm2-135m
    OMP_NUM_THREADS=1 python -m benchmarks.peers --side kvtool --model smollm2-135m
    python -m benchmarks.peers --table smollm2-135m      # markdown table of both JSON files

Windows: `kvtool.data.token_windows` on held-out WikiText-2 test (`benchmarks.common.PRETRAINED`),
sequential, the same call in both environments; each side records the SHA-256 of its window ids and
``--table`` refuses to pair sides whose windows differ. Scoring: the loop of `kvtool eval ppl`
(`kvtool.eval.perplexity`: prefill the first half of each window in one forward, then decode the rest one
token per step; tokens prefill+1 .. T-1 are scored), with true positions passed as kvpress's pipeline does
(`decode_nll`). Two protocols on that loop:

* ``prefill``: the prompt is compressed once, at prefill, then decoding appends every new token
  uncompressed. This is what kvpress does (its presses act on the context only). kvtool's rows use its
  eviction with ``interval`` longer than the decoded part, so they too evict only at prefill.
* ``decode``: the cache is compressed throughout. quanto quantizes the prefill right after it and then
  every ``residual_length`` (128) new tokens; kvtool quantizes blocks as they fill (its eval ppl protocol).

Bytes: every tensor reachable from the cache after the last token of each batch, by unique storage,
with quanto's packed tensors opened (`cache_bytes`); kvtool's per-model constants (rotary tables) are
left out as in `benchmarks.decode_speed`. The models run in float32 on CPU, so transformers' caches hold
float32: "16-bit bytes" counts their floating tensors at 2 bytes per element (what the same cache holds
for a 16-bit model); kvtool's rows are counted as held (fp16 tokens, float32 scores, int32 positions).
"fraction" = 16-bit bytes / the full `DynamicCache`'s 16-bit bytes in the same environment. kvpress's
AdaKV masks the tokens it drops (fake keys at attention time) and frees nothing: its bytes show that.
Writes benchmarks/results/peers_<model>_<side>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import platform
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import PRETRAINED, SHARED
from kvtool.data import DataSpec, token_windows
from kvtool.fileio import write_json_atomic
from kvtool.models.cache_argument import with_cache
from kvtool.quiet import quiet_progress_bars
from kvtool.runtime.memory import reachable_tensors

FRACTIONS = (0.5, 0.25)  # fraction of the prompt's tokens kept
PRESSES = ("StreamingLLMPress", "SnapKVPress", "TOVAPress", "ExpectedAttentionPress", "KnormPress", "PyramidKVPress", "AdaKVPress")
QUANTO_BITS = (4, 2)
KVTOOL_EVICTION = ("streamingllm", "snapkv", "tova", "knorm", "pyramid-snapkv", "ada-snapkv", "h2o")  # benchmarks.eviction.VARIANTS
KVTOOL_QUANT = ("kivi-4bit", "kivi-2bit")
RESULTS = Path("benchmarks/results")


def model_windows(name: str, samples: int, seq_len: int):
    """(model, tokenizer, windows (N, T)) as kvtool's perplexity benchmarks cut them; float32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _, eval_data = PRETRAINED[name]
    if not (Path(model_dir) / "config.json").exists():
        raise SystemExit(f"{model_dir} is missing: run `python ../shared/models/fetch_pretrained.py --install-deps` first")
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = token_windows(tokenizer, DataSpec.parse(str(SHARED / eval_data)), samples=samples,
                            seq_len=min(seq_len, model.config.max_position_embeddings), mode="sequential")
    return model, tokenizer, windows


def windows_sha256(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.to(torch.int64).numpy().tobytes()).hexdigest()


def cache_tensors(cache) -> list[torch.Tensor]:
    """Plain tensors reachable from a cache; tensor subclasses (quanto's packed codes) opened to their parts."""
    found, stack = [], reachable_tensors(cache)
    while stack:
        tensor = stack.pop()
        if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            stack.extend(getattr(tensor, name) for name in names)
        else:
            found.append(tensor)
    return found


def cache_bytes(cache, float_as_16bit: bool) -> tuple[int, int]:
    """(bytes as run, 16-bit bytes) of a cache's unique storages; 16-bit counts floats at 2 bytes if asked."""
    storages = {}  # data_ptr -> (bytes, itemsize, floating)
    for tensor in cache_tensors(cache):
        if isinstance(tensor, np.ndarray):  # kvtool's host-side tables
            base = tensor if tensor.base is None else tensor.base
            storages[base.__array_interface__["data"][0]] = (base.nbytes, base.itemsize, False)
            continue
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(), tensor.element_size(), tensor.dtype.is_floating_point)
    as_run = sum(n for n, _, _ in storages.values())
    sixteen = sum(n * 2 // size if float_as_16bit and floating and size > 2 else n for n, size, floating in storages.values())
    if hasattr(cache, "constant_nbytes"):  # kvtool: rotary tables etc. shared by every cache of a runtime
        as_run, sixteen = as_run - cache.constant_nbytes(), sixteen - cache.constant_nbytes()
    return as_run, sixteen


def decode_nll(model, windows: torch.Tensor, cache, prefill: int) -> tuple[float, int, float]:
    """`kvtool.eval.perplexity`'s loop (prefill, then one token per step scoring the next), with every token's true
    position passed as ``position_ids``, as kvpress's pipeline does: after a press drops tokens, transformers would
    otherwise number the next token by the cache's (shorter) length. Returns (sum NLL, scored tokens, decode seconds)."""
    batch, seq_len = windows.shape
    positions = torch.arange(seq_len).expand(batch, seq_len)  # (B, T)
    model(input_ids=windows[:, :prefill], position_ids=positions[:, :prefill], **with_cache(cache), use_cache=True)
    nll, seconds = 0.0, 0.0
    for t in range(prefill, seq_len - 1):
        start = time.perf_counter()
        logits = model(input_ids=windows[:, t:t + 1], position_ids=positions[:, t:t + 1], **with_cache(cache),
                       use_cache=True).logits  # (B, 1, V)
        nll += F.cross_entropy(logits[:, 0].float(), windows[:, t + 1], reduction="sum").item()
        seconds += time.perf_counter() - start
    return nll, batch * (seq_len - 1 - prefill), seconds


def score(model, windows: torch.Tensor, new_cache, around=contextlib.nullcontext, float_as_16bit: bool = True) -> dict:
    """Perplexity through `new_cache()` caches (all windows as one batch) and the bytes they hold at the end."""
    start = time.perf_counter()
    cache = new_cache()
    with around():
        nll, count, decode_seconds = decode_nll(model, windows, cache, windows.shape[1] // 2)
    as_run, sixteen = cache_bytes(cache, float_as_16bit)
    row = {"ppl": math.exp(nll / count), "scored_tokens": count, "bytes_held": as_run, "bytes_16bit": sixteen,
           "decode_tokens_per_s": count / decode_seconds, "seconds": time.perf_counter() - start}
    if hasattr(cache, "kept_fraction"):  # kvtool: tokens kept, and the bytes of blocks in use (the walk adds free pool blocks)
        row.update(kept_fraction=cache.kept_fraction(), bytes_in_use=cache.nbytes())
    return row


def peer_rows(model, windows: torch.Tensor, log, fractions=FRACTIONS, methods=PRESSES, quant: bool = True,
              sliding: str = "global") -> list[dict]:
    """Full `DynamicCache`, every kvpress press at each fraction kept, quanto 4 and 2 bits."""
    import kvpress
    from transformers import DynamicCache, QuantizedCache

    rows = []

    def add(method: str, protocol: str, new_cache, around=contextlib.nullcontext, **extra) -> None:
        try:
            row = score(model, windows, new_cache, around)
        except Exception as exc:  # a press that fails on this model is a result too
            row = {"error": f"{type(exc).__name__}: {exc}"}
        rows.append({"side": "peers", "method": method, "protocol": protocol, **extra, **row})
        log(rows[-1])

    add("full cache (DynamicCache)", "both", lambda: DynamicCache(config=model.config))
    for fraction in fractions:
        for name in methods:
            press = make_press(kvpress, name, 1 - fraction)
            add(f"kvpress {name}" + (" (sliding layers too)" if sliding == "equal" else ""), "prefill",
                lambda: press_cache(model, sliding), lambda: press_context(press, model, sliding),
                fraction_kept=fraction, frees_tokens=name != "AdaKVPress")
    for bits in QUANTO_BITS if quant else ():
        add(f"QuantizedCache quanto {bits}-bit", "decode",
            lambda: QuantizedCache(backend="quanto", config=model.config, nbits=bits))
    return rows


SLIDING = ("global", "equal")  # what a press does to Gemma 3's sliding-window layers (`press_context`)


def press_context(press, model, sliding: str = "global"):
    """``press(model)``, except on models with sliding-window layers (text-only Gemma 3, `Gemma3ForCausalLM`).

    kvpress 0.5.5 leaves Gemma 3's sliding-window layers uncompressed only for `Gemma3ForConditionalGeneration`; on
    `Gemma3ForCausalLM` it hooks every layer and fails: with the cache's sliding layers (`DynamicCache(config=...)`)
    the first decode step's mask is the window's size, not the compressed keys' (RuntimeError); without them the
    compressed sliding layers see tokens older than their window (greedy answers are garbage); and presses that call
    ``module.rotary_emb`` (ExpectedAttention) fail, Gemma 3's rotary module needs the layer type. Here each hooked
    layer's rotary module is bound to its layer type, and ``sliding`` says what happens to the sliding layers:

    * ``global``: kvpress's own Gemma 3 rule, the press on the global layers only; the sliding layers keep their
      window (w - 1 tokens), as the full cache does, so the cache holds more than the fraction asked for;
    * ``equal``: the sliding layers too, each kept down to as many tokens as a global layer keeps (a fraction f of
      the n prefilled tokens; all of its w - 1 if f n >= w - 1), so every layer holds what kvtool's layers hold. The
      cache must come from `press_cache(model, "equal")` (its sliding layers mask the kept tokens as the latest ones).
    """
    layers = model.model.layers
    if not any(getattr(layer.self_attn, "is_sliding", False) for layer in layers):
        return press(model)
    return _hooked_layers(press, model, sliding)


@contextlib.contextmanager
def _hooked_layers(press, model, sliding: str):
    if sliding not in SLIDING:
        raise ValueError(f"sliding must be one of {SLIDING}, not {sliding!r}")
    press.post_init_from_model(model)
    hooks = []
    try:
        for layer in model.model.layers:
            attention = layer.self_attn
            if attention.is_sliding and sliding == "global":
                continue
            attention.rotary_emb = functools.partial(model.model.rotary_emb, layer_type=attention.layer_type)
            hook = _window_share(press) if attention.is_sliding else press.forward_hook
            hooks.append(attention.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _window_share(press):
    """The press's hook on a sliding layer: its compression ratio set so that it keeps (1 - ratio) x the tokens fed
    (what a global layer keeps) of the w - 1 its cache holds."""

    def hook(module, args, kwargs, output):
        ratio = press.compression_ratio
        held = kwargs["past_key_values"].layers[module.layer_idx].keys.shape[-2]
        press.compression_ratio = max(0.0, 1.0 - (1.0 - ratio) * kwargs["hidden_states"].shape[1] / max(held, 1))
        try:
            return press.forward_hook(module, args, kwargs, output)
        finally:
            press.compression_ratio = ratio

    return hook


def press_cache(model, sliding: str = "global"):
    """A `DynamicCache` for a press; with ``sliding="equal"`` its sliding-window layers tell the mask that the tokens
    they hold are the latest ones (all inside the window), whatever a press dropped (transformers' own layer sizes
    the mask as a full window and the first decode step fails)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    if sliding == "equal":
        for layer in cache.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.__class__ = _compressed_sliding_layer(DynamicSlidingWindowLayer)
    return cache


@functools.cache
def _compressed_sliding_layer(base):
    class CompressedSlidingWindowLayer(base):
        def get_mask_sizes(self, cache_position) -> tuple[int, int]:  # transformers 5.2: positions; later: a length
            queries = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
            held = self.keys.shape[-2] if self.is_initialized else 0
            return held + queries, self.cumulative_length - held  # (kv_length, kv_offset)

    return CompressedSlidingWindowLayer


def make_press(kvpress, name: str, compression_ratio: float):
    """A kvpress press with its defaults; AdaKV wraps SnapKV, as in kvpress's own test list."""
    if name == "AdaKVPress":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=compression_ratio))
    return getattr(kvpress, name)(compression_ratio=compression_ratio)


def prefill_only(recipe, seq_len: int):
    """``recipe`` evicting at prefill only (kvpress's protocol): an interval of ``seq_len`` tokens is never reached
    while the rest of a ``seq_len``-token window is decoded (a stream holds at most budget + interval - 1 tokens)."""
    return dataclasses.replace(recipe, eviction=dataclasses.replace(recipe.eviction, interval=seq_len))


def kvtool_rows(model, windows: torch.Tensor, log, fractions=FRACTIONS, methods=KVTOOL_EVICTION, quant: bool = True) -> list[dict]:
    """Full `DynamicCache`, kvtool's eviction at prefill only (kvpress's protocol) and its quantization throughout."""
    from transformers import DynamicCache

    from benchmarks.eviction import eviction_recipe
    from kvtool.recipe import load_recipe
    from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

    rows = []

    def add(method: str, protocol: str, new_cache, **extra) -> None:
        rows.append({"side": "kvtool", "method": method, "protocol": protocol, **extra,
                     **score(model, windows, new_cache, float_as_16bit=new_cache is full_cache)})
        log(rows[-1])

    full_cache = lambda: DynamicCache(config=model.config)  # noqa: E731
    add("full cache (DynamicCache)", "both", full_cache)
    add("kvtool uncompressed fp16", "both", CompressedRuntime.from_recipe(model, uncompressed_recipe("float16")).new_cache)
    for fraction in fractions:
        for variant in methods:
            runtime = CompressedRuntime.from_recipe(model, prefill_only(eviction_recipe(variant, fraction), windows.shape[1]))
            add(f"kvtool {variant}", "prefill", runtime.new_cache, fraction_kept=fraction, frees_tokens=True)
        if quant:
            runtime = CompressedRuntime.from_recipe(model, prefill_only(eviction_recipe("snapkv", fraction, bits=4), windows.shape[1]))
            add("kvtool snapkv + kivi-4bit", "prefill", runtime.new_cache, fraction_kept=fraction, frees_tokens=True)
    for name in KVTOOL_QUANT if quant else ():
        add(f"kvtool {name}", "decode", CompressedRuntime.from_recipe(model, load_recipe(name)).new_cache)
    return rows


def environment() -> dict:
    packages = {}
    for package in ("torch", "transformers", "kvpress", "optimum-quanto"):
        try:
            packages[package] = version(package)
        except Exception:  # not installed in this environment
            continue
    return {"platform": platform.platform(), "threads": torch.get_num_threads(), "device": "cpu", **packages}


def run_side(args) -> None:
    model, _, windows = model_windows(args.model, args.samples, args.seq_len)
    out = RESULTS / f"peers_{args.model}_{args.side}{'_' + args.tag if args.tag else ''}.json"
    payload = {"model": args.model, "side": args.side, "environment": environment(), "windows": list(windows.shape),
               "prefill": windows.shape[1] // 2, "windows_sha256": windows_sha256(windows), "rows": []}

    def log(row: dict) -> None:  # print and save after every row: a stopped run keeps what it measured
        payload["rows"].append(row)
        write_json_atomic(out, payload)
        figures = row.get("error") or f"ppl {row['ppl']:.3f}, {row['bytes_16bit']:,} B (16-bit), {row['seconds']:.0f} s"
        print(f"{args.model} {row['method']} {row.get('fraction_kept', '')}: {figures}", flush=True)

    methods = args.methods or (PRESSES if args.side == "peers" else KVTOOL_EVICTION)
    with torch.no_grad():
        if args.side == "peers":
            peer_rows(model, windows, log, args.fractions, methods, not args.no_quant, args.sliding)
        else:
            kvtool_rows(model, windows, log, args.fractions, methods, not args.no_quant)
    print(f"wrote {out}")


def markdown_table(model: str, results: Path = RESULTS) -> str:
    """Both sides' rows, with delta vs each side's own full cache and the fraction of its 16-bit bytes."""
    sides = [json.loads((results / f"peers_{model}_{side}.json").read_text()) for side in ("peers", "kvtool")]
    if sides[0]["windows_sha256"] != sides[1]["windows_sha256"]:
        raise SystemExit(f"{model}: the two sides scored different windows (SHA-256 of the ids differ): rerun one side")
    lines = ["| protocol | kept | method | env | ppl | delta | bytes walked (as run) | 16-bit bytes | fraction of 16-bit cache "
             "| kvtool blocks in use |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for side in sides:
        full = side["rows"][0]
        env = "transformers " + side["environment"]["transformers"]
        for row in side["rows"]:
            rows.append((row, full, env))
    order = {"both": 0, "prefill": 1, "decode": 2}
    rows.sort(key=lambda item: (order[item[0]["protocol"]], -item[0].get("fraction_kept", 1),
                                item[0].get("bytes_16bit", 0) / item[1]["bytes_16bit"]))
    for row, full, env in rows:
        kept = f"{row['fraction_kept']:.0%}" if "fraction_kept" in row else ""
        if "error" in row:
            lines.append(f"| {row['protocol']} | {kept} | {row['method']} | {env} | failed: {row['error']} | | | | | |")
            continue
        delta = 100 * (row["ppl"] / full["ppl"] - 1)
        lines.append(f"| {row['protocol']} | {kept} | {row['method']} | {env} | {row['ppl']:.3f} | {delta:+.2f}% | "
                     f"{row['bytes_held']:,} | {row['bytes_16bit']:,} | {row['bytes_16bit'] / full['bytes_16bit']:.3f} | "
                     f"{format(row['bytes_in_use'], ',') if 'bytes_in_use' in row else ''} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("peers", "kvtool"), help="peers: kvpress + quanto (their env); kvtool: main env")
    parser.add_argument("--table", metavar="MODEL", help="print the markdown table of both sides' JSON for MODEL")
    parser.add_argument("--model", default="smollm2-135m", choices=list(PRETRAINED))
    parser.add_argument("--samples", type=int, default=2, help="held-out windows (scored as one batch)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per window: half prefilled, half decoded")
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS, help="fractions of the prompt kept")
    parser.add_argument("--methods", nargs="+", help="presses (peers) or benchmarks.eviction variants (kvtool); default: all")
    parser.add_argument("--no-quant", action="store_true", help="skip the quantization rows (quanto; kivi, snapkv + kivi-4bit)")
    parser.add_argument("--sliding", choices=SLIDING, default="global",
                        help="presses on Gemma 3's sliding-window layers: global = not compressed (kvpress's rule), equal = as many "
                             "tokens kept as a global layer (see press_context)")
    parser.add_argument("--tag", help="suffix of the JSON file name")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(args.table))
    elif args.side:
        run_side(args)
    else:
        parser.error("give --side peers|kvtool or --table MODEL")


if __name__ == "__main__":
    main()
