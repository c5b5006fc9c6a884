"""benchmarks/diffusion_gemma_kv_bytes.py's admission figures at 26B-A4B's K/V shape: counts that follow from the
formats (bf16, K groups of 32, V groups of 32)."""

from __future__ import annotations

from benchmarks.diffusion_gemma_kv_bytes import per_token_at_a4b
from service.engine.models.diffusion_gemma import GLOBAL, SLIDING


def test_bytes_per_token_per_layer_kind_follow_the_formats():
    figures = per_token_at_a4b()
    # bf16: 25 sliding layers of 2 x 4 x 256 values and 5 global of 2 x 2 x 512, 2 bytes each
    assert figures["none"] == {SLIDING: 25 * 2 * 4 * 256 * 2, GLOBAL: 5 * 2 * 2 * 512 * 2}
    for bits in (4, 2):
        # KIVI: b-bit codes, K's bf16 scale and minimum per channel per 32 tokens, V's per token per 32 channels:
        # b + 1 bits per value on both sides, on both kinds
        for kind in (SLIDING, GLOBAL):
            assert figures[f"kivi-{bits}"][kind] == figures["none"][kind] * (bits + 1) / 16
            # dLLM-KVQ: one K token per group held in bf16 instead of its code, with an int32 slot and its derived
            # int64 index, and the read's int64 code-row index per slot: more than KIVI, under twice
            assert figures[f"kivi-{bits}"][kind] < figures[f"dllm_kvq-{bits}"][kind] < 2 * figures[f"kivi-{bits}"][kind]
            assert figures[f"kvquant-{bits}"][kind] < figures[f"kivi-{bits}"][kind]
