"""benchmarks/palu_rotation.py on the embedded kvref-5m: the mixings of Palu's latents coded by the real quantizer."""

import argparse

import pytest
import torch

from benchmarks.common import MODELS, SHARED
from benchmarks.palu_rotation import MIXINGS, measure, mixed_quantizer
from kvtool.methods.lowrank.palu import latent_rotation
from kvtool.models.loading import load_model

pytestmark = pytest.mark.skipif(not (SHARED / MODELS["kvref-5m"][0]).exists(), reason="needs ../shared/models/kvref-5m")


def test_every_mixing_row_with_codes_and_total_sqnr():
    model, tokenizer = load_model(str(SHARED / MODELS["kvref-5m"][0]))
    args = argparse.Namespace(calib_samples=2, calib_seq_len=128, samples=1, seq_len=161, ranks=[96, 64, 512], bits=[2, 4])
    rows = measure(model, tokenizer, "kvref-5m", args)
    cells = {(r["part"], r["rank"], r["bits"], r["mixing"]): r for r in rows}
    assert set(cells) == {(p, r, b, m) for p in ("keys", "values") for r in (96, 64) for b in (2, 4) for m in MIXINGS}  # 512 > 2 x 64
    for (part, rank, bits, mixing), row in cells.items():
        assert row["total_sqnr_db"] <= row["codes_sqnr_db"] + 3  # the projection's error adds to the codes'
        if bits == 2:
            assert row["codes_sqnr_db"] < cells[(part, rank, 4, mixing)]["codes_sqnr_db"]  # codes really on
    assert cells[("keys", 64, 4, "rotate_basis")]["codes_sqnr_db"] > cells[("keys", 64, 4, "none")]["codes_sqnr_db"]


def test_mixed_quantizer_folds_the_rotation_into_the_basis():
    basis = torch.linalg.qr(torch.randn(1, 128, 128, generator=torch.Generator().manual_seed(0)))[0]
    bias = torch.zeros(1, 128)
    rotated = mixed_quantizer("values", basis, bias, 96, 3, "rotate_basis", 64)
    assert torch.allclose(rotated.basis, (basis[:, :, :96].double() @ latent_rotation(96)).float())
    assert not rotated.spec.hadamard and mixed_quantizer("keys", basis, bias, 96, 3, "hadamard", 64).spec.hadamard
    assert mixed_quantizer("keys", basis, bias, 96, 16, "none", 64).spec.bits == 16
