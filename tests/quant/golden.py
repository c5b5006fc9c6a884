"""Loading the trimmed golden vectors of tests/data/quant (see its README.md)."""

import json

from safetensors.torch import load_file

from tests.support.paths import DATA as _DATA

DATA = _DATA / "quant"
CASES = json.loads((DATA / "index.json").read_text())["cases"]


def cases(prefix: str) -> list[dict]:
    return [c for c in CASES if c["name"].startswith(prefix)]


def load(case: dict) -> dict:
    return load_file(DATA / case["file"])
