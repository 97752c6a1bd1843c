"""benchmarks.kernel_resources: the tiled decode kernel compiled for sm_90 on this machine (no GPU).

Also the only place CI assembles the kernel's inline PTX (the interpreter runs the portable path):
a PTX string that ptxas rejects fails here, not first on a lent GPU.
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


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="this Triton wheel ships no NVIDIA tools")
def test_the_tiled_kernel_compiles_for_sm90_with_its_inline_ptx_and_reports_its_registers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, not the interpreter
    out = tmp_path / "resources.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_resources", "--bits", "2", "4", "8", "--head-dims", "64", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["bits"] for r in rows] == [2, 4, 8]
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["stack_bytes"] >= 0 and r["sass_instructions"] > 100
        assert r["instructions"].get("HMMA", 0) > 0  # the products are on tensor cores
        assert r["instructions"].get("LOP3", 0) > 0  # the PTX's lop3 code extraction is there
        assert 0 < r["occupancy"] <= 1
    assert "registers" in proc.stdout


def test_the_tool_refuses_the_interpreter():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernel_resources", "--bits", "4"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "TRITON_INTERPRET" in proc.stderr
