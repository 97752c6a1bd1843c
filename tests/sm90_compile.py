"""Compile the decode kernels a CPU call would launch for an H100 (sm_90), without a GPU; used by
tests/test_kernels_fit_sm90.py in a subprocess (it must import Triton without ``TRITON_INTERPRET``).

    python tests/sm90_compile.py SIDE:HEAD_DIM:GQA[:ROPE_SOURCE] ...     # prints one JSON line per compiled kernel

A stand-in active driver answers "device 0, target sm_90", and every launch becomes a warm-up: Triton compiles
the kernel with the call's real arguments and constants, nothing runs (the call's outputs are left unwritten).
What a compile cannot show on CPU and a launch would refuse on the GPU: shared memory past the device's limit
(227 KB on an H100: 380 KB once failed every Palu test at head_dim 256 there). Registers and spills come from
the binary, read by `benchmarks.kernel_resources`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("tests/sm90_compile.py compiles for a GPU: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver, jit  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class SM90:
    """The active-driver calls `JITFunction.run` makes before it compiles."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def resources(kernel) -> dict:
    """Shared memory (Triton's own count: the dynamic allocation a launch asks for), and registers and stack bytes
    from the binary (`benchmarks.kernel_resources.resources`)."""
    from benchmarks.kernel_resources import resources as binary_resources

    found = binary_resources(kernel)
    return {"shared_bytes": kernel.metadata.shared, "registers": found["registers"], "stack_bytes": found["stack_bytes"],
            "warps": kernel.metadata.num_warps}


def main(cases: list[str]) -> None:
    import test_kernels  # build_case, SIDES (imported after the driver is set: it imports the runtime)

    from kvtool.recipe import QuantSpec
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    test_kernels.SIDES.update({  # sides the kernel tests build in their own files (tests/test_kernels_qjl.py)
        "turboquant-2.5qjl-3.5": (  # the outlier split on both sides, keys with the QJL residual (sketched per block)
            QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.25, qjl=True, path="keys"),
            QuantSpec(method="turboquant", bits=3, extra_bits=0.5, path="values")),
    })

    compile_only = jit.JITFunction.run
    case_name = {"now": ""}

    def warm_up(self, *args, grid, warmup, **kwargs):
        kernel = compile_only(self, *args, grid=grid, warmup=True, **kwargs)
        print(json.dumps({"case": case_name["now"], "kernel": self.__name__, **resources(kernel)}), flush=True)
        return kernel

    jit.JITFunction.run = warm_up
    for case in cases:
        side, head_dim, gqa, *source = case.split(":")
        rope = (source[0], int(head_dim), False) if source else None
        args, _ = test_kernels.build_case(side, int(head_dim), int(gqa), "cpu", seed=1, rope=rope)
        case_name["now"] = case
        paged_decode_attention(**args, kernel="general")  # every format, one block at a time


if __name__ == "__main__":
    driver.set_active(SM90())
    main(sys.argv[1:])
