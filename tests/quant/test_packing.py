import pytest
import torch

from service.quant.errors import KVQuantError
from service.quant.packing import pack_along, pack_stream, unpack_along, unpack_stream


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000])
def test_stream_round_trip_is_tight(bits, numel):
    codes = torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(numel), dtype=torch.uint8)
    words = pack_stream(codes, bits)
    assert words.dtype == torch.int32
    assert words.numel() == -(-numel * bits // 32)  # ceil: only the last word may be partly empty
    assert torch.equal(unpack_stream(words, bits, numel), codes)


def test_word_layout_matches_the_reference():
    # 2 bits: word w holds elements w*16 + i at bit offset 2*i; code 3 at i = 15 sets the sign bit.
    codes = torch.zeros(16, dtype=torch.uint8)
    codes[0], codes[1], codes[15] = 1, 2, 3
    assert pack_along(codes, 2, 0).tolist() == [1 | 2 << 2 | -(2**31) | 2**30]
    assert torch.equal(unpack_along(pack_along(codes, 2, 0), 2, 0), codes)


def test_bad_bits_and_lengths_are_refused():
    with pytest.raises(KVQuantError, match=r"bits must be one of \(2, 4, 8\), got 3"):
        pack_stream(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(KVQuantError, match="not a multiple of 32 / bits = 16"):
        pack_along(torch.zeros(24, dtype=torch.uint8), 2, 0)
