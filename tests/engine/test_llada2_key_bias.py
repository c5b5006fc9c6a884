"""The key-bias correction on LLaDA2's committed blocks (service/quant/committed.py `CommitWriter`, read by
service/engine/models/llada2.py's attention): it changes the decode against the same store without it (it was
accepted and ignored before), for KIVI and KVQuant (pre-RoPE keys); the pre-RoPE bias with partial RoPE equals the
term computed directly, with each query rotated back by each key's angle; off, the decode is what it was."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import generate
from service.engine.loading import load_checkpoint
from service.engine.models.layers import RotaryEmbedding
from service.quant.committed import CommitWriter
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from tests.support.artifacts import kvquant_state_for
from tests.support.llada2 import LLADA2_CKPT

PARAMS = BlockCausalParams(gen_length=64, block_length=32, steps=32, threshold=0.9)


@pytest.fixture(scope="module")
def loaded():
    return load_checkpoint(LLADA2_CKPT["llada2"])


def store(spec, method: str, corrected: bool):
    if method == "kivi":
        config = KVQuantConfig(method="kivi", bits=2, k_group_size=8, key_bias_correction=corrected)
        return make_kv_store(config, spec, attention="torch")
    state = kvquant_state_for(spec, bits=2)
    config = KVQuantConfig(method="kvquant", bits=2, artifact_id=state.id, key_bias_correction=corrected)
    return make_kv_store(config, spec, state, attention="torch")


def decode_logits(loaded, prompt, kv_store):
    """The decode's generated ids and the logits of its first forward over the active block."""
    seen = []
    forward = loaded.model.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.detach().clone())
        return out

    loaded.model.forward = spy
    try:
        result = generate(loaded.model, prompt, PARAMS, loaded.spec.mask_id, loaded.spec.eos_ids, kv_store=kv_store)
    finally:
        del loaded.model.forward
    return result.generated_ids, seen


@pytest.mark.parametrize("method", ["kivi", "kvquant"])
def test_the_correction_changes_the_committed_blocks_attention(loaded, method):
    rng = random.Random(3)
    prompt = [rng.randrange(5, 490) for _ in range(70)]
    plain_ids, plain = decode_logits(loaded, prompt, store(loaded.spec, method, False))
    again_ids, again = decode_logits(loaded, prompt, store(loaded.spec, method, False))
    fixed_ids, fixed = decode_logits(loaded, prompt, store(loaded.spec, method, True))
    assert plain_ids == again_ids and all(torch.equal(a, b) for a, b in zip(plain, again))  # off: deterministic
    # The prompt's first forward reads no committed block; every later one does, and its logits move.
    later = [(a, b) for a, b in zip(plain[1:], fixed[1:]) if a.shape == b.shape]
    assert later and all(not torch.equal(a, b) for a, b in later)
    if method == "kivi":  # 2-bit groups of 8 on this prompt: the tokens change too (measured, seed-free decode)
        assert fixed_ids != plain_ids


def test_pre_rope_bias_with_partial_rope_equals_the_direct_term():
    torch.manual_seed(0)
    b, h, h_kv, t, keys, d, r = 2, 4, 2, 3, 5, 16, 8
    rope = RotaryEmbedding(r, 10000.0, full_precision=False)
    quantizer = SimpleNamespace(config=SimpleNamespace(key_bias_correction=True), pre_rope_keys=True)
    commits = [SimpleNamespace(slot=s, start=0, end=0, quantizer=quantizer) for s in range(b)]
    writer = CommitWriter(commits, lambda k, p: k, rope.cos_sin)
    q = torch.randn(b, h, t, d)
    steps = torch.rand(b, h_kv, keys, d)
    got = writer._score_bias(q, steps)
    cos, sin = rope.cos_sin(torch.arange(keys).expand(b, keys))  # [B, 1, K, r]
    want = torch.empty(b, h, t, keys)
    for j in range(keys):
        head = q[..., :r]
        back = head * cos[:, :, j:j + 1] - torch.cat([-head[..., r // 2:], head[..., : r // 2]], -1) * sin[:, :, j:j + 1]
        a = torch.cat([back, q[..., r:]], dim=-1)  # R^T q: the query in the key's pre-RoPE basis
        s = steps[:, :, j].repeat_interleave(h // h_kv, dim=1)[:, :, None]  # [B, H, 1, D]
        want[..., j] = -(a.square() * s.square()).sum(-1) / (24 * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_running_batch_of_corrected_and_uncorrected_rows_decodes_each_as_alone(loaded):
    """One forward holds rows of several requests: a corrected KIVI row, an uncorrected one, a KVQuant corrected one
    (pre-RoPE) and a full-precision one; the bias is each corrected row's own (0 elsewhere), so each decodes token
    for token as alone."""
    from service.engine.block_causal_batch import BlockCausalBatch, BlockCausalCohort

    rng = random.Random(4)
    prompts = [[rng.randrange(5, 490) for _ in range(70)] for _ in range(4)]
    stores = [lambda: store(loaded.spec, "kivi", True), lambda: store(loaded.spec, "kivi", False),
              lambda: store(loaded.spec, "kvquant", True), lambda: None]
    alone = [generate(loaded.model, p, PARAMS, loaded.spec.mask_id, loaded.spec.eos_ids, kv_store=make()).generated_ids
             for p, make in zip(prompts, stores)]
    batch = BlockCausalBatch(loaded.model)
    cohorts = [BlockCausalCohort(loaded.model, [p], [PARAMS], loaded.spec.mask_id, loaded.spec.eos_ids,
                                 kv_store=make()) for p, make in zip(prompts, stores)]
    widths = []
    forward = loaded.model.forward

    def spy(input_ids, *args, **kwargs):
        widths.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    loaded.model.forward = spy
    try:
        with torch.inference_mode():
            for cohort in cohorts:
                batch.join(cohort)
            while batch.cohorts:
                batch.step()
                assert not batch.failed
    finally:
        del loaded.model.forward
    assert max(widths) == 4  # the four rows shared forwards
    assert [c.results[0].generated_ids for c in cohorts] == alone
