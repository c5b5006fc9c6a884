"""Issue 45, N3: a JSON schema the grammar engine is known to refuse is refused before it takes a compile lane
(`service.engine.grammar_size.first_row_items`, `GrammarCompiler._check_rows`). The pre-check is sound against
the engine itself: for each shape it judges, on both sides of its bound, it refuses exactly the schemas the
compile refuses (llguidance's "Current row has N items"), with the same count of items; the shapes it does not
judge are left to the compile. The embedded model's tokenizer; counts, no wall-clock bar."""

from __future__ import annotations

import json

import pytest

from service.engine.errors import EngineInputError
from service.engine.grammar import GrammarCompiler, GrammarSpec
from service.engine.grammar_size import first_row_items
from service.engine.loading import load_tokenizer
from tests.support.paths import REPO

EMBEDDED = REPO / "service" / "assets" / "embedded"
TYPES = [{"type": "string"}, {"type": "integer"}, {"enum": ["a", "b"]},
         {"type": "object", "properties": {"x": {"type": "boolean"}}}, {}]


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer(EMBEDDED)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _schema(count: int, extra: bool | None, **more) -> dict:
    """An object of ``count`` optional properties of mixed types (``extra``: its additionalProperties; None
    leaves it out)."""
    schema = {"type": "object", "title": "T",
              "properties": {f"field_{i}": TYPES[i % len(TYPES)] for i in range(count)}, **more}
    return schema if extra is None else {**schema, "additionalProperties": extra}


def _engine_items(compiler, schema: dict) -> int | None:
    """The items the engine reports at the first token when its compile refuses the schema (None: it compiles),
    the pre-check bypassed (`GrammarCompiler._compile`)."""
    try:
        compiler._compile(GrammarSpec.json_schema(schema, "s"))
    except EngineInputError as exc:
        assert "Current row has" in str(exc), exc
        return int(str(exc).split("Current row has ")[1].split(" ")[0])
    return None


@pytest.mark.parametrize(("extra", "bound"), [(None, 499), (True, 499), (False, 501)])
def test_the_precheck_refuses_exactly_what_the_engine_refuses_on_both_sides_of_its_bound(compiler, extra, bound):
    limit = compiler.limits.max_items_in_row
    for count in (bound - 1, bound, bound + 100):
        schema = _schema(count, extra)
        items, optional = first_row_items(json.dumps(schema))
        assert optional == count
        assert _engine_items(compiler, schema) == (items if items > limit else None), count
        started = compiler.compiles_started
        if items > limit:  # refused before it is handed to a lane, with the engine's reason
            with pytest.raises(EngineInputError) as refused:
                compiler.compile(GrammarSpec.json_schema(schema, "response_format.json_schema.schema"))
            message = str(refused.value)
            assert refused.value.field == "response_format.json_schema.schema"
            assert f"{count:,} optional properties" in message and "before compiling" in message, message
            assert compiler.compiles_started == started
        else:
            compiler.compile(GrammarSpec.json_schema(schema, "s"))
            assert compiler.compiles_started == started + 1


def test_shapes_it_does_not_judge_are_left_to_the_compile(compiler):
    """A required property, no ``type``, another keyword or a schema for the extra properties: the engine's rows
    differ (some compile at 800 properties), so only a compile tells."""
    for schema in (_schema(800, None, required=["field_0"]), {"properties": _schema(800, None)["properties"]},
                   _schema(800, None, minProperties=1), _schema(800, {"type": "string"})):
        assert first_row_items(json.dumps(schema)) is None
    assert first_row_items("[1, 2]") is None and first_row_items("not json") is None
