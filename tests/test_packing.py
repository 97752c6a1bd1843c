"""Bit-plane packing of integer codes: exact round trips, sizes, sign handling and the fixed layout."""

import pytest
import torch

from kvtool.methods.quant.packing import RUN, pack_codes, packed_words, unpack_codes

ALL_BITS = list(range(1, 9))
LEADING_SHAPES = [(), (3,), (2, 3), (2, 1, 4)]


def random_codes(shape, bits, seed=0, dtype=torch.int64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, shape, generator=generator).to(dtype)


def reference_pack(codes_1d: list[int], bits: int) -> list[int]:
    """Pure-Python transcription of the documented layout (runs of 32, word j = bit j, code i at bit i)."""
    words = []
    for start in range(0, len(codes_1d), RUN):
        run = codes_1d[start : start + RUN]
        for j in range(bits):
            word = sum(((code >> j) & 1) << i for i, code in enumerate(run))
            words.append(word - 2**32 if word >= 2**31 else word)  # as a signed int32
    return words


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_round_trip_exact(bits, leading):
    codes = random_codes((*leading, 96), bits, seed=bits)
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32
    assert words.shape == (*leading, 96 // 32 * bits)
    back = unpack_codes(words, bits)
    assert back.dtype == torch.uint8
    assert back.shape == codes.shape
    assert torch.equal(back.to(torch.int64), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_extreme_codes_round_trip(bits):
    """All zeros, all max codes, and alternating 0/max (max sets every bit, including bit 31 of each word)."""
    top = 2**bits - 1
    for codes in (
        torch.zeros(2, 64, dtype=torch.int64),
        torch.full((2, 64), top, dtype=torch.int64),
        (torch.arange(64) % 2 * top).expand(2, 64),
    ):
        assert torch.equal(unpack_codes(pack_codes(codes, bits), bits).long(), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_words_per_code_is_exactly_bits(bits):
    """A run of 32 b-bit codes costs exactly b int32 words (3-bit codes take 3 bits, not 4)."""
    n = 32 * 5
    words = pack_codes(random_codes((n,), bits), bits)
    assert words.numel() == packed_words(n, bits) == n // 32 * bits
    assert words.numel() * 32 == n * bits  # bits of storage == bits of payload


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_any_integer_input_dtype(dtype):
    codes = random_codes((4, 64), 4, seed=1, dtype=dtype)
    assert torch.equal(unpack_codes(pack_codes(codes, 4), 4), codes.to(torch.uint8))


def test_non_contiguous_input():
    codes = random_codes((64, 4), 3, seed=2).t()  # (4, 64), not contiguous
    assert not codes.is_contiguous()
    assert torch.equal(unpack_codes(pack_codes(codes, 3), 3).long(), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_high_bit_position_31_survives_int32_sign(bits):
    """Code 31 of a run lands on bit 31 of each word: the int32 words go negative and must unpack intact."""
    codes = torch.zeros(64, dtype=torch.int64)
    codes[31] = 2**bits - 1  # last code of run 0: every plane word has bit 31 set
    codes[63] = 1  # last code of run 1: only plane 0 has bit 31 set
    words = pack_codes(codes, bits)
    assert (words[:bits] == torch.iinfo(torch.int32).min).all()  # exactly 0x80000000 in every plane of run 0
    assert words[bits].item() == torch.iinfo(torch.int32).min
    assert (words[bits + 1 :] == 0).all()
    assert torch.equal(unpack_codes(words, bits).long(), codes)


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_matches_reference_layout_on_random_codes(bits):
    codes = random_codes((128,), bits, seed=10 + bits)
    expected = reference_pack(codes.tolist(), bits)
    assert pack_codes(codes, bits).tolist() == expected


def test_hand_computed_layout():
    """Pins the documented bit-plane layout: run-major, then plane j = bit j, code i of a run at bit i."""
    codes = torch.zeros(64, dtype=torch.int64)
    codes[0] = 1  # 0b001: run 0, plane 0, bit 0
    codes[1] = 6  # 0b110: run 0, planes 1 and 2, bit 1
    codes[31] = 7  # 0b111: run 0, all planes, bit 31
    codes[34] = 5  # 0b101: run 1 (code 2 of the run), planes 0 and 2, bit 2
    words = pack_codes(codes, 3)
    # run 0: plane0 = 0x80000001, plane1 = plane2 = 0x80000002 (as int32); run 1: [4, 0, 4]
    assert words.tolist() == [-2147483647, -2147483646, -2147483646, 4, 0, 4]


def test_hand_computed_two_bit_pattern():
    codes = torch.arange(32) % 4  # 0,1,2,3,0,1,...
    words = pack_codes(codes, 2)
    # plane 0 = bit 0 of each code = odd positions = 0xAAAAAAAA; plane 1 = positions 2,3 mod 4 = 0xCCCCCCCC
    assert words.tolist() == [0xAAAAAAAA - 2**32, 0xCCCCCCCC - 2**32]


def test_unpack_hand_words():
    words = torch.tensor([5, -(2**31)], dtype=torch.int32)  # plane0: bits 0 and 2; plane1: bit 31
    codes = unpack_codes(words, 2)
    expected = torch.zeros(32, dtype=torch.uint8)
    expected[0] = expected[2] = 1
    expected[31] = 2
    assert torch.equal(codes, expected)


@pytest.mark.parametrize("n", [1, 16, 31, 33, 48, 100])
def test_length_not_multiple_of_32_rejected(n):
    with pytest.raises(ValueError, match=rf"last dimension \({n}\) must be a multiple of 32"):
        pack_codes(torch.zeros(2, n, dtype=torch.int64), 4)


@pytest.mark.parametrize("bits", [0, -1, 9, 16])
def test_bits_out_of_range_rejected(bits):
    with pytest.raises(ValueError, match=rf"bits must be in 1\.\.8, got {bits}"):
        pack_codes(torch.zeros(32, dtype=torch.int64), bits)
