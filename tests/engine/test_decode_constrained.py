"""The constrained reveal on both model families and every schedule (issue 26): the tiny random LLaDA and Dream
checkpoints (no tokenizer of their own: ids 100-194 stand for the printable ASCII characters, read by the grammar
engine through each id's text) under the regex ``[0-9]{6}``, with every cache mode, Dream's whole-response
schedule, threshold and fixed schedules, greedy and sampled: every response is six digits then EOS, and a
constrained row decodes the same alone and beside unconstrained rows (its own grammar state, shared forwards)."""

from __future__ import annotations

import string

import pytest

from service.engine.errors import EngineInputError
from service.engine.grammar import GrammarCompiler, GrammarSpec
from service.engine.params import DecodeParams, RowOptions

REGEX = r"[0-9]{6}"
PROMPTS = [[7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [20, 21]]
OFFSET, ALPHABET = 100, string.printable[:95]


class CharIds:
    """A tokenizer without files: id ``OFFSET + k`` is the character ``ALPHABET[k]``, every other id has no text."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(ALPHABET[i - OFFSET] for i in ids if 0 <= i - OFFSET < len(ALPHABET))

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [OFFSET + ALPHABET.index(c) for c in text if c in ALPHABET]}


@pytest.fixture(scope="module")
def compilers(engines):
    return {arch: GrammarCompiler(CharIds(), e.spec.vocab_size, e.spec.eos_ids) for arch, e in engines.items()}


SCHEDULES = [
    ("llada", {"cache_mode": "none", "threshold": 0.9}), ("llada", {"cache_mode": "prefix", "steps": 8}),
    ("llada", {"cache_mode": "dual", "threshold": 0.5}),
    ("dream", {"cache_mode": "none", "threshold": 0.9}),  # Dream's whole-response (origin) schedule
    ("dream", {"cache_mode": "none", "steps": 8}), ("dream", {"cache_mode": "none", "steps": 8, "dream_schedule": "block"}),
    ("dream", {"cache_mode": "prefix", "threshold": 0.9}), ("dream", {"cache_mode": "dual", "steps": 8}),
]


@pytest.mark.parametrize("arch,settings", SCHEDULES, ids=[f"{a}-{'-'.join(map(str, s.values()))}" for a, s in SCHEDULES])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_family_and_schedule(engines, compilers, arch, settings, temperature):
    engine = engines[arch]
    grammar = compilers[arch].compile(GrammarSpec.regex(REGEX, "structured_outputs.regex"))
    params = DecodeParams(block_length=8, gen_length=16, **{"threshold": None, **settings})
    rows = [RowOptions(grammar=grammar, temperature=temperature, seed=1), RowOptions(temperature=temperature, seed=2),
            RowOptions(grammar=grammar, temperature=temperature, seed=3)]
    report = engine.generate(PROMPTS, params, rows)
    for i in (0, 2):
        ids = report.rows[i].generated_ids
        assert CharIds().decode(ids[:6]).isdigit() and len(ids) == 7 and ids[6] in engine.spec.eos_ids, (i, ids)
        assert report.rows[i].finish_reason == "stop"
        alone = engine.generate([PROMPTS[i]], params, [rows[i]])
        assert alone.rows[0].generated_ids == ids
    free = engine.generate([PROMPTS[1]], params, [rows[1]])
    assert report.rows[1].generated_ids == free.rows[0].generated_ids


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_log_probabilities_of_a_constrained_row_are_the_models(engines, compilers, arch):
    """A constrained row's returned log-probabilities are the forward's own (unconstrained) distribution, as every
    other row's: the chain's edited logits (only the chosen token kept) would give 0 for every token and no
    alternatives. Greedy, one token per step (a fixed schedule of gen_length steps): the first revealed token's
    value is the block-initial pass's log-softmax at its column."""
    import torch

    engine = engines[arch]
    grammar = compilers[arch].compile(GrammarSpec.regex(REGEX, "structured_outputs.regex"))
    params = DecodeParams(block_length=8, gen_length=8, cache_mode="none", threshold=None, steps=8,
                          **({"dream_schedule": "block"} if arch == "dream" else {}))
    row = engine.generate([PROMPTS[0]], params, [RowOptions(grammar=grammar, logprobs=2)]).rows[0]
    assert len(row.logprobs) == len(row.generated_ids) == 7
    for token, entry in zip(row.generated_ids, row.logprobs):
        assert entry.token == token and -1e30 < entry.logprob < 0 and len(entry.top) == 2
        assert all(-1e30 < v <= 0 for _, v in entry.top) and entry.top[0][1] >= entry.logprob
    x = torch.tensor([PROMPTS[0] + [engine.spec.mask_id] * 8])
    with torch.inference_mode():
        logits = engine.model(x)[0, len(PROMPTS[0]):].float()
    if arch == "dream":
        logits = torch.cat([logits[:1], logits[:-1]])  # Dream predicts each position from the one before it
    logp = torch.log_softmax(logits, -1)
    # The first column is revealed at the block-initial pass (leftmost first under a constraint).
    assert row.logprobs[0].logprob == pytest.approx(float(logp[0, row.generated_ids[0]]), abs=1e-4)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_logprobs_of_a_constrained_row_are_the_models(engines, compilers, arch):
    """A grammar picks among the tokens it allows, but the log-probabilities returned are the model's own at
    the revealing step (as unconstrained): finite (a top-k alternative at ``-inf`` made the HTTP answer a 500:
    "Out of range float values are not JSON compliant"), and not the 0.0 of a chain-forced column."""
    engine = engines[arch]
    grammar = compilers[arch].compile(GrammarSpec.regex(REGEX, "structured_outputs.regex"))
    params = DecodeParams(block_length=8, gen_length=16, cache_mode="dual", threshold=0.9)
    row = engine.generate([PROMPTS[0]], params, [RowOptions(grammar=grammar, logprobs=3)]).rows[0]
    assert CharIds().decode(row.generated_ids[:6]).isdigit()
    assert len(row.logprobs) == len(row.generated_ids) > 0
    for entry in row.logprobs:
        values = [entry.logprob] + [v for _, v in entry.top]
        assert len(entry.top) == 3 and all(-1e30 < v <= 0 for v in values), entry
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
    assert any(entry.logprob < -1e-6 for entry in row.logprobs)  # the model is not certain of every digit


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema({"$ref": "#"}, "response_format.json_schema.schema"),
                                  GrammarSpec.json_schema({"anyOf": [{"$ref": "#"}]}, "structured_outputs.json")])
def test_a_grammar_that_allows_nothing_is_refused_at_compile(compilers, spec):
    """A schema whose only value would be infinitely deep compiles in llguidance but allows no first token; it
    is bad input naming the field (was a 500 "the grammar allows no token here" from the decoding loop)."""
    with pytest.raises(EngineInputError, match="allows no") as info:
        compilers["llada"].compile(spec)
    assert info.value.field == spec.field


#: The reviewer's schema: its first token (``{``) is fine, but every value needs an ``a`` that holds another one.
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    ENDLESS,
    # No token is forced here (``{`` or ``[`` first), and neither branch ends.
    {"anyOf": [ENDLESS, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}},
     "type": "object", "properties": {"head": {"$ref": "#/$defs/node"}}, "required": ["head"]},
])
def test_a_schema_with_no_finite_value_is_refused_at_compile(compilers, schema):
    """These compile in llguidance and allow a first token; decoding then failed the batch mid-response at the
    parser's work limit (a 500 "decoding failed: GrammarViolation ... Too many items"). Now bad input naming the
    field, before any decoding."""
    spec = GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
    with pytest.raises(EngineInputError, match="allows no response: no finite JSON value satisfies it") as info:
        compilers["llada"].compile(spec)
    assert info.value.field == spec.field


def test_a_recursive_schema_with_a_way_out_compiles(compilers):
    """A linked list whose ``next`` is optional, and a tree whose children may be an empty list, have finite
    values: they compile."""
    for schema in ({"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
                    "required": ["v"]},
                   {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                    "required": ["kids"]},
                   {"anyOf": [ENDLESS, {"type": "null"}]}):
        assert compilers["llada"].compile(GrammarSpec.json_schema(schema, "structured_outputs.json"))


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_an_object_is_written_in_the_schema_s_key_order(engines, compilers, arch):
    """Keys come out in the order of the schema's ``properties``, as OpenAI's structured outputs and vLLM write
    them (a client reading the stream, or comparing text, sees the order it declared). The schema was compiled from
    its sorted-key text, so ``{"z": ..., "a": ...}`` came out as ``{"a": 2, "z": 1}``. Every token is forced here,
    so the text is the grammar's alone."""
    schema = {"type": "object", "properties": {"z": {"enum": [1]}, "a": {"enum": [2]}}, "required": ["z", "a"],
              "additionalProperties": False}
    grammar = compilers[arch].compile(GrammarSpec.json_schema(schema, "response_format.json_schema.schema"))
    params = DecodeParams(cache_mode="none", block_length=8, gen_length=24, threshold=0.9)
    report = engines[arch].generate([PROMPTS[0]], params, [RowOptions(grammar=grammar)])
    engine_row = report.rows[0]
    assert engine_row.finish_reason == "stop"
    assert CharIds().decode(engine_row.generated_ids) == '{"z": 1, "a": 2}'
