"""The interpreter wrapper of tests/triton_interpreter.py: kernels compute what they did, Triton's language is restored
after each launch, and helper calls inside a launch no longer re-patch it (the time it saves)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton under its interpreter (TRITON_INTERPRET=1, as on CPU)",
)


if importlib.util.find_spec("triton") is not None:  # Triton's interpreter looks helpers up in the module's globals
    import triton
    import triton.language as tl

    @triton.jit
    def add_row_max(row, total):  # a helper calling Triton's own helpers (`tl.max` sees `core`, not `tl`)
        return total + tl.max(row, axis=0) + tl.sum(tl.zeros((16,), tl.float32), axis=0)

    @triton.jit
    def row_max_sums(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
        pid = tl.program_id(0)
        row = tl.load(x_ptr + pid * N + tl.arange(0, N))
        total = 0.0
        for _ in tl.static_range(CALLS):
            total = add_row_max(row, total)
        tl.store(out_ptr + pid, total)


@pytest.fixture(scope="module")
def kernels():
    from triton.runtime import interpreter

    if not getattr(interpreter._patch_lang, "kvtool_wrapped", False):
        pytest.skip("this Triton's interpreter is not wrapped (tests/triton_interpreter.py found other internals)")
    return tl, interpreter, row_max_sums


def _run(row_max_sums, x: torch.Tensor, calls: int) -> torch.Tensor:
    out = torch.empty(x.shape[0])
    row_max_sums[(x.shape[0],)](x, out, N=x.shape[1], CALLS=calls)
    return out


@pytest.mark.parametrize("calls", [1, 5])
def test_a_kernel_calling_helpers_computes_what_torch_does_and_leaves_triton_restored(kernels, calls):
    tl, _, row_max_sums = kernels
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(calls))
    torch.testing.assert_close(_run(row_max_sums, x, calls), calls * x.amax(dim=1))
    for module in (tl, tl.core):  # the launch's patch undone: the language's builtins are Triton's own again
        assert tl.core.is_builtin(module.load) and tl.core.is_builtin(module.tensor.__add__)


def test_helper_calls_inside_a_launch_do_not_patch_the_language_again(kernels, monkeypatch):
    tl, interpreter, row_max_sums = kernels
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    counts = {}
    for calls in (1, 8):
        patches = []
        original = interpreter._patch_builtin
        monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a, original=original: patches.append(1) or original(*a))
        _run(row_max_sums, x, calls)
        monkeypatch.setattr(interpreter, "_patch_builtin", original)
        counts[calls] = len(patches)
    assert counts[1] == counts[8] > 0, counts  # one patch per launch, however many helpers it calls
