"""OpenAI's strict mode for a function's ``parameters`` (``tools[].function.strict: true``) and for a
``response_format`` ``json_schema`` with ``strict: true`` (issue 45: OpenAI answers a plain pydantic
``model_json_schema()`` there with a 400): the schema must be of the subset OpenAI's Structured Outputs accepts,
checked as OpenAI checks it, before anything compiles.

The rules (OpenAI's "Supported schemas" of Structured Outputs), each refusal naming where in the schema:

* every object has ``additionalProperties: false`` and lists every one of its ``properties`` in ``required`` (an
  optional field is written as a required one whose type admits ``null``);
* types are ``string``, ``number``, ``integer``, ``boolean``, ``object``, ``array`` and ``null`` (alone or as a
  list), with ``enum``, ``const`` and ``anyOf`` (not at the root), and ``$ref`` to ``$defs`` / ``definitions``;
* the only other keywords are ``pattern`` and ``format`` (one of `FORMATS`) for strings, ``multipleOf``,
  ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` for numbers, ``minItems`` and ``maxItems``
  for arrays, and the annotations ``description``, ``title`` and ``default``; anything else (``allOf``, ``oneOf``,
  ``not``, ``if``, ``minLength``, ``patternProperties``, ``minProperties`` ...) is refused;
* at most `MAX_PROPERTIES` properties in all, `MAX_NESTING` levels of nesting and `MAX_ENUM_VALUES` enum values.

A schema that passes is decoded exactly (`service.engine.tool_format.call_grammar`): with every property required
and no other key allowed, the grammar admits precisely the objects the schema describes.
"""

from __future__ import annotations

from typing import Any

from service.engine.errors import EngineInputError

#: Keywords a strict schema may use on any node, and per type.
ANY_NODE = frozenset({"type", "description", "title", "default", "enum", "const", "anyOf", "$ref", "$defs",
                      "definitions"})
BY_TYPE = {"string": frozenset({"pattern", "format"}),
           "number": frozenset({"multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
           "object": frozenset({"properties", "required", "additionalProperties"}),
           "array": frozenset({"items", "minItems", "maxItems"})}
BY_TYPE["integer"] = BY_TYPE["number"]
#: Types a strict schema may name.
TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
#: String formats strict mode takes.
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})
#: OpenAI's limits on a strict schema: properties in all, levels of nesting, enum values in all.
MAX_PROPERTIES = 5000
MAX_NESTING = 10
MAX_ENUM_VALUES = 1000


def check_strict(schema: Any, field: str, function: str, owner: str = "function") -> None:
    """Refuse ``schema`` (a function's ``parameters``, or a ``response_format``'s schema) unless it is in strict
    mode's subset (module docstring).

    Args:
        schema: the ``parameters`` as sent (None: no parameters, which strict mode takes as an empty object).
        field: the request field, e.g. ``tools.0.function.parameters`` (the error's ``param``).
        function: the function's (or the ``json_schema``'s) name, for the message; owner: what it names
            (``function``, or ``response_format json_schema``).

    Raises:
        EngineInputError: the first rule broken, with where in the schema (``properties.city.items``).
    """
    if schema is None:
        return
    counts = {"properties": 0, "enum": 0}
    _node(schema, (), 0, counts, field, f"{owner} {function!r}", root=True)


def strict_parameters(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A strict function's ``parameters`` as decoded: absent is an object with no arguments (``{}`` exactly)."""
    return {"type": "object", "properties": {}, "required": [], "additionalProperties": False} if schema is None \
        else schema


def _node(node: Any, path: tuple[str, ...], depth: int, counts: dict[str, int], field: str, function: str,
          root: bool = False) -> None:
    def refuse(rule: str) -> EngineInputError:
        where = ".".join(path) or "the root"
        return EngineInputError(f"{field}: {function} is strict, and in strict mode {rule} (at {where}); "
                                "send strict: false to use this schema as it is", field)

    if not isinstance(node, dict):
        raise refuse("every schema is an object (a boolean schema is not supported)")
    if depth > MAX_NESTING:
        raise refuse(f"a schema nests at most {MAX_NESTING} levels")
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if kinds is not None and (not isinstance(kinds, list) or not kinds
                              or not all(isinstance(k, str) and k in TYPES for k in kinds)):
        raise refuse(f"type is one of {', '.join(sorted(TYPES))} or a list of them")
    if root and "anyOf" in node:
        raise refuse("the root is an object, not anyOf")
    allowed = ANY_NODE.union(*(BY_TYPE.get(k, ()) for k in kinds or ()))
    if kinds is None and "properties" in node:
        allowed |= BY_TYPE["object"]
    for key in node:
        if key not in allowed:
            typed = f" on type {'/'.join(kinds)}" if kinds else ""
            raise refuse(f"{key!r} is not supported{typed}")
    if "format" in node and not (isinstance(node["format"], str) and node["format"] in FORMATS):
        raise refuse(f"format is one of {', '.join(sorted(FORMATS))}")
    if isinstance(node.get("enum"), list):
        counts["enum"] += len(node["enum"])
        if counts["enum"] > MAX_ENUM_VALUES:
            raise refuse(f"a schema has at most {MAX_ENUM_VALUES} enum values in all")
    if "object" in (kinds or ()) or "properties" in node:
        properties = node.get("properties", {})
        if node.get("additionalProperties") is not False:
            raise refuse("every object has additionalProperties: false")
        if not isinstance(properties, dict):
            raise refuse("properties is an object")
        required = node.get("required") or []
        missing = [name for name in properties if not isinstance(required, list) or name not in required]
        if missing:
            raise refuse(f"every property is required (missing from required: {', '.join(missing)}; make a field "
                         "optional with a type that admits null)")
        counts["properties"] += len(properties)
        if counts["properties"] > MAX_PROPERTIES:
            raise refuse(f"a schema has at most {MAX_PROPERTIES} properties in all")
        for name, child in properties.items():
            _node(child, (*path, "properties", name), depth + 1, counts, field, function)
    if "items" in node:
        _node(node["items"], (*path, "items"), depth + 1, counts, field, function)
    if not isinstance(node.get("anyOf", []), list) or not isinstance(node.get("required", []), list):
        raise refuse("anyOf and required are lists")
    for i, branch in enumerate(node.get("anyOf") or ()):
        _node(branch, (*path, "anyOf", str(i)), depth, counts, field, function)
    for key in ("$defs", "definitions"):
        if not isinstance(node.get(key, {}), dict):
            raise refuse(f"{key} is an object of schemas")
        for name, child in (node.get(key) or {}).items():
            _node(child, (*path, key, name), 0, counts, field, function)


__all__ = ["FORMATS", "MAX_ENUM_VALUES", "MAX_NESTING", "MAX_PROPERTIES", "check_strict", "strict_parameters"]
