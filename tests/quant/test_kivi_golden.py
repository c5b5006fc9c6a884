"""KIVI's reference quantizer, bit for bit: codes, scales, minima, packed words, dequantized values."""

import pytest
import torch

from service.quant.packing import pack_along, unpack_along
from service.quant.uniform import dequantize_k_groups, dequantize_v, quantize_k_groups, quantize_v
from tests.quant.golden import cases, load

DTYPES = {"torch.float16": torch.float16, "torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16}


@pytest.mark.parametrize("case", cases("kivi_k_perchannel"), ids=lambda c: c["name"])
def test_k_per_channel_matches_reference(case):
    g = load(case)
    x = g["input"]
    assert x.dtype == DTYPES[case["dtype"]]
    codes, scale, mn = quantize_k_groups(x, case["group_size"], case["bits"])
    assert torch.equal(codes.to(torch.int16), g["levels"])
    assert scale.dtype == x.dtype and torch.equal(scale, g["scale"])
    assert torch.equal(mn, g["mn"])
    assert torch.equal(pack_along(codes, case["bits"], dim=2), g["packed_code"])
    assert torch.equal(unpack_along(g["packed_code"], case["bits"], dim=2), codes)
    deq = dequantize_k_groups(codes, scale, mn, case["group_size"], torch.float32)
    assert torch.equal(deq, g["deq_fp32"])


@pytest.mark.parametrize("case", cases("kivi_v_pertoken"), ids=lambda c: c["name"])
def test_v_per_token_matches_reference(case):
    g = load(case)
    x = g["input"]
    codes, scale, mn = quantize_v(x, case["group_size"], case["bits"])
    assert torch.equal(codes.to(torch.int16), g["levels"])
    assert torch.equal(scale, g["scale"]) and torch.equal(mn, g["mn"])
    assert torch.equal(pack_along(codes, case["bits"], dim=3), g["packed_code"])
    assert torch.equal(dequantize_v(codes, scale, mn, torch.float32), g["deq_fp32"])


@pytest.mark.parametrize("case", cases("kivi_k_constant_group"), ids=lambda c: c["name"])
def test_constant_group_is_exact_and_leaves_neighbours_intact(case):
    """Departure from the reference: a zero-range group dequantizes to its exact values.

    The reference divides by a zero scale; NaN cast to int32 (-2^31 on x86) is ORed into the packed word and
    corrupts the codes that share it. Here the group gets scale 0 and codes 0, and every other code is the
    reference's.
    """
    g = load(case)
    x, bits, size = g["input"], case["bits"], case["group_size"]
    constant = (0, 0, slice(0, size), 5)  # [h0, tokens 0..G-1, d5], see the golden index
    assert (x[constant] == x[0, 0, 0, 5]).all()
    codes, scale, mn = quantize_k_groups(x, size, bits)
    assert scale[0, 0, 0, 5] == 0 and (codes[constant] == 0).all()
    # The reference's stored levels are ours except where its NaN code leaked into the packed word: inside the
    # constant group, and in a neighbour that shares the word (listed in the golden index).
    corrupted = torch.zeros_like(codes, dtype=torch.bool)
    corrupted[constant] = True
    for pos in case["levels_differing_from_spec"]:
        corrupted[tuple(pos)] = True
    assert torch.equal(codes[~corrupted].to(torch.int16), g["levels"][~corrupted])
    assert torch.equal(scale[scale != 0], g["scale"][scale != 0]) and torch.equal(mn, g["mn"])
    deq = dequantize_k_groups(codes, scale, mn, size, x.dtype)
    assert torch.equal(deq[constant], x[constant])
    words = pack_along(codes, bits, dim=2)
    assert torch.equal(unpack_along(words, bits, dim=2), codes)
    neighbours = [pos for pos in case["levels_differing_from_spec"] if pos[2] >= size]
    for pos in neighbours:  # a corrupted neighbour keeps its own correct code here
        assert codes[tuple(pos)] != g["levels"][tuple(pos)]
        grp = pos[2] // size
        expected = ((x[tuple(pos)] - mn[0, 0, grp, 5]) / scale[0, 0, grp, 5]).clamp(0, 2**bits - 1).round()
        assert codes[tuple(pos)] == expected


def test_short_last_group_has_its_own_statistics():
    """Departure from the reference (which asserts T % G == 0): T = 70, G = 32 gives groups of 32, 32 and 6."""
    x = torch.randn(1, 2, 70, 16, generator=torch.Generator().manual_seed(0)).half()
    codes, scale, mn = quantize_k_groups(x, 32, 2)
    assert scale.shape == (1, 2, 3, 16)
    tail = x[:, :, 64:]
    assert torch.equal(mn[:, :, 2], tail.amin(2))
    assert torch.equal(scale[:, :, 2], (tail.amax(2) - tail.amin(2)) / 3)
    # The full groups are exactly the reference's on the first 64 tokens.
    ref_codes, ref_scale, _ = quantize_k_groups(x[:, :, :64], 32, 2)
    assert torch.equal(codes[:, :, :64], ref_codes) and torch.equal(scale[:, :, :2], ref_scale)
