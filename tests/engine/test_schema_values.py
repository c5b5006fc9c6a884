"""`service.engine.schema_values.has_finite_value`: refuses only schemas no finite JSON value satisfies (each case
has a value written out, or a reason none exists)."""

from __future__ import annotations

import pytest

from service.engine.schema_values import has_finite_value

SELF = {"$ref": "#"}
ENDLESS = {"type": "object", "properties": {"a": SELF}, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    False,
    SELF,  # only itself
    ENDLESS,  # {"a": {"a": ...}}
    {"type": "array", "items": SELF, "minItems": 1},  # [[[...]]]
    {"type": "array", "prefixItems": [{"type": "integer"}, SELF], "minItems": 2},
    {"anyOf": [ENDLESS, {"type": "array", "items": SELF, "minItems": 1}]},
    {"allOf": [{"type": "object"}, False]},
    {"type": ["object", "array"], "properties": {"a": SELF}, "required": ["a"], "items": SELF, "minItems": 1},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
     "$ref": "#/$defs/n"},
])
def test_no_finite_value(schema):
    assert not has_finite_value(schema)


@pytest.mark.parametrize("schema", [
    True, {},
    {"type": "object", "properties": {"a": SELF}},  # {}
    {"properties": {"a": SELF}, "required": ["a"]},  # 5: no type, so any scalar
    {"type": "object", "properties": {"a": SELF}, "required": ["a"], "enum": [{"a": 1}]},  # not this check's case
    {"type": "array", "items": SELF},  # []
    {"type": ["object", "null"], "properties": {"a": SELF}, "required": ["a"]},  # null
    {"anyOf": [ENDLESS, {"type": "string"}]},  # ""
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},  # the engine's to say
    {"type": "object", "properties": {"v": {"type": "integer"}, "next": SELF}, "required": ["v"]},  # {"v": 1}
    {"$ref": "https://example.com/remote.json"},
    "not a schema",
])
def test_a_finite_value_or_unknown(schema):
    assert has_finite_value(schema)


def test_a_deep_schema_does_not_exhaust_the_stack():
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    assert has_finite_value(schema)
    assert not has_finite_value({"$defs": {"x": schema}, "type": "array", "items": False, "minItems": 1})
