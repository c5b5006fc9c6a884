"""Every ``from_pretrained(...)`` the repository runs or shows a user passes ``trust_remote_code=False``
(docs/engine.md: tokenizers are always loaded so). Without it the embedded checkpoint, whose config names remote
code in ``auto_map`` that it does not ship, makes transformers stop and ask "Do you wish to run the custom code?
[y/N]" in a terminal: the docs/api.md client example did."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["README.md", "docs/*.md", "examples/*.py", "benchmarks/*.py", "scripts/*.py", "service/**/*.py",
           "calibration/**/*.py", "evaluation/**/*.py"]


def _calls(text: str):
    """The argument text of each ``from_pretrained(`` call (up to its matching parenthesis)."""
    for match in re.finditer(r"from_pretrained\(", text):
        depth, i = 1, match.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text[match.end():i - 1]


def test_every_from_pretrained_call_refuses_remote_code():
    files = sorted({p for pattern in SOURCES for p in ROOT.glob(pattern)})
    calls = [(p.relative_to(ROOT), args) for p in files for args in _calls(p.read_text(encoding="utf-8"))]
    assert calls, "no from_pretrained call found: the globs are wrong"
    offenders = [f"{path}: from_pretrained({args})" for path, args in calls
                 if not re.search(r"\btrust_remote_code\s*=\s*False\b", args)]
    assert not offenders, "\n".join(offenders)
