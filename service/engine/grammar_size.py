"""How much a grammar will cost to compile, judged from its source before it is compiled (issue 36).

llguidance builds a lexer state for every character a grammar must spell out: a regex's repetitions are
expanded (``a{1000}{1000}`` is a million positions: ~1.5 s and ~250 MB on one core; ``b{100000}`` ~0.3 s and
~35 MB), and so are a choice's strings and a schema's property names and constants (a 200,000-character ``const``:
~0.8 s, ~77 MB). Its own parser limits (`service.engine.grammar.PARSER_LIMITS`) do not stop this, and a compile
cannot be interrupted once it runs, so the size is bounded here, from the text alone, and a grammar over it never
reaches the compile thread.

:func:`grammar_positions` counts *positions*: the characters a grammar spells out, with repetitions multiplied
out (a ``{m,n}`` counts n times, ``*``/``+``/``?`` once) and alternatives added. It is an upper-bound estimate of
the work, not of the language: ``[0-9]{3}`` is 3 positions, ``(ab|cd){10}`` is 40. Counting never recurses and
saturates just above the limit, so any source is judged in time linear in its length.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A counted repetition: {m}, {m,} or {m,n} (Rust regex syntax; spaces are not allowed inside).
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")
# Escapes followed by a braced argument: \p{Greek}, \x{10FFFF}, \u{..}, \U{..}.
_BRACED_ESCAPE = re.compile(r"\\[pPxuU]\{[^}]*\}")
# Other escapes with a fixed length: \xFF, \u00FF, \U0010FFFF, \pL; otherwise \ and one character.
_FIXED_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|[pP].|.)", re.DOTALL)
# A group's opening with its flags or name: (?:, (?i), (?i:, (?P<name>, (?<name>.
_GROUP_PREFIX = re.compile(r"\(\?(P?<[^>]*>|[a-zA-Z-]*:?)")


def regex_positions(pattern: str, cap: int) -> int:
    """The positions (module docstring) of a regex in Rust syntax, saturating at ``cap + 1``.

    Args:
        pattern: the regex as a request gives it (the whole response matches it); cap: the limit it is judged by.

    Returns: an int in [0, cap + 1]; over ``cap`` means over the limit. A malformed pattern is counted as far as
    it goes (llguidance refuses it with its own message when compiled).
    """
    # One frame per open group: [sum of the finished alternatives, the current alternative, the last item's size].
    frames: list[list[int]] = [[0, 0, 0]]
    i, n = 0, len(pattern)
    while i < n:
        ch, frame = pattern[i], frames[-1]
        if ch == "\\":
            match = _BRACED_ESCAPE.match(pattern, i) or _FIXED_ESCAPE.match(pattern, i)
            i = match.end() if match else n
            _add(frame, 1, cap)
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            _add(frame, 1, cap)
            continue
        if ch == "(":
            prefix = _GROUP_PREFIX.match(pattern, i)
            i = prefix.end() if prefix else i + 1
            frames.append([0, 0, 0])
            continue
        if ch == ")":
            i += 1
            if len(frames) > 1:
                inner = frames.pop()
                _add(frames[-1], min(inner[0] + inner[1], cap + 1), cap)
            continue
        if ch == "|":
            frame[0], frame[1], frame[2] = min(frame[0] + frame[1], cap + 1), 0, 0
            i += 1
            continue
        if ch == "{":
            repeat = _REPEAT.match(pattern, i)
            if repeat is not None:
                low, high = repeat.group(1), repeat.group(3) if repeat.group(2) else repeat.group(1)
                times = max(_count(low, cap), _count(high, cap) if high else 0, 1)
                extra = frame[2] * (times - 1)
                frame[1], frame[2] = min(frame[1] + extra, cap + 1), min(frame[2] * times, cap + 1)
                i = repeat.end()
                continue
        if ch in "*+?":  # once more at most: a star is a loop, not a copy
            i += 1
            continue
        _add(frame, 1, cap)
        i += 1
    while len(frames) > 1:  # unclosed groups (malformed: llguidance will say so)
        inner = frames.pop()
        _add(frames[-1], min(inner[0] + inner[1], cap + 1), cap)
    return min(frames[0][0] + frames[0][1], cap + 1)


def grammar_positions(kind: str, source: str, cap: int) -> int:
    """The positions of a grammar source (`service.engine.grammar.GrammarSpec`'s ``kind`` and ``source``),
    saturating at ``cap + 1``: a regex's (:func:`regex_positions`); a choice's characters; a JSON schema's
    property names, ``const`` and ``enum`` strings and ``pattern`` regexes (its other keywords compile to fixed
    rules whatever their values); none for any JSON object."""
    if kind == "regex":
        return regex_positions(source, cap)
    if kind == "choice":
        return min(sum(len(c) for c in json.loads(source)), cap + 1)
    if kind != "json_schema":
        return 0
    total, todo = 0, [json.loads(source)]
    while todo and total <= cap:  # a stack, not recursion: the schema may be as deep as the body allows
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            total += _schema_node(node, cap)
            todo.extend(v for v in node.values() if isinstance(v, dict | list))
    return min(total, cap + 1)


def _schema_node(node: dict[str, Any], cap: int) -> int:
    """The positions one schema object spells out itself (its children are counted on their own)."""
    total = 0
    for key in ("properties", "patternProperties"):
        names = node.get(key)
        if isinstance(names, dict):
            total += sum(len(name) if key == "properties" else regex_positions(name, cap) for name in names)
    for value in (node.get("const"), *(node.get("enum") if isinstance(node.get("enum"), list) else ())):
        if isinstance(value, str):
            total += len(value)
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        total += regex_positions(pattern, cap)
    return total


def _add(frame: list[int], size: int, cap: int) -> None:
    frame[1], frame[2] = min(frame[1] + size, cap + 1), size


def _count(digits: str, cap: int) -> int:
    """A repetition count, saturating (a count of thousands of digits must not become a huge int)."""
    return cap + 1 if len(digits) > len(str(cap)) else min(int(digits), cap + 1)


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opened at ``start`` (nested classes and escapes included; a ``]``
    right after the opening, or after ``^``, is a literal)."""
    i, depth, n = start + 1, 1, len(pattern)
    if i < n and pattern[i] == "^":
        i += 1
    if i < n and pattern[i] == "]":
        i += 1
    while i < n and depth:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        i += 1
    return i


__all__ = ["grammar_positions", "regex_positions"]


# ---- schemas the grammar engine is known to refuse, judged before they compile (issue 45, N3) --------------------
#: The keywords of a root object whose first token's Earley row llguidance's sizes are known for (measured on
#: llguidance 1.x: `tests/engine/test_grammar_precheck.py` compiles each case on both sides of the bound).
_PLAIN_OBJECT_KEYS = frozenset({"type", "properties", "additionalProperties", "required", "title", "description"})


def first_row_items(source: str) -> tuple[int, int] | None:
    """The items llguidance's Earley parser opens at a JSON schema's first token when the schema is a plain
    object of optional properties (its root ``type: object`` with ``properties``, no ``required``, and
    ``additionalProperties`` absent, true or false; no other keyword that shapes the value), with the count of
    those properties: every optional property is an open alternative at once, 4 items each (and 7 more for the
    extra properties ``additionalProperties`` allows, 1 fewer without them). None for any other schema (or one
    that is not JSON): only a compile can tell its rows.

    Returns: (items, optional properties) or None."""
    try:
        schema = json.loads(source)
    except ValueError:
        return None
    if not isinstance(schema, dict) or schema.get("type") != "object" or not set(schema) <= _PLAIN_OBJECT_KEYS:
        return None
    properties, extra = schema.get("properties"), schema.get("additionalProperties", True)
    if not isinstance(properties, dict) or schema.get("required") or extra not in (True, False):
        return None
    count = len(properties)
    return 4 * count + (7 if extra else -1), count
