"""The general decode kernel fits an H100 (sm_90) at the widest shapes: compiled here, no GPU (tests/sm90_compile.py).

Shared memory is what the interpreter cannot check and a GPU refuses at launch: Palu latents at head_dim 256 with keys
stored before RoPE needed 380-512 KB (the basis kept in shared memory for the key, its RoPE partners and the values)
and failed on the H100 in two GPU sessions while passing every interpreter test; TurboQuant's outlier split needed
680 KB there under Triton 3.9 (its placements rebuilt per block, 256 KB each). With QJL keys the query is also
sketched per block through two whole sketch placements (256 KB for the rest instance at head_dim 256): they fit (118 KB
in all for the kernel, compiled here with Triton 3.9), and this case keeps them fitting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
REPO = Path(__file__).resolve().parents[1]
H100_SHARED = 232448  # bytes of shared memory one program may use on an H100 (227 KB, opted in)


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="this Triton wheel ships no NVIDIA tools")
def test_latent_and_split_formats_at_head_dim_256_fit_an_h100_shared_memory():
    cases = [
        "palu-fp16:256:8:sequence",  # pre-RoPE keys: basis, partners, values (512 KB before the chunks)
        # TurboQuant's outlier split on both sides, two placements per block (680 KB before the chunks), and its keys'
        # QJL sketches (two more placements, whole per block)
        "turboquant-2.5qjl-3.5:256:8",
    ]  # one to two minutes each to compile on a 2-core machine, so two cases: the widest footprints
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, not the interpreter
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sm90_compile.py"), *cases], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    partials = [r for r in rows if r["kernel"] == "_decode_partials"]
    assert sorted(r["case"] for r in partials) == sorted(cases)
    for r in rows:
        assert 0 < r["shared_bytes"] <= H100_SHARED, r
        assert 0 < r["registers"] <= 255, r
