"""Loading the trimmed golden vectors of tests/data/quant (see its README.md)."""

import json
from pathlib import Path

from safetensors.torch import load_file

DATA = Path(__file__).resolve().parents[2] / "data" / "quant"
CASES = json.loads((DATA / "index.json").read_text())["cases"]


def cases(prefix: str) -> list[dict]:
    return [c for c in CASES if c["name"].startswith(prefix)]


def load(case: dict) -> dict:
    return load_file(DATA / case["file"])
