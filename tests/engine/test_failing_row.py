"""A failing row fails alone (issues 13 and 21), at the engine: three requests share every forward of the
continuous batch (the server's plan, `service.runtime.scheduler.forward_plan`); one of them fails mid-decode, at
a later step, and only it leaves (`RunningBatch.failed`), while the two others decode token for token, call for
call, as they do alone. The failures are real: a JSON schema that passes every check made before decoding but
that llguidance cannot complete (its work limit, reached after the first item), and a KV store that refuses its
input. The tiny random checkpoints spell text with the ids of `tests.engine.test_decode_constrained.CharIds`."""

from __future__ import annotations

import pytest

from service.engine.grammar import GrammarSpec, GrammarViolation
from service.engine.kv_store import FullPrecisionKVStore
from service.engine.params import DecodeParams, RowOptions
from service.engine.schema_values import has_finite_value
from service.quant.errors import NonFiniteKVError
from service.runtime.scheduler import DEFAULT_MAX_BATCHED_TOKENS, forward_plan
from tests.engine.test_decode_constrained import PROMPTS, CharIds, compilers  # noqa: F401 (compilers: a fixture)

FIELD = "response_format.json_schema.schema"
#: ``[12345, X]`` where X is an object whose ``a`` holds another such object, or an empty enum: no finite value,
#: but the pre-decoding check assumes an ``enum`` satisfiable, and llguidance compiles it and allows ``[`` first.
#: After the integer, llguidance computes the tokens forced next (``{"a": {"a": ...`` forever) and fails at its
#: items limit ("Too many items") when the ``,`` is consumed: a grammar failure at a later step.
FAILS_AFTER_ITEM = {
    "$defs": {"end": {"type": "object", "properties": {"a": {"$ref": "#/$defs/end"}}, "required": ["a"]}},
    "type": "array", "minItems": 2, "items": False,
    "prefixItems": [{"type": "integer", "minimum": 10000, "maximum": 99999},
                    {"anyOf": [{"$ref": "#/$defs/end"}, {"enum": []}]}],
}


def _run(engine, cohorts: list, joins: dict[int, int] | None = None, split: int = 0) -> list[tuple[int, int, list]]:
    """Step a batch with the server's plan until it is empty; cohorts join at their iteration (``joins``, default
    all at 0); ``split``: block-initial passes split by layers at that many tokens. Returns per iteration (index,
    most cohorts in one forward, failed)."""
    batch = engine.batch(forward_plan(DEFAULT_MAX_BATCHED_TOKENS, split_tokens=split,
                                      num_layers=engine.spec.num_layers))
    joins = joins or {i: 0 for i in range(len(cohorts))}
    log, iteration = [], 0
    while batch.cohorts or iteration <= max(joins.values()):
        for i, at in joins.items():
            if at == iteration:
                batch.join(cohorts[i])
        batch.step()
        log.append((iteration, batch.merged, list(batch.failed)))
        iteration += 1
    return log


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cache_mode", ["none", "dual"])
def test_a_grammar_failing_mid_decode_fails_its_request_alone(engines, compilers, arch, cache_mode):  # noqa: F811
    engine = engines[arch]
    assert has_finite_value(FAILS_AFTER_ITEM)  # the static check cannot refuse it: it fails mid-decode
    failing = compilers[arch].compile(GrammarSpec.json_schema(FAILS_AFTER_ITEM, FIELD))
    digits = compilers[arch].compile(GrammarSpec.regex(r"[0-9]{12}", "structured_outputs.regex"))
    # One token a call (a fixed schedule of gen_length steps): the failing row reaches the "," at a later call.
    params = DecodeParams(gen_length=16, block_length=8, steps=16, threshold=None, cache_mode=cache_mode,
                          ignore_eos=True, **({"dream_schedule": "block"} if arch == "dream" else {}))
    rows = [RowOptions(grammar=digits, temperature=1.0, seed=1), RowOptions(grammar=failing),
            RowOptions(temperature=1.0, seed=2)]
    cohorts = [engine.cohort([PROMPTS[i]], params, [rows[i]]) for i in range(3)]
    log = _run(engine, cohorts)

    failures = [(i, merged, failed) for i, merged, failed in log if failed]
    assert len(failures) == 1, log
    iteration, merged, failed = failures[0]
    assert merged == 3 and iteration > 0, [(i, m, [str(e) for _, e in f]) for i, m, f in log]  # it failed at a later step, in a forward shared by all three
    [(cohort, exc)] = failed
    assert cohort is cohorts[1] and isinstance(exc, GrammarViolation), exc
    assert exc.field == FIELD and "Too many items" in str(exc)
    assert cohorts[1].rows[0].nfe == iteration  # the calls before the failing one were absorbed, not that one
    for i in (0, 2):
        got = engine.report(cohorts[i]).rows[0]
        alone = engine.generate([PROMPTS[i]], params, [rows[i]]).rows[0]
        assert got.generated_ids == alone.generated_ids, i
        assert (got.nfe, got.reveals_per_step, got.finish_reason) == (alone.nfe, alone.reveals_per_step,
                                                                        alone.finish_reason), i
    # The constrained neighbour still follows its grammar (its state was not touched by the failing row).
    ids = engine.report(cohorts[0]).rows[0].generated_ids
    assert CharIds().decode(ids[:12]).isdigit() and set(ids[12:]) <= set(engine.spec.eos_ids), ids


def test_the_only_request_of_an_iteration_fails_alone_and_generate_raises(engines, compilers):  # noqa: F811
    """Alone in its iteration, the failing request still only fails itself (the batch does not raise: the server
    keeps its other work, e.g. likelihood tasks); `Engine.generate` raises its error."""
    engine = engines["llada"]
    failing = compilers["llada"].compile(GrammarSpec.json_schema(FAILS_AFTER_ITEM, FIELD))
    params = DecodeParams(gen_length=16, block_length=8, steps=16, threshold=None, cache_mode="dual")
    cohort = engine.cohort([PROMPTS[0]], params, [RowOptions(grammar=failing)])
    log = _run(engine, [cohort])
    assert [len(failed) for _, _, failed in log] == [0] * (len(log) - 1) + [1]
    assert log[-1][2][0][0] is cohort and isinstance(log[-1][2][0][1], GrammarViolation)
    with pytest.raises(GrammarViolation, match="Too many items") as info:
        engine.generate([PROMPTS[0]], params, [RowOptions(grammar=failing)])
    assert info.value.field == FIELD


class NonFiniteAtLastBlock(FullPrecisionKVStore):
    """A store (of a request for ``PROMPTS[1]``, 4 blocks of 8) that refuses the K/V of its last block as a
    quantized store refuses non-finite input."""

    def write(self, layer, k, v, segments, scores=None) -> None:
        if segments.block_start >= len(PROMPTS[1]) + 24:
            raise NonFiniteKVError(f"layer {layer}: keys hold NaN or inf at row 0 (injected)")
        super().write(layer, k, v, segments, scores)


@pytest.mark.parametrize("split", [0, 8], ids=["whole", "split-by-layers"])
@pytest.mark.parametrize("alone_in_iteration", [False, True])
def test_a_store_refusing_its_input_fails_its_request_alone(engines, alone_in_iteration, split):
    """The store's error is raised inside the forward (the block-initial pass's write): with others in the forward,
    each pass runs again alone and only the culprit fails; alone in its iteration (the others finished), it
    fails alone too (was: the iteration raised and the server failed every running request). With block-initial
    passes split by layers, the piece that raises is run again alone from layer 0 for each of its passes."""
    engine = engines["llada"]
    # One token a call: the last block's block-initial pass is call 24 (the others' 8 tokens are done by call 8).
    params = DecodeParams(gen_length=32, block_length=8, steps=32, threshold=None, cache_mode="dual",
                          ignore_eos=True)
    short = params.model_copy(update={"gen_length": 8, "steps": 8})
    others = [engine.cohort([PROMPTS[i]], short if alone_in_iteration else params, [RowOptions()]) for i in (0, 2)]
    broken = engine.cohort([PROMPTS[1]], params, [RowOptions()], kv_store=NonFiniteAtLastBlock())
    log = _run(engine, [others[0], broken, others[1]], split=split)
    failures = [(merged, failed) for _, merged, failed in log if failed]
    assert len(failures) == 1 and failures[0][0] == (1 if alone_in_iteration else 3), log
    [(cohort, exc)] = failures[0][1]
    assert cohort is broken and isinstance(exc, NonFiniteKVError)
    for cohort, prompt in zip(others, (PROMPTS[0], PROMPTS[2])):
        got = engine.report(cohort).rows[0]
        alone = engine.generate([prompt], cohort.params).rows[0]
        assert got.generated_ids == alone.generated_ids and got.nfe == alone.nfe
        if alone_in_iteration:
            assert got.finish_reason == "length"


def test_a_callback_raising_for_one_request_fails_that_request_alone(engines):
    """``on_block`` (the server streams from it) and ``on_done`` (the server sets the result) are the caller's code
    run for one cohort: when they raise, that cohort fails; the others decode as alone."""
    engine = engines["llada"]
    params = DecodeParams(gen_length=16, block_length=8, threshold=0.9, cache_mode="prefix", ignore_eos=True)

    def boom(block, ids):
        raise RuntimeError("the stream of this request broke")

    cohorts = [engine.cohort([PROMPTS[0]], params, [RowOptions()]),
               engine.cohort([PROMPTS[1]], params, [RowOptions()], on_block=boom),
               engine.cohort([PROMPTS[2]], params, [RowOptions()])]
    batch = engine.batch(forward_plan(DEFAULT_MAX_BATCHED_TOKENS))
    done, failed = [], []

    def on_done(cohort):
        if cohort is cohorts[2]:
            raise RuntimeError("the result of this request could not be set")
        done.append(cohort)

    for cohort in cohorts:
        batch.join(cohort)
    while batch.cohorts:
        batch.step(on_done)
        failed += batch.failed
    assert [(c, str(e)) for c, e in failed] == [(cohorts[1], "the stream of this request broke"),
                                               (cohorts[2], "the result of this request could not be set")]
    assert done == [cohorts[0]]
    for i in (0, 2):
        alone = engine.generate([PROMPTS[i]], params).rows[0]
        assert engine.report(cohorts[i]).rows[0].generated_ids == alone.generated_ids


def test_a_merged_reveal_that_raises_is_undone_and_each_pass_runs_alone_as_alone(engines, compilers,  # noqa: F811
                                                                                 monkeypatch):
    """A reveal can fail for the merged rows only (out of memory for ``[R, W, V]`` where one row fits): the passes
    then run again alone. The failed reveal had already advanced the sampling rows' generators and the grammar
    rows' positions (the chains are decided before the batched reveal); they are put back first, so every request
    still decodes token for token as alone and none fails. The fault is injected (a real one needs a device
    short of memory)."""
    import service.engine.batch as batch_module

    engine = engines["llada"]
    digits = compilers["llada"].compile(GrammarSpec.regex(r"[0-9]{12}", "structured_outputs.regex"))
    params = DecodeParams(gen_length=16, block_length=8, steps=16, threshold=None, cache_mode="dual",
                          ignore_eos=True)
    rows = [RowOptions(grammar=digits, temperature=1.0, seed=1), RowOptions(temperature=1.0, seed=2),
            RowOptions(grammar=digits, temperature=1.0, seed=3)]
    real, raised = batch_module.reveal_batch, []

    def short_of_memory(rule, batch):
        if batch.logits.shape[0] > 1 and len(raised) < 3:
            raised.append(batch.logits.shape[0])
            raise RuntimeError("out of memory for the merged rows (injected)")
        return real(rule, batch)

    monkeypatch.setattr(batch_module, "reveal_batch", short_of_memory)
    cohorts = [engine.cohort([PROMPTS[i]], params, [rows[i]]) for i in range(3)]
    log = _run(engine, cohorts)
    assert raised == [3, 3, 3] and not any(failed for _, _, failed in log)
    monkeypatch.setattr(batch_module, "reveal_batch", real)
    for i in range(3):
        alone = engine.generate([PROMPTS[i]], params, [rows[i]]).rows[0]
        assert engine.report(cohorts[i]).rows[0].generated_ids == alone.generated_ids, i
