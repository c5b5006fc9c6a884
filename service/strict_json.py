"""JSON as clients must send it: UTF-8, nested at most `MAX_DEPTH` levels, numbers finite.

Python's `json` accepts what JSON (RFC 8259) does not: ``NaN``, ``Infinity`` and floats that overflow to inf
(``1e400``), which then reach a store or a metric as non-standard JSON; and it recurses once per nesting level, so a
body nested 100k deep raises ``RecursionError`` (not ``ValueError``), and one nested a few hundred deep can make
a later ``json.dumps`` fail the same way. :func:`loads` refuses all of these with an error that names where the
offending value is (``scores.acc``, ``prompt``), for the HTTP layer's ``param``. It sits below every other
package (it imports none), so the API, the artifacts and the store can all use it.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

#: Most nested arrays/objects in one document (every request and artifact of this server nests fewer than 10).
MAX_DEPTH = 64

# One lexical token of a JSON text: a string, a punctuation mark, or a bare word (number, true, NaN ...). Used only
# to say where a refused value is; json.loads judges the syntax.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]|[^\s"\[\]{}:,]+')
_CONSTANTS = ("NaN", "Infinity", "-Infinity")


class JSONError(ValueError):
    """A text that is not acceptable JSON; ``field`` is the path of the offending value (``a.b.0``), if known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotJSON(JSONError):
    """Not UTF-8, or not JSON syntax."""


class JSONRefused(JSONError):
    """JSON syntax this server refuses: nested deeper than the limit, or a number that is not finite."""


class _NonFinite(Exception):
    """Raised from json's number hooks; turned into :class:`JSONRefused` once the value is located."""


def _refuse_constant(name: str) -> float:
    raise _NonFinite(name)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


def _is_nonfinite(word: str) -> bool:
    if word in _CONSTANTS:
        return True
    if not any(c in word for c in ".eE"):
        return False  # an integer literal (json makes it an int, never inf)
    try:
        return not math.isfinite(float(word))
    except ValueError:
        return False


def _key(token: str) -> str:
    try:
        return json.loads(token)
    except ValueError:
        return token[1:-1]


def _locate(text: str, max_depth: int | None) -> list[str | int] | None:
    """The path of the first container nested deeper than ``max_depth`` (given), else of the first non-finite
    number; None when there is none. A single pass over the tokens with a stack of (is_object, member,
    expecting_key) frames, so its own depth is not limited by Python's recursion."""
    frames: list[list[Any]] = []
    for match in _TOKEN.finditer(text):
        token = match.group()
        first = token[0]
        if first in "{[":
            if max_depth is not None and len(frames) >= max_depth:
                return [f[1] for f in frames]
            frames.append([first == "{", None if first == "{" else 0, True])
        elif first in "}]":
            if frames:
                frames.pop()
        elif first == ",":
            if frames:
                if frames[-1][0]:
                    frames[-1][2] = True
                else:
                    frames[-1][1] += 1
        elif first == ":":
            if frames:
                frames[-1][2] = False
        elif first == '"':
            if frames and frames[-1][0] and frames[-1][2]:
                frames[-1][1] = _key(token)
        elif max_depth is None and _is_nonfinite(token):
            return [f[1] for f in frames]
    return None


def _dotted(path: list[str | int], most: int = 8) -> str:
    parts = [str(p) for p in path if p is not None]
    return ".".join(parts[:most]) + ("..." if len(parts) > most else "")


def loads(data: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a JSON document, refusing what JSON does not allow and what this server does not take.

    Args:
        data: the document; bytes must be UTF-8 (RFC 8259 §8.1: no UTF-16, no other encoding).
        max_depth: most nested arrays/objects.

    Returns: the parsed value (dict, list, str, int, float, bool or None).

    Raises:
        NotJSON: not UTF-8, or not JSON syntax (the message has json's reason and position).
        JSONRefused: nested deeper than ``max_depth`` (``field``: the top-level member it is in), or a number
            that is NaN, ±Infinity or overflows a float (``field``: its path, e.g. ``scores.acc``).
    """
    if isinstance(data, bytes | bytearray):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise NotJSON(f"not UTF-8 ({exc.reason} at byte {exc.start}); JSON is sent as UTF-8") from None
    else:
        text = data
    # Counting brackets is fast; the token walk runs only when the count allows a deep nesting at all.
    if text.count("[") + text.count("{") > max_depth:
        path = _locate(text, max_depth)
        if path is not None:
            where = _dotted(path)
            raise JSONRefused(f"nested more than {max_depth} levels deep" + (f" (at {where})" if where else ""),
                              path[0] if path and isinstance(path[0], str) else None)
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except _NonFinite as exc:
        path = _locate(text, None) or []
        where = _dotted(path) or None
        raise JSONRefused(f"{where + ': ' if where else ''}{exc.args[0]} is not a finite number (JSON has no NaN "
                          "or Infinity)", where) from None
    except json.JSONDecodeError as exc:
        raise NotJSON(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # the bracket walk was fooled by invalid text; json's own limit caught it
        raise JSONRefused(f"nested more than {max_depth} levels deep") from None
    except ValueError:  # json raises plain ValueError for an integer of more digits than Python converts
        # Python's message advises sys.set_int_max_str_digits(), a server-side call: the client is told the limit.
        raise NotJSON(f"an integer of more than {sys.get_int_max_str_digits():,} digits (the most this server "
                      "reads)") from None


def loads_field(text: str, field: str, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text that a request carries inside one of its fields (a schema sent as text, a tool call's
    arguments), bounded before it is parsed: at most ``max_bytes`` UTF-8 bytes and ``max_depth`` levels.

    The request body itself was parsed with the same depth limit, but a string member can hold any JSON text, and
    ``json.loads`` recurses once per level of it (``RecursionError`` past about 1,000 levels, not ``ValueError``).

    Args:
        text: the JSON text; field: the request field it came from (``structured_outputs.json``), named by errors;
        max_bytes: most UTF-8 bytes of ``text``; max_depth: most nested arrays/objects.

    Returns: the parsed value.

    Raises:
        NotJSON: not JSON syntax (``field`` set); JSONRefused: longer than ``max_bytes``, nested deeper than
            ``max_depth`` or holding a non-finite number (``field`` set; the message names the field and limit).
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise JSONRefused(f"{field} is {size:,} bytes of JSON text, over the {max_bytes:,} bytes it may have", field)
    try:
        return loads(text, max_depth)
    except JSONRefused as exc:
        raise JSONRefused(f"{field}: {exc}", field) from None
    except NotJSON as exc:
        raise NotJSON(f"{field} is text but not JSON: {exc}", field) from None
