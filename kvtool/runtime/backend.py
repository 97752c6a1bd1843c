"""Which implementation computes attention over the store: ``auto``, ``torch``, ``triton`` or ``numba``.

Resolved once per runtime and reported in every memory report (``backend``):

* ``torch``: the pure-torch reference (`paged_attention.py` and the methods' ``chunk_*``), any device;
* ``triton``: the Triton decode kernels read the store in place for every decode step they cover
  (`kernels/uniform_decode.py` for float and uniform-code stores, in float16 products when the
  model computes in fp16 / bf16; `kernels/decode_attention.py` for the rest): float blocks and body blocks of the formats whose quantizer has
  a `kernel_format` (none: float16 data; uniform 2/3/4/8-bit, KIVI-style; fp8 e4m3/e5m2 with
  per-block or calibrated per-layer / per-KV-head scales; int_static 2/3/4/8-bit with calibrated
  per-layer / per-head / per-channel ranges; nuq 2/3/4-bit codebook lookups with per-channel or
  per-token scales and dense-and-sparse outliers; Palu low-rank latents with ``group_heads: 1``,
  fp16 or 2/3/4/8-bit with or without the Hadamard transform, reconstructed in registers;
  TurboQuant 2/3/4-bit read in the rotated domain, and its outlier split (2.5 / 3.5 bits) rebuilt
  in registers per block, keys with or without the 1-bit QJL residual (``qjl: true``: its term
  added to each score against the query sketched once per step, once per block with the split)),
  keys stored after RoPE or before it (KVQuant's and Palu's ``keys.pre_rope``: rotated in the
  kernel at each token's true position, for RoPE types with fixed frequencies), full-attention
  layers, policies that do not score tokens by attention, and RocketKV's sparse read
  (`kernels/sparse_decode.py`: only the slots the summaries select; the selection itself is torch).
  The append/encode step runs in Triton too, for every layer step that flushes full float
  blocks into the body, prefill included (`kernels/encode_blocks.py`): each side whose
  quantizer has a `kernel_encode_format` (uniform 2/3/4/8-bit per channel or per token group; fp8
  e4m3/e5m2 with dynamic per-block or calibrated scales) is encoded byte for byte as its
  ``encode_blocks`` does and written straight into the body pool rows the store allocated;
  the other sides (int_static, nuq, TurboQuant, Palu) are encoded by the torch reference.
  Prefill attention, sliding-window layers, attention-scored eviction (h2o, snapkv, ...) and
  Palu latents spanning a group of KV heads (``group_heads`` != 1) stay on the torch path;
  `cache.memory_report()["kernel_steps"]` counts the layer steps the decode kernel ran and
  ``["kernel_encodes"]`` the body blocks the encode kernel wrote (keys and values counted apart).
  Needs CUDA, or ``TRITON_INTERPRET=1`` to run the kernels on CPU tensors (slow; for tests);
* ``numba``: on CPU, one decode step's attention of a layer is one compiled call
  (`kernels/cpu_decode.py`) that reads float blocks (float16 / bfloat16) and uniform (KIVI),
  int_static, fp8 and nuq (KVQuant: codebook values, sparse outliers) body blocks in place, and TurboQuant blocks on both sides (one instance or the
  outlier split, without QJL; `kernels/cpu_decode_rotated.py`: the queries rotated into the codes'
  domains, the value sums rotated back), for one-token steps of full-attention and sliding-window layers
  (the window read from the positions the store keeps per slot), keys stored
  after RoPE or before it (decoded, then rotated at each token's true position, RoPE types with fixed
  frequencies). On a step
  that only appends (no block to encode or allocate, no eviction due) the same call stores the
  token, its position and its score, and adds the attention every held token received to its
  score, so attention-scored policies (h2o, tova, snapkv, ...) run on it between their cuts (such a
  step takes the model's query and token as host arrays and returns the output as a view, with none
  of the general path's tensor operations: `KvtoolLayer._cpu_kernel_step`). FastGen, which re-chooses
  its kept set after every token, runs every such step on it too: after the call a compiled pass
  (`kernels/cpu_fastgen.py`) writes the token's class, applies each head's policy (and a sliding
  window's rule) and compacts the store as the torch path would. The rest (cuts, flushes, prefill,
  a sliding-window rule's frees) stays on the torch path. Needs the
  ``numba`` package (a dependency of kvtool);
* ``auto``: ``triton`` on CUDA when Triton is installed and the recipe's formats are ones the
  decode kernel reads; on CPU ``numba`` when Numba is installed and the CPU kernel reads the
  recipe's store (float-only, uniform, int_static, fp8, nuq or TurboQuant codes); else ``torch``. What the encode kernel writes never decides the backend: a
  format it does not write is encoded by torch under ``triton``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kvtool.errors import RuntimeConfigError
from kvtool.recipe import Recipe
from kvtool.runtime.kernels.cpu_decode import numba_available

BACKENDS = ("auto", "torch", "triton", "numba")
KERNEL_READS = (
    "the kernel reads none, uniform, fp8, int_static and nuq blocks, palu latents with group_heads 1 and turboquant "
    "(qjl included)"
)


def triton_available(device: torch.device) -> bool:
    """True when Triton kernels can run on ``device`` (CUDA, or the interpreter on CPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _changing_frequencies(ropes) -> str | None:
    """Why keys stored before RoPE cannot be rotated in a kernel (which uses fixed frequencies): a layer's RoPE type
    changes its frequencies with the context length (longrope, dynamic NTK); None when every layer's is fixed."""
    for rope in ropes:
        if rope.long_after is not None or rope.grow_after is not None:
            return (
                f"keys are stored before RoPE and the model's RoPE ('{rope.rope_type}') changes its frequencies "
                "with the context length (the kernel rotates pre-RoPE keys with fixed frequencies)"
            )
    return None


def kernel_unsupported(recipe: Recipe, quantizers=(), ropes=()) -> str | None:
    """Why the Triton decode kernel cannot read this recipe's blocks (None when it can).

    quantizers: the recipe's (key, value) formats; each says itself whether the kernel reads it
    (`BlockQuantizer.kernel_format`), so there is one source of truth for what the kernel covers.
    ropes: the model's per-layer `RopeSpec`s; keys stored before RoPE are rotated in the kernel
    with fixed frequencies, so RoPE types whose frequencies change with the context length
    (longrope, dynamic NTK) stay on the torch path.
    """
    if recipe.keys.pre_rope and (reason := _changing_frequencies(ropes)):
        return reason
    for quantizer, name in zip(quantizers, ("keys", "values")):
        try:
            quantizer.kernel_format()
        except RuntimeConfigError as exc:
            return f"{name} use method '{quantizer.spec.method}': {exc} ({KERNEL_READS})"
    return None


def cpu_kernel_unsupported(recipe: Recipe, quantizers=(), ropes=()) -> str | None:
    """Why the CPU (Numba) decode kernel cannot read this recipe's blocks (None when it can); the float dtype of the
    blocks is checked by each layer (``cache.float_dtype: model`` is only known there). Keys stored before RoPE are
    rotated in the kernel with fixed frequencies, as in the Triton kernel (``ropes``: see `kernel_unsupported`)."""
    from kvtool.runtime.kernels.cpu_decode import covers

    if recipe.keys.pre_rope and (reason := _changing_frequencies(ropes)):
        return reason
    if recipe.sparse_attention.enabled:
        return "RocketKV's sparse read is not in the CPU kernel"
    formats = []
    for quantizer in quantizers:
        if quantizer.spec.method == "none":
            continue
        try:
            formats.append(quantizer.kernel_format())
        except RuntimeConfigError as exc:
            return f"method '{quantizer.spec.method}': {exc}"
    if not formats:
        return None
    if len(formats) != 2:
        return "one side is float and the other quantized (the CPU kernel reads float-only stores or bodies quantized on both sides)"
    return covers(tuple(formats), torch.float16, quantizers[0].head_dim)


def resolve_backend(requested: str, device: torch.device, recipe: Recipe | None = None, quantizers=(), ropes=()) -> str:
    """The backend a runtime on ``device`` uses for ``requested``; RuntimeConfigError when impossible."""
    if requested not in BACKENDS:
        raise RuntimeConfigError(f"--backend '{requested}' is unknown: use one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if requested == "torch":
        return "torch"
    reason = kernel_unsupported(recipe, quantizers, ropes) if recipe is not None else None
    if requested == "triton":
        if not triton_available(device):
            raise RuntimeConfigError(
                "--backend triton needs a CUDA GPU and the `triton` package (or TRITON_INTERPRET=1 to run the "
                "kernels on CPU tensors, slowly, for testing); use --backend torch or auto"
            )
        if reason:
            raise RuntimeConfigError(f"--backend triton: recipe '{recipe.name}': {reason}; use --backend torch or auto")
        return "triton"
    cpu_reason = cpu_kernel_unsupported(recipe, quantizers, ropes) if recipe is not None else None
    if requested == "numba":
        if device.type != "cpu" or not numba_available():
            raise RuntimeConfigError(
                "--backend numba runs on CPU tensors and needs the `numba` package (pip install numba); "
                "use --backend torch or auto"
            )
        if cpu_reason:
            raise RuntimeConfigError(f"--backend numba: recipe '{recipe.name}': {cpu_reason}; use --backend torch or auto")
        return "numba"
    if device.type == "cuda":
        return "triton" if triton_available(device) and not reason else "torch"
    # on CPU, auto takes the kernel wherever it reads the store: it measured faster than the torch path for packed
    # codes, float-only stores and scored eviction alike (benchmarks/RESULTS.md, "The CPU kernel rewritten")
    return "numba" if device.type == "cpu" and numba_available() and not cpu_reason else "torch"
