"""Bit-sliced, token-split packing: exact round trips, the documented byte layout, exact sizes,
and the raw-value identities the attention algebra relies on."""

import pytest
import torch

from kvtool.methods.quant.packing import (
    fold_weights,
    pack_codes,
    packed_bytes,
    packed_rows,
    raw_slices,
    slice_widths,
    telescope,
    unpack_codes,
)

BITS = list(range(1, 9))


def random_codes(bits, shape, seed=0):
    return torch.randint(0, 2**bits, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("leading", [(), (3,), (2, 5)])
def test_round_trip_exact(bits, leading):
    codes = random_codes(bits, (*leading, 32, 24))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*leading, 32 * bits // 8, 24)
    assert torch.equal(unpack_codes(packed, bits, 32).long(), codes)


@pytest.mark.parametrize("bits", BITS)
def test_extreme_codes_round_trip(bits):
    for value in (0, 2**bits - 1):
        codes = torch.full((64, 8), value)
        assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, 64).long(), codes)


@pytest.mark.parametrize("bits", BITS)
def test_bytes_per_code_is_exactly_bits(bits):
    assert packed_bytes(32, 64, bits) * 8 == 32 * 64 * bits  # 3-bit codes take 3 bits, not 4
    assert packed_rows(32, bits) == 4 * bits


def test_slice_widths():
    assert slice_widths(3) == [2, 1] and slice_widths(7) == [4, 2, 1] and slice_widths(8) == [8]
    with pytest.raises(ValueError):
        slice_widths(9)


def test_hand_computed_4bit_layout():
    """4 bits: byte [j, c] holds token j (low nibble) and token j + S/2 (high nibble) of channel c."""
    codes = torch.zeros(8, 2, dtype=torch.long)
    codes[0, 0], codes[4, 0], codes[1, 1], codes[7, 1] = 3, 10, 15, 1
    packed = pack_codes(codes, 4)
    assert packed.shape == (4, 2)
    assert int(packed[0, 0]) == 3 + (10 << 4)
    assert int(packed[1, 1]) == 15 and int(packed[3, 1]) == 1 << 4


def test_hand_computed_3bit_layout():
    """3 bits = a 2-bit slice (rows 0..S/4-1) then a 1-bit slice (S/8 rows) of the high bit."""
    codes = torch.zeros(8, 1, dtype=torch.long)
    codes[0, 0], codes[2, 0], codes[7, 0] = 5, 6, 4  # 0b101, 0b110, 0b100
    packed = pack_codes(codes, 3)
    assert packed.shape == (3, 1)
    low = [1, 0, 2, 0, 0, 0, 0, 0]  # low 2 bits of tokens 0..7
    assert int(packed[0, 0]) == low[0] | low[2] << 2 | low[4] << 4 | low[6] << 6
    assert int(packed[1, 0]) == low[1] | low[3] << 2 | low[5] << 4 | low[7] << 6
    high = [1, 0, 1, 0, 0, 0, 0, 1]
    assert int(packed[2, 0]) == sum(bit << i for i, bit in enumerate(high))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_any_integer_input_dtype(dtype):
    codes = random_codes(4, (16, 4)).to(dtype)
    assert torch.equal(unpack_codes(pack_codes(codes, 4), 4, 16).to(dtype), codes)


def test_non_contiguous_input():
    codes = random_codes(2, (24, 32)).t()  # (32, 24) non-contiguous
    assert torch.equal(unpack_codes(pack_codes(codes, 2), 2, 32).long(), codes)


def test_token_count_not_multiple_of_8_rejected():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(12, 4), 4)


@pytest.mark.parametrize("bits", BITS)
def test_raw_values_give_exact_contractions(bits):
    """q . c_t and sum_t w_t c_t computed from raw (unmasked) slices equal the true ones."""
    codes = random_codes(bits, (3, 32, 16), seed=bits)
    packed = pack_codes(codes, bits)
    q = torch.randn(3, 5, 16, dtype=torch.float64)
    w = torch.randn(3, 5, 32, dtype=torch.float64)
    scores = sum(
        (1 << low) * telescope(q @ raw.double().transpose(-1, -2), width, 32) for width, low, raw in raw_slices(packed, bits, 32)
    )
    mixed = sum((1 << low) * (fold_weights(w, width, 32) @ raw.double()) for width, low, raw in raw_slices(packed, bits, 32))
    torch.testing.assert_close(scores, q @ codes.double().transpose(-1, -2))
    torch.testing.assert_close(mixed, w @ codes.double())


def test_raw_identities_hold_per_block_of_a_longer_axis():
    """Several blocks side by side on the last axis: each block is corrected on its own."""
    codes = random_codes(2, (4, 32, 8))  # 4 blocks
    packed = pack_codes(codes, 2)
    (width, _, raw), = raw_slices(packed, 2, 32)  # (4, 32, 8): raw values in token order
    q = torch.randn(8, dtype=torch.float64)
    raw_scores = (raw.double() @ q).reshape(-1)  # (4 blocks x 32 tokens)
    torch.testing.assert_close(telescope(raw_scores, width, 32), (codes.double() @ q).reshape(-1))
