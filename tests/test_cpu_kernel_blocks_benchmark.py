"""benchmarks.cpu_kernel_blocks: the case it times is a real store the kernel reads (its output is the dense attention
over the encoded blocks), and one small run writes its table's JSON."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks.cpu_kernel_blocks import kernel_case, main
from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")


@pytest.mark.parametrize("recipe, block_size", [("kivi-4bit", 32), ("turboquant-k3.5-v2.5", 32), ("turboquant-local", 16)])
def test_the_timed_case_is_the_attention_over_its_encoded_blocks(recipe, block_size):
    from kvtool.calibration import build_quantizers
    from kvtool.recipe import load_recipe

    args = kernel_case(recipe, 64, rows=3, streams=2, blocks=3, block_size=block_size)
    kq, vq = build_quantizers(load_recipe(recipe), 64, torch.float32, {})
    group = torch.zeros(6, dtype=torch.long)
    keys = kq.decode_blocks({k: v for k, v in args["body"][0].items() if k in kq.block_spec()}, group)[:, 0].float()
    values = vq.decode_blocks({k: v for k, v in args["body"][1].items() if k in vq.block_spec()}, group)[:, 0].float()
    keys, values = keys.reshape(2, 3 * block_size, 64), values.reshape(2, 3 * block_size, 64)  # (S, T, D): blocks in table order
    keys = torch.cat([keys, args["new_k"][:, None]], dim=1)  # the step's own token is attended too
    values = torch.cat([values, args["new_v"][:, None]], dim=1)
    reference = torch.softmax(args["q"] @ keys.transpose(1, 2), dim=-1) @ values  # (S, R, D)
    torch.testing.assert_close(cpu_decode_attention(**args), reference, rtol=1e-4, atol=1e-4)


def test_a_small_run_writes_its_rows(tmp_path):
    out = tmp_path / "blocks.json"
    main(["--recipes", "kivi-4bit", "turboquant-3bit", "--head-dims", "64", "--streams", "1", "--blocks", "2",
          "--calls", "2", "--block-size", "16", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["recipe"], r["head_dim"], r["blocks"]) for r in rows] == [("kivi-4bit", 64, 2), ("turboquant-3bit", 64, 2)]
    assert all(r["us_per_block"] > 0 and r["block_size"] == 16 for r in rows)
