"""`service.strict_json`: what JSON does not allow (NaN, Infinity, overflowing floats, other encodings) and nesting
past the limit are refused with the path of the offending value; everything else parses as `json` parses it."""

from __future__ import annotations

import json

import pytest

from service.strict_json import MAX_DEPTH, JSONRefused, NotJSON, loads


@pytest.mark.parametrize("text", ['{"a": [1, 2.5, -3e2, "NaN", "x\\"y"], "b": {"c": null, "d": true}}', "[]", '"s"',
                                  "1e308", '{"Infinity": -0.0}'])
def test_json_parses_as_json_does(text):
    assert loads(text.encode()) == json.loads(text)


@pytest.mark.parametrize(("text", "path"), [
    ('{"scores": {"acc": NaN}}', "scores.acc"),
    ('{"a": [1, 2, Infinity]}', "a.2"),
    ('{"s": "NaN [[", "v": -Infinity}', "v"),
    ('{"x": 1e400}', "x"),
    ('[{"a": 1}, {"b": [0, -1E+999]}]', "1.b.1"),
])
def test_a_non_finite_number_is_refused_by_path(text, path):
    with pytest.raises(JSONRefused) as exc:
        loads(text.encode())
    assert exc.value.field == path and str(exc.value).startswith(f"{path}: ")


def test_nesting_is_bounded_and_located_without_recursion():
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(ok) is not None
    with pytest.raises(JSONRefused, match=f"nested more than {MAX_DEPTH} levels") as exc:
        loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert exc.value.field is None
    with pytest.raises(JSONRefused) as exc:
        loads('{"prompt": "c", "kv_quant": ' + '{"a":' * 100_000 + "1" + "}" * 100_000 + "}")
    assert exc.value.field == "kv_quant"


@pytest.mark.parametrize(("data", "says"), [
    (b'{"a": "\xff"}', "not UTF-8"),
    ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
    (b'{"a": 1,}', "line 1 column 9"),
    (b"", "Expecting value"),
    (b'{"n": ' + b"1" * 5000 + b"}", "digits"),
])
def test_not_json_says_why(data, says):
    with pytest.raises(NotJSON, match=says):
        loads(data)


def test_an_integer_too_long_to_read_says_so_in_the_clients_terms():
    """Python's own message tells a server operator to call ``sys.set_int_max_str_digits()``: no advice for a
    client, who is told the limit instead."""
    with pytest.raises(NotJSON) as exc:
        loads(b'{"n": ' + b"1" * 5000 + b"}")
    assert "sys." not in str(exc.value) and "4,300 digits" in str(exc.value)
