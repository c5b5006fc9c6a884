"""The structured-output validity cases (``tests/data/structured/cases.json``: 50 JSON schemas, regexes and
choices, and the 4 prompts each is decoded with) and the check that an output satisfies its case."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema

from service.engine.grammar import GrammarSpec

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "structured" / "cases.json").read_text())
CASES: list[dict[str, Any]] = DATA["cases"]
PROMPTS: list[str] = DATA["prompts"]


def spec_of(case: dict[str, Any]) -> GrammarSpec:
    """The engine's grammar spec of a case."""
    if case["kind"] == "json_schema":
        return GrammarSpec.json_schema(case["schema"], "structured_outputs.json")
    if case["kind"] == "regex":
        return GrammarSpec.regex(case["regex"], "structured_outputs.regex")
    return GrammarSpec.choice(case["choice"], "structured_outputs.choice")


def request_fields(case: dict[str, Any]) -> dict[str, Any]:
    """The case as vLLM's ``structured_outputs`` request field."""
    key = {"json_schema": "json", "regex": "regex", "choice": "choice"}[case["kind"]]
    return {"structured_outputs": {key: case[{"json": "schema"}.get(key, key)]}}


def violation(case: dict[str, Any], text: str) -> str | None:
    """Why ``text`` does not satisfy the case (None when it does): JSON that does not parse or validate
    (jsonschema), a regex not matched in full, a string not among the choices."""
    if case["kind"] == "regex":
        return None if re.fullmatch(case["regex"], text) else f"{text!r} does not match {case['regex']!r}"
    if case["kind"] == "choice":
        return None if text in case["choice"] else f"{text!r} is not one of {case['choice']}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"{text!r} is not JSON: {exc}"
    try:
        jsonschema.validate(value, case["schema"])
    except jsonschema.ValidationError as exc:
        return f"{text!r} does not validate: {exc.message}"
    return None
