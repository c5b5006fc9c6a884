"""The batched reveal (`service.engine.reveal.reveal_batch`): each row decides as the per-row rule does alone, and
its two options, per-row allowed-token masks and the log-probabilities of revealed tokens, work end to end."""

from __future__ import annotations

import pytest
import torch

from service.engine.models import reveal_rule
from service.engine.params import DecodeParams
from service.engine.reveal import RevealBatch, reveal_batch
from service.engine.sampling import llada_fixed_schedule
from service.runtime.scheduler import forward_plan
from tests.support.fastdllm import four_prompts

MASK, V, W = 99, 100, 8


def _batch(logits, tokens, rule, params_list, steps, **kw) -> RevealBatch:
    plans = [rule.row_plan(step, int((t == MASK).sum()), p,
                           rule.block_plan(W, p), None) for t, p, step in zip(tokens, params_list, steps)]
    n = len(params_list)
    return RevealBatch(
        logits=logits, tokens=tokens, mask_id=MASK, eos=torch.tensor([1]), banned=torch.tensor([MASK]),
        width=[W] * n, step=steps, count=[c for c, _, _ in plans], fraction=[f for _, f, _ in plans],
        first_only=[o for _, _, o in plans], threshold=[p.threshold for p in params_list],
        temperature=[0.0] * n, generator=[None] * n, random_remasking=[False] * n,
        neg_entropy=[p.threshold is None for p in params_list], ignore_eos=[True] * n, **kw,
    )


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_each_row_reveals_what_the_per_row_rule_reveals(arch):
    rule = reveal_rule(arch)
    gen = torch.Generator().manual_seed(0)
    params_list = [DecodeParams(gen_length=16, block_length=W, threshold=0.3),
                   DecodeParams(gen_length=16, block_length=W, threshold=None, steps=8),
                   DecodeParams(gen_length=16, block_length=W, threshold=0.05),
                   DecodeParams(gen_length=16, block_length=W, threshold=None, steps=4)]
    steps = [1, 2, 0, 1]
    logits = torch.randn(4, W, V, generator=gen) * 3
    tokens = torch.full((4, W), MASK)
    tokens[0, :3] = 5  # some columns already revealed
    tokens[3, 5] = 7
    result = reveal_batch(rule, _batch(logits, tokens, rule, params_list, steps))
    for r, (params, step) in enumerate(zip(params_list, steps)):
        candidates = (tokens[r] == MASK).nonzero()[:, 0]
        plan = llada_fixed_schedule(W, params.steps // 2) if (arch == "llada" and params.steps) else None
        chosen, picked = rule.reveal(step, logits[r, candidates], params, plan, 0.0, None, torch.tensor([MASK]))
        expected = tokens[r].clone()
        expected[candidates[chosen]] = picked
        assert torch.equal(result.tokens[r], expected), r
        assert int(result.counts[r]) == chosen.numel()
        assert int(result.masks_left[r]) == int((expected == MASK).sum())


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_logits_at_the_listed_columns_only_decide_as_the_whole_window(arch):
    """`RevealBatch.columns`: greedy rows given logits at their masked columns only, and a sampling row given its
    whole window, reveal exactly what the whole window's logits reveal (tokens, counts, masks left, draws)."""
    rule = reveal_rule(arch)
    gen = torch.Generator().manual_seed(1)
    params_list = [DecodeParams(gen_length=16, block_length=W, threshold=0.3),
                   DecodeParams(gen_length=16, block_length=W, threshold=None, steps=8),
                   DecodeParams(gen_length=16, block_length=W, threshold=0.05)]
    steps = [1, 2, 1]
    logits = torch.randn(3, W, V, generator=gen) * 3
    tokens = torch.full((3, W), MASK)
    tokens[0, [0, 2, 3, 6]] = 5
    tokens[1, 1] = 7
    tokens[2, :2] = 4

    def decided(columns):
        batch = _batch(logits, tokens, rule, params_list, steps)
        batch.temperature[2], batch.generator[2] = 0.7, torch.Generator().manual_seed(3)
        if columns is not None:
            most = max(len(c) for c in columns)
            batch.columns = torch.tensor([c + [W] * (most - len(c)) for c in columns])
            picked = torch.tensor([c + [c[-1]] * (most - len(c)) for c in columns])
            batch.logits = logits.gather(1, picked[..., None].expand(-1, -1, V))
        return reveal_batch(rule, batch)

    listed = [[j for j in range(W) if tokens[r, j] == MASK] for r in range(2)] + [list(range(W))]
    assert [len(c) for c in listed] == [4, 7, W]
    whole, compact = decided(None), decided(listed)
    for name in ("tokens", "revealed", "counts", "masks_left", "stop"):
        assert torch.equal(getattr(whole, name), getattr(compact, name)), name
    assert int(whole.counts.sum()) > 0


def test_listed_columns_refuse_options_that_read_the_whole_window():
    rule = reveal_rule("llada")
    params = DecodeParams(gen_length=16, block_length=W, threshold=0.3)
    batch = _batch(torch.zeros(1, 1, V), torch.full((1, W), MASK), rule, [params], [0], logprobs=0)
    batch.columns = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="columns"):
        reveal_batch(rule, batch)


def test_allowed_masks_and_log_probabilities_of_revealed_tokens(engines):
    """A cohort whose rows may only choose a few ids gets only those; with ``logprobs`` each revealed token comes
    with its log-probability and alternatives, from the call that revealed it."""
    engine = engines["llada"]
    prompt = four_prompts("llada")[0]
    params = DecodeParams(gen_length=32, block_length=16, threshold=0.9, ignore_eos=True)
    allowed_ids = torch.tensor([5, 6, 7, 8])

    def allowed(row, call):
        mask = torch.zeros(1, engine.spec.vocab_size, dtype=torch.bool)
        mask[0, allowed_ids] = True
        return mask

    batch = engine.batch(forward_plan())
    cohort = engine.cohort([prompt], params)
    cohort.allowed, cohort.logprobs = allowed, 3
    free = engine.cohort([prompt], params)  # shares the forwards, unconstrained
    batch.join(cohort)
    batch.join(free)
    with torch.inference_mode():
        while batch.cohorts:
            batch.step()
    ids = engine.report(cohort).rows[0].generated_ids
    assert len(ids) == 32 and set(ids) <= set(allowed_ids.tolist())
    assert engine.report(free).rows[0].generated_ids == engine.generate([prompt], params).rows[0].generated_ids
    entries = cohort.token_logprobs[0]
    assert sorted(col for col, *_ in entries) == list(range(cohort.response_start, cohort.seq_len))
    for col, token, logprob, top in entries:
        assert token == cohort.response[0][col - cohort.response_start] and logprob <= 0.0
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and top[0][1] >= logprob - 1e-6
        assert {i for i, _ in top} <= set(allowed_ids.tolist())
