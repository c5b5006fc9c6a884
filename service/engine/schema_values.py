"""Whether a JSON Schema admits any finite JSON value, decided before a grammar is compiled from it.

llguidance compiles a schema whose every value is infinitely deep (``{"type": "object", "properties": {"a":
{"$ref": "#"}}, "required": ["a"]}``: each ``a`` must hold another such object) and even allows its first token,
so the compiler's first-token check passes and decoding reveals ``{"a": {"a": ...`` until the parser's work limit
fails the batch mid-decode. :func:`has_finite_value` finds such schemas by the grammar rule of productive
nonterminals: a subschema is productive when some finite value satisfies it given what is already known to be
productive, iterated to the least fixed point.

The test is conservative: it refuses only schemas that certainly have no finite value. Each rule below is a
necessary condition of a finite value (a value that satisfies a schema also satisfies its ``$ref`` target, every
``allOf`` member and some ``anyOf``/``oneOf`` member, has one of its ``type`` s, holds a value of each required
property's schema, and as many items as ``minItems`` asks); any keyword it does not model (``enum``, ``const``,
``not``, ``if``, remote ``$ref`` s, ...) is assumed satisfiable. A schema it passes may still be empty, for reasons
the grammar engine finds itself (a first token that cannot exist) or not at all.
"""

from __future__ import annotations

from typing import Any

#: Keywords whose value is one subschema.
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
#: Keywords whose value is a list of subschemas.
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
#: Keywords whose value maps names to subschemas.
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def has_finite_value(schema: Any) -> bool:
    """False only when no finite JSON value can satisfy ``schema`` (a JSON Schema: an object or a boolean) by the
    module's rules; True otherwise, also for anything this check does not understand. Never raises on malformed
    schemas (the grammar engine refuses those with its own message)."""
    order = _post_order(schema)
    productive: set[int] = set()
    changed = True
    while changed:  # least fixed point; children come before parents, so one pass settles all but cycles
        changed = False
        for node in order:
            if id(node) not in productive and _satisfiable(node, schema, productive):
                productive.add(id(node))
                changed = True
    return _holds(schema, productive)


def _holds(node: Any, productive: set[int]) -> bool:
    """Whether ``node`` (a subschema) is known to admit a finite value."""
    if isinstance(node, bool):
        return node
    if isinstance(node, dict):
        return id(node) in productive
    return True  # not a schema: not ours to judge


def _satisfiable(node: dict[str, Any], root: Any, productive: set[int]) -> bool:
    """The module's necessary conditions of a finite value of ``node``, its subschemas judged by ``productive``."""
    def ok(child: Any) -> bool:
        return _holds(child, productive)

    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if target is not None and not ok(target):
            return False
    members = node.get("allOf")
    if isinstance(members, list) and not all(ok(m) for m in members):
        return False
    for key in ("anyOf", "oneOf"):
        members = node.get(key)
        if isinstance(members, list) and members and not any(ok(m) for m in members):
            return False
    if "enum" in node or "const" in node:
        return True  # a listed value is finite JSON; whether it satisfies the rest is not this check's to say
    kinds = node.get("type")
    if kinds is None:
        return True  # any type: a scalar satisfies the object and array keywords
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        return True
    return any(_kind_satisfiable(node, kind, ok) for kind in kinds)


def _kind_satisfiable(node: dict[str, Any], kind: Any, ok) -> bool:
    if kind == "object":
        properties = node.get("properties")
        required = node.get("required")
        if isinstance(properties, dict) and isinstance(required, list):
            return all(ok(properties[name]) for name in required if isinstance(name, str) and name in properties)
        return True
    if kind == "array":
        least = node.get("minItems", 0)
        if not isinstance(least, int) or isinstance(least, bool) or least < 1:
            return True
        prefix = node.get("prefixItems")
        if prefix is None and isinstance(node.get("items"), list):
            prefix, rest = node["items"], node.get("additionalItems")  # draft 2019's tuple form
        else:
            rest = node.get("items")
        prefix = prefix if isinstance(prefix, list) else []
        if not all(ok(item) for item in prefix[:least]):
            return False
        return least <= len(prefix) or rest is None or ok(rest)
    return True


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/$defs/x``) points at; None for any other reference."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(node: dict[str, Any]) -> list[Any]:
    out = []
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out.append(node[key])
    for key in _LIST:
        if isinstance(node.get(key), list):
            out.extend(m for m in node[key] if isinstance(m, dict))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out.extend(m for m in node[key].values() if isinstance(m, dict))
    return out


def _post_order(root: Any) -> list[dict[str, Any]]:
    """Every object subschema reachable from ``root`` (through keywords and local ``$ref`` s), children first;
    iterative, so a deeply nested schema cannot exhaust Python's stack."""
    if not isinstance(root, dict):
        return []
    seen: set[int] = {id(root)}
    order: list[dict[str, Any]] = []
    stack: list[tuple[dict[str, Any], bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        stack.append((node, True))
        children = _children(node)
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(root, ref)
            if isinstance(target, dict):
                children.append(target)
        for child in children:
            if id(child) not in seen:
                seen.add(id(child))
                stack.append((child, False))
    return order


__all__ = ["has_finite_value"]
