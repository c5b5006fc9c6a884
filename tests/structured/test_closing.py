"""The closing rule of the constrained reveal (issue 45, `service.engine.grammar`), in-process on the embedded
model's tokenizer: a grammar's closing path is a response its own matcher accepts, the least ``max_tokens`` a
refusal names is exactly where a complete response starts to fit, and a row keeps a path that fits whatever the
model chooses (here: the worst choice, the token that opens the most, at every position)."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.errors import EngineInputError
from service.engine.grammar import GrammarSpec, budget
from service.engine.params import response_length
from service.engine.tool_format import Function, call_grammar, parse_calls

FREE = {"type": "object", "properties": {"a": {"type": "integer"}, "s": {"type": "string"},
                                         "xs": {"type": "array", "items": {"type": "object"}}},
        "required": ["a", "s", "xs"]}
SPECS = [
    GrammarSpec.json_schema(FREE, "response_format.json_schema.schema"),
    GrammarSpec.json_object("response_format"),
    GrammarSpec.regex(r"[a-z]+@[a-z]+\.(com|org)", "guided_regex"),
    GrammarSpec.regex(r"a+b", "guided_regex"),
    GrammarSpec.choice(["a long choice", "short"], "guided_choice"),
    GrammarSpec.lark(call_grammar([Function("f", None, FREE)], True, False), "tools"),
]


def _replay(compiler, grammar, tokens):
    state = grammar.start()
    for token in tokens:
        state.consume(token)
    return state


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_the_start_path_is_a_complete_response(compiler, spec):
    grammar = compiler.compile(spec)
    path = grammar.start_path
    assert path is not None and path[-1] == compiler.grammar_eos and grammar.min_tokens == len(path)
    state = _replay(compiler, grammar, path[:-1])
    assert state.accepting
    state.consume(path[-1])
    assert state.ended


def test_the_least_max_tokens_named_is_where_a_response_starts_to_fit(compiler):
    grammar = compiler.compile(SPECS[-1])
    with pytest.raises(EngineInputError) as refused:
        grammar.fits(1, 32)
    assert refused.value.field == "max_tokens"
    least = int(str(refused.value).rsplit("at least ", 1)[1])
    grammar.fits(least, 32)
    with pytest.raises(EngineInputError):
        grammar.fits(least - 1, 32)
    assert budget(least, response_length(least, 32)) >= grammar.min_tokens


@pytest.mark.parametrize("extra", [0, 3, 40])
def test_a_row_closes_whatever_the_model_chooses(compiler, extra):
    """At every position the "model" picks, among the tokens the grammar allows, the one ranked worst for
    closing (opening brackets, long text): the row still ends accepting, EOS included, within its positions."""
    grammar = compiler.compile(SPECS[-1])
    max_tokens = grammar.min_tokens - 1 + extra
    state = grammar.start(max_tokens, response_length(max_tokens, 32))
    assert state.path is not None
    rank = compiler._close_rank()
    written = []
    while not state.ended:
        assert len(written) < budget(max_tokens, response_length(max_tokens, 32))
        allowed = compiler.allowed([state])[0].numpy()
        worst = int(np.where(allowed, rank, -1).argmax())
        written.append(state.consume_closing(worst))
    assert len(written) <= max_tokens + 1
    text = compiler.tokenizer.decode(written[:-1])
    calls, complete = parse_calls(text)
    assert complete and calls and calls[0].name == "f"


def test_restore_brings_the_path_back(compiler):
    grammar = compiler.compile(SPECS[0])
    state = grammar.start(64, 64)
    mark, path = state.mark(), list(state.path)
    state.consume_closing(state.path[0])
    assert state.path != path
    state.restore(mark)
    assert state.path == path and state.consumed == 0
