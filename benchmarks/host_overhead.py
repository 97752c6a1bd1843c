"""Host work per decode step: the runtime's Python and tensor-op dispatch, with the Triton kernels stubbed out.

On a GPU a decode step of a small model is host-bound: the H100 run of `benchmarks.gpu_generate` (SmolLM2-135M
architecture, batch 32 x 8K) spent ~3 ms of a 58 ms step in attention kernels (RESULTS.md, "GPU: the tiled kernel
..."). What the host does per step can be measured without a GPU: this runs the model on CPU with tiny MLPs and
vocabulary (so the linears cost little), replaces every Triton kernel launch by a no-op (the launch wrappers, planning,
allocations and the runtime's per-layer work still run), and times decode steps of each cache interleaved (step s of
every cache before step s + 1, so machine noise hits all alike). The difference to `DynamicCache` per layer is the
host time kvtool adds; the torch backend row is the CPU reference path (its kernels run, so it is not host-only).

    python -m benchmarks.host_overhead                                   # SmolLM2-135M's architecture, batch 1, 256 tokens
    python -m benchmarks.host_overhead --caches DynamicCache kivi-4bit:triton --batch 8 --context 1024

Caches: `DynamicCache`, or `<recipe>:<backend>` (backend `triton` with stubbed kernels, or `torch`). Numbers are
CPU host time, not GPU step time: a GPU adds each kernel's launch latency and hides host time behind kernels only
when no call synchronizes. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend on CPU (its kernels are stubbed below anyway)

DEFAULT_MODEL = Path(os.environ.get("KVTOOL_TEST_MODELS", Path.home() / ".cache" / "kvtool-test-models")) / "smollm2-135m"


class _NoLaunch:
    """Stands for a `@triton.jit` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_triton_kernels():
    """The runtime's Triton kernels replaced by no-op launches while the block runs (restored after); yields their
    names."""
    import importlib
    import pkgutil

    import triton

    from kvtool.runtime import kernels

    saved = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.jit.KernelInterface) and name.startswith("_") and _launched(module, name):
                saved.append((module, name, value))
                setattr(module, name, _NoLaunch())
    try:
        yield [f"{module.__name__.rsplit('.', 1)[1]}.{name}" for module, name, _ in saved]
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _launched(module, name: str) -> bool:
    """A kernel the module launches from the host (``name[grid](``), not a device helper called inside kernels."""
    import inspect

    source = inspect.getsource(module)
    return f"{name}[(" in source or f"{name}[grid" in source


def small_model(path: Path, intermediate: int, vocab: int):
    """The architecture of ``path`` (layers, heads, KV heads, head_dim) with a tiny MLP and vocabulary, random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    config.intermediate_size, config.vocab_size = intermediate, vocab
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def make_cache(label: str, model):
    from transformers import DynamicCache

    from kvtool.recipe import load_recipe
    from kvtool.runtime.attach import CompressedRuntime

    if label == "DynamicCache":
        return DynamicCache(config=model.config)
    recipe, _, backend = label.partition(":")
    return CompressedRuntime.from_recipe(model, load_recipe(recipe), backend=backend or "torch").new_cache()


def measure(model, labels: list[str], batch: int, context: int, steps: int) -> list[dict]:
    import torch

    from benchmarks.decode_speed import interleaved_step_times

    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab, (batch, context + steps), generator=torch.Generator().manual_seed(0))
    times = interleaved_step_times(model, {label: make_cache(label, model) for label in labels}, ids, context, steps)
    layers = model.config.num_hidden_layers
    base = statistics.median(times[labels[0]][3:])
    rows = []
    for label in labels:
        median = statistics.median(times[label][3:])
        rows.append({"cache": label, "ms_per_step": 1e3 * median, "best_ms_per_step": 1e3 * min(times[label][3:]),
                     "us_per_layer_over_first": 1e6 * (median - base) / layers})
    return rows


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a model folder whose architecture is used")
    parser.add_argument("--caches", nargs="+", default=["DynamicCache", "uncompressed:triton", "kivi-4bit:triton", "kivi-2bit:triton",
                                                        "kivi-4bit:torch"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--intermediate", type=int, default=64, help="MLP width (tiny: the linears cost little)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/host_overhead.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = small_model(args.model, args.intermediate, args.vocab)
    with stubbed_triton_kernels() as stubbed:
        rows = measure(model, args.caches, args.batch, args.context, args.steps)
    layers = model.config.num_hidden_layers
    print(f"host time per decode step, {args.model.name} architecture ({layers} layers, MLP {args.intermediate}, vocab "
          f"{args.vocab}), batch {args.batch}, {args.context} tokens, {args.steps} interleaved steps, {args.threads} thread(s); "
          f"Triton kernels stubbed: {len(stubbed)}")
    print(f"| cache | ms/step (median) | best | us per layer over {args.caches[0]} |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['cache']} | {row['ms_per_step']:.2f} | {row['best_ms_per_step']:.2f} | {row['us_per_layer_over_first']:+.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": platform.processor() or platform.machine(),
                                    "torch": torch.__version__, "stubbed": stubbed, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
