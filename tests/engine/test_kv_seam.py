"""The KV-store seam: when the engine writes and reads, what it hands over, pre-RoPE stores and scores."""

from __future__ import annotations

import pytest
import torch

from service.engine.kv_store import FullPrecisionKVStore
from service.engine.params import DecodeParams
from tests.support.fastdllm import four_prompts


class RecordingStore(FullPrecisionKVStore):
    """Full-precision store that logs every call (and keeps what it was given)."""

    def __init__(self, needs_scores=False, pre_rope_keys=False):
        super().__init__()
        self.needs_scores, self.pre_rope_keys = needs_scores, pre_rope_keys
        self.events, self.writes = [], []

    def write(self, layer, k, v, segments, scores=None):
        self.events.append(("write", layer))
        self.writes.append((layer, k.clone(), v.clone(), segments, scores))
        super().write(layer, k, v, segments, scores)

    def read(self, layer):
        self.events.append(("read", layer))
        return super().read(layer)


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_write_once_per_layer_per_block_then_read_per_step(engines, arch, mode):
    engine, store = engines[arch], RecordingStore()
    params = DecodeParams(gen_length=64, block_length=32, cache_mode=mode, threshold=0.9, ignore_eos=True)
    row = engine.generate([four_prompts(arch)[1]], params, kv_store=store).rows[0]
    layers = engine.spec.num_layers
    expected = []
    for calls in row.steps_per_block:
        expected += [("write", layer) for layer in range(layers)]
        expected += [("read", layer) for _ in range(calls - 1) for layer in range(layers)]
    assert store.events == expected
    _layer, k, v, segments, scores = store.writes[0]
    assert segments.cache_mode == mode and segments.block_start == 17 and segments.block_end == 49
    assert k.shape == v.shape == (1, engine.spec.num_kv_heads, 17 + 64, engine.spec.head_dim)
    assert scores is None
    assert store._layers == {}  # cleared at the end of the request


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_pre_rope_store_gives_the_same_tokens(engines, mode):
    engine = engines["dream"]
    params = DecodeParams(gen_length=64, block_length=32, cache_mode=mode, threshold=0.9, ignore_eos=True)
    prompts = four_prompts("dream")
    post, pre = RecordingStore(), RecordingStore(pre_rope_keys=True)
    rows_post = engine.generate(prompts, params, kv_store=post).rows
    rows_pre = engine.generate(prompts, params, kv_store=pre).rows
    assert [r.generated_ids for r in rows_pre] == [r.generated_ids for r in rows_post]
    # What a pre-RoPE store receives, rotated at each row's positions, is what a post-RoPE store receives.
    _, k_pre, _, segments, _ = pre.writes[0]
    _, k_post, _, _, _ = post.writes[0]
    pads = torch.tensor(segments.pad_lengths)
    positions = (torch.arange(segments.seq_len)[None] - pads[:, None]).clamp(min=0)
    torch.testing.assert_close(engine.model.rope.rotate(k_pre, positions), k_post, atol=1e-6, rtol=0)
    assert not torch.allclose(k_pre, k_post)


def test_scores_are_block_attention_probabilities(engines):
    engine, store = engines["llada"], RecordingStore(needs_scores=True)
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9, ignore_eos=True)
    prompts = four_prompts("llada")
    engine.generate(prompts, params, kv_store=store)
    for _, k, _, segments, scores in store.writes:
        assert scores.dtype == torch.float32 and scores.shape == (len(prompts), segments.seq_len)
        torch.testing.assert_close(scores.sum(dim=1), torch.ones(len(prompts)), atol=1e-5, rtol=0)
        for row, pad in enumerate(segments.pad_lengths):
            assert torch.all(scores[row, :pad] == 0) and torch.all(scores[row, pad:] > 0)
