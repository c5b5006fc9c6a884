"""Continuous batching: requests with mixed settings join and leave a running batch mid-flight, and each decodes
token for token as it does alone (`service.engine.batch`); the reveal rule comes from the model family."""

from __future__ import annotations

import pytest
import torch

from service.engine import EngineInputError
from service.engine.models import DiffusionLM, reveal_rule
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.quant.store import make_kv_store
from service.runtime.scheduler import (
    DEFAULT_MAX_BATCHED_TOKENS,
    Hold,
    first_passes_first,
    forward_plan,
    forward_tokens,
    plan_forwards,
)
from tests.engine.test_decode_quantized import policy_for, states  # noqa: F401 (states: a fixture)
from tests.support.fastdllm import four_prompts


def _p(**kw) -> DecodeParams:
    base = {"gen_length": 64, "block_length": 32, "cache_mode": "dual", "threshold": 0.9, "ignore_eos": True}
    return DecodeParams(**{**base, **kw})


def _store(engine, kind: str | None):
    """None: the engine's full-precision store; else a quantized store (KIVI 2/4 bits, dLLM-KVQ 2 bits)."""
    if kind is None:
        return None
    if kind == "dllm_kvq":
        table = policy_for(engine.spec, 2)
        config = KVQuantConfig(method="dllm_kvq", bits=2, k_group_size=8, policy_id=table.id)
        return make_kv_store(config, engine.spec, artifact=table)
    return make_kv_store(KVQuantConfig(method="kivi", bits=int(kind[-1]), k_group_size=8), engine.spec)


# (prompt index, params, row options, store kind, iteration at which the request joins)
MIXED = [
    (2, _p(), RowOptions(), "kivi2", 0),
    (0, _p(gen_length=96, block_length=32, threshold=0.7), RowOptions(temperature=0.8, seed=3), None, 0),
    (1, _p(cache_mode="prefix", gen_length=32, block_length=16, threshold=None, steps=8), RowOptions(), "kivi4", 1),
    (3, _p(cache_mode="none", gen_length=48, block_length=16), RowOptions(temperature=1.0, seed=9), None, 2),
    (1, _p(gen_length=128, block_length=64, threshold=0.5), RowOptions(), "dllm_kvq", 3),
    (2, _p(cache_mode="dual", threshold=None, steps=16, ignore_eos=False), RowOptions(), None, 5),
    (0, _p(cache_mode="none", gen_length=32, block_length=32), RowOptions(), None, 7),
]


def _first_passes_first(budget: int, split_tokens: int = 0, num_layers: int = 0):
    """The server's plan (`service.runtime.loop.Worker._loop`): the head-of-line rule, then the token budget (and
    the layer split); the passes it held are counted in ``held``, the pieces of split passes in ``pieces``."""
    plan = forward_plan(budget, split_tokens=split_tokens, num_layers=num_layers)
    state = {"hold": Hold(), "held": 0, "pieces": 0}

    def planned(passes):
        run, state["hold"] = first_passes_first(passes, state["hold"])
        state["held"] += len(passes) - len(run)
        forwards = plan(run)
        state["pieces"] += sum(p.layers is not None for group in forwards for p in group)
        return forwards

    planned.state = state
    return planned


def run_mixed(engine, batch, prompts: list[list[int]]) -> tuple[dict, list[int]]:
    """Decode :data:`MIXED` in ``batch``, each request joining at its iteration: its cohorts by index and the most
    cohorts merged in one forward at each iteration."""
    pending = sorted(enumerate(MIXED), key=lambda item: item[1][4])
    cohorts, iteration, merged = {}, 0, []
    with torch.inference_mode():
        while pending or batch.cohorts:
            while pending and pending[0][1][4] <= iteration:
                index, (prompt, params, row, kind, _) = pending.pop(0)
                cohorts[index] = engine.cohort([prompts[prompt]], params, [row], _store(engine, kind))
                batch.join(cohorts[index])
            batch.step()
            merged.append(batch.merged)
            iteration += 1
    return cohorts, merged


@pytest.mark.parametrize("budget", [DEFAULT_MAX_BATCHED_TOKENS, 100, "first-passes-first", "layer-split"],
                         ids=["default", "small-budget", "first-passes-first", "layer-split"])
@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_mixed_requests_joining_mid_flight_decode_as_alone(engines, arch, budget):
    """Requests of every cache mode, quantized or not, joining at different iterations decode token for token as
    alone under each plan: the token budget, the head-of-line rule, and the rule with block-initial passes split
    by layers (`service.runtime.scheduler.split_by_layers`: pieces of at most 40 tokens' worth)."""
    engine = engines[arch]
    prompts = four_prompts(arch)
    if budget == "first-passes-first":
        plan = _first_passes_first(DEFAULT_MAX_BATCHED_TOKENS)
    elif budget == "layer-split":
        plan = _first_passes_first(DEFAULT_MAX_BATCHED_TOKENS, 40, engine.spec.num_layers)
    else:
        plan = forward_plan(budget)
    cohorts, merged = run_mixed(engine, engine.batch(plan), prompts)
    # passes of different requests, at different blocks and settings, shared forwards (as far as the token
    # budget of `plan_forwards` allows)
    assert max(merged) >= (2 if budget == 100 else 3)
    if budget in ("first-passes-first", "layer-split"):
        assert plan.state["held"] > 0  # running requests waited for the first passes of those that joined
    if budget == "layer-split":
        assert plan.state["pieces"] > 0  # block-initial passes ran piece by piece
    for index, (prompt, params, row, kind, _) in enumerate(MIXED):
        got = engine.report(cohorts[index])
        alone = engine.generate([prompts[prompt]], params, [row], kv_store=_store(engine, kind))
        a, b = got.rows[0], alone.rows[0]
        assert a.generated_ids == b.generated_ids, index
        assert (a.nfe, a.reveals_per_step, a.steps_per_block) == (b.nfe, b.reveals_per_step, b.steps_per_block)
        if kind is not None:
            assert got.kv.bytes_held == alone.kv.bytes_held and got.kv.k_storage_bits == alone.kv.k_storage_bits


def test_a_cancelled_request_leaves_at_once_and_frees_its_kv(engines):
    engine = engines["llada"]
    prompts = four_prompts("llada")
    flag = [False]
    batch = engine.batch(forward_plan())
    stay = engine.cohort([prompts[2]], _p(gen_length=96))
    leave = engine.cohort([prompts[1]], _p(gen_length=96), cancelled=lambda: flag)
    batch.join(stay)
    batch.join(leave)
    finished = []
    with torch.inference_mode():
        batch.step()
        batch.step()
        flag[0] = True
        finished += batch.step()  # the row is marked cancelled after this forward and leaves at once
        assert finished == [leave] and leave not in batch.cohorts and leave.store._sequence == {}
        while batch.cohorts:
            finished += batch.step()
    assert engine.report(leave).rows[0].finish_reason == "cancelled"
    alone = engine.generate([prompts[2]], _p(gen_length=96)).rows[0]
    assert engine.report(stay).rows[0].generated_ids == alone.generated_ids


def test_every_family_declares_its_reveal_rule():
    with pytest.raises(TypeError, match="must set reveal_rule"):
        type("ThirdModel", (DiffusionLM,), {"arch": "third", "logits_shift": 0, "CHECKPOINT_NAMES": {}})
    with pytest.raises(EngineInputError, match="legal: llada, dream"):
        reveal_rule("third")


def test_forwards_hold_at_most_the_token_budget(engines):
    """`plan_forwards` packs passes of one kind into a forward while its padded tokens (rows x widest input) fit
    the budget; window and full passes never share a forward; a pass larger than the budget runs alone."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([prompts[i % 4]], _p(gen_length=32 * (1 + i % 3))) for i in range(6)]
    with torch.inference_mode():
        for i, cohort in enumerate(cohorts):
            batch.join(cohort)
            if i % 2 == 0:
                batch.step()  # some cohorts move to cached steps, so both kinds are pending
        calls = [batch._next[c] if c in batch._next else c.next_pass() for c in batch.cohorts]
    assert {c.kind for c in calls} == {"full", "window"}
    everything = plan_forwards(calls, 1 << 30, padding_slack=float("inf"))
    assert len(everything) == 2 and [{p.kind for p in g} for g in everything] == [{"window"}, {"full"}]
    budget = max(p.width * len(p.rows) for p in calls)
    groups = plan_forwards(calls, budget)
    assert len(groups) > 2 and sorted(id(p) for g in groups for p in g) == sorted(id(p) for p in calls)
    for group in groups:
        assert forward_tokens(group) <= budget and len({p.kind for p in group}) == 1
    assert all(len(g) == 1 for g in plan_forwards(calls, 1))  # each pass alone, none dropped
    # padding: a forward's padded tokens stay within 1 + slack times its real tokens
    for group in plan_forwards(calls, 1 << 30, padding_slack=0.0):
        assert len({p.width for p in group}) == 1


@pytest.mark.parametrize("kinds", [("kivi4", "kivi4", None, "kivi2"), ("dllm_kvq", "dllm_kvq")],
                         ids=["kivi-with-others", "dllm_kvq-whole-forward"])
def test_quantized_stores_of_one_format_dequantize_together_and_decode_as_alone(engines, kinds, monkeypatch):
    """Requests whose quantized stores share a batch key (one format, whatever the prompt lengths) are dequantized
    in one set of ops per layer (`service.quant.rows`); each still decodes token for token as alone, beside stores
    that answer alone (full precision, another bit width)."""
    from service.quant.store import QuantizedKVStore

    engine = engines["llada"]
    prompts = four_prompts("llada")
    assert len({len(p) for p in prompts[: len(kinds)]}) > 1  # prompts of different lengths
    calls = []
    together = QuantizedKVStore.window_kv_batch
    monkeypatch.setattr(QuantizedKVStore, "window_kv_batch",
                        lambda self, stores, *a, **kw: calls.append(len(stores)) or together(self, stores, *a, **kw))
    params = _p(gen_length=64, block_length=32, threshold=None, steps=8)
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([prompts[i]], params, None, _store(engine, kind)) for i, kind in enumerate(kinds)]
    with torch.inference_mode():
        for cohort in cohorts:
            batch.join(cohort)
        while batch.cohorts:
            batch.step()
    assert calls and set(calls) == {2}
    for i, kind in enumerate(kinds):
        alone = engine.generate([prompts[i]], params, kv_store=_store(engine, kind)).rows[0]
        assert engine.report(cohorts[i]).rows[0].generated_ids == alone.generated_ids, i


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_kvquant_stores_of_different_lengths_dequantize_together_and_decode_as_alone(engines, arch, request,
                                                                                      monkeypatch):
    """KVQuant stores of one state dequantize together (`service.quant.rows_nuq`: codebooks, ranges, sparse
    outliers, then RoPE at each row's own positions) even when their prompts, and so their reused lengths,
    differ; each request still decodes token for token as alone, beside a full-precision one."""
    from service.quant.store import QuantizedKVStore

    engine = engines[arch]
    prompts = four_prompts(arch)
    state = request.getfixturevalue("states")[arch, 4]  # fitted on the model's own K/V: real outliers

    def kvquant():
        return make_kv_store(KVQuantConfig(method="kvquant", bits=4, kvquant_state_id=state.id), engine.spec,
                             artifact=state, attention="torch")

    calls = []
    together = QuantizedKVStore.window_kv_batch
    monkeypatch.setattr(QuantizedKVStore, "window_kv_batch",
                        lambda self, stores, *a, **kw: calls.append(len(stores)) or together(self, stores, *a, **kw))
    params = _p(gen_length=64, block_length=32, threshold=None, steps=8)
    picked = [(2, True), (1, True), (0, False), (3, True)]  # prompt lengths 40, 17, 5 (unquantized), 9
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([prompts[i]], params, None, kvquant() if quantized else None) for i, quantized in picked]
    with torch.inference_mode():
        for cohort in cohorts:
            batch.join(cohort)
        while batch.cohorts:
            batch.step()
    assert calls and set(calls) == {3}
    for (i, quantized), cohort in zip(picked, cohorts):
        alone = engine.generate([prompts[i]], params, kv_store=kvquant() if quantized else None).rows[0]
        assert engine.report(cohort).rows[0].generated_ids == alone.generated_ids, i


def test_the_lm_head_runs_only_at_the_columns_a_reveal_reads(engines):
    """A greedy row's logits are computed at its masked columns only (the only ones a reveal takes); a sampling
    row's at its whole window (its draws are as wide as the window). Counted at the LM head's input."""
    engine = engines["llada"]
    prompt = four_prompts("llada")[0]
    seen: list[int] = []
    handle = engine.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    try:
        greedy = engine.generate([prompt], _p()).rows[0]
        sampled = engine.generate([prompt], _p(), [RowOptions(temperature=0.8, seed=1)]).rows[0]
    finally:
        handle.remove()
    masked, i = [], 0
    for steps in greedy.steps_per_block:
        left = 32
        for revealed in greedy.reveals_per_step[i:i + steps]:
            masked.append(left)
            left -= revealed
        i += steps
    assert any(m < 32 for m in masked)  # some calls had columns revealed already
    assert seen[:greedy.nfe] == masked
    assert seen[greedy.nfe:] == [32] * sampled.nfe


def test_a_request_validated_where_it_was_made_is_not_checked_again(engines):
    """The server checks a request once, where it is made (`service.api.planning.Planner._jobs`, `Job.validated`); the engine then makes
    its cohort without `validate_request`, which refuses the same arguments when asked."""
    engine = engines["llada"]
    prompt = [*four_prompts("llada")[0], engine.spec.mask_id]  # what validate_request refuses, cheaply
    with pytest.raises(EngineInputError, match="contains the mask id"):
        engine.cohort([prompt], _p())
    assert engine.cohort([prompt], _p(), validated=True).x[0, : len(prompt)].tolist() == prompt


def test_a_pass_split_by_layers_is_preempted_only_before_its_first_piece(engines):
    """Between the pieces of a block-initial pass split by layers the store holds part of the block's layers, so
    the cohort is not preemptible there (`RunningBatch.preemptible`); at the next block boundary it is, and
    preempted there and resumed it decodes as alone."""
    engine = engines["llada"]
    layers = engine.spec.num_layers
    prompt = four_prompts("llada")[0]
    params = _p(gen_length=64, block_length=32, threshold=None, steps=8)
    batch = engine.batch(forward_plan(split_tokens=8, num_layers=layers))
    cohort = engine.cohort([prompt], params, None, _store(engine, "kivi4"))
    batch.join(cohort)
    mid_split = 0
    with torch.inference_mode():
        while True:
            batch.step()
            call = batch._next[cohort]
            if call.hidden is not None:  # between two pieces of the block-initial pass
                mid_split += 1
                assert not batch.preemptible(cohort)
            if batch.preemptible(cohort):
                break
        assert mid_split == layers - 1  # one layer a piece
        assert cohort.block == 1 and call.kind == "full" and call.layers is None
        call = batch.preempt(cohort)
        batch.join(cohort, call)
        while batch.cohorts:
            batch.step()
    alone = engine.generate([prompt], params, kv_store=_store(engine, "kivi4")).rows[0]
    got = engine.report(cohort).rows[0]
    assert (got.generated_ids, got.nfe) == (alone.generated_ids, alone.nfe)
