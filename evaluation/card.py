"""Put the matrix into a model card: ``quantization.json`` beside the weights, and the card's Quantization section.

``python -m evaluation matrix ... --card DIR`` (one model) writes ``DIR/quantization.json``: the matrix tables as
markdown exactly as the tool rendered them, the fingerprint of the weights they were measured on, the command, the
slice and the time it took, and splices the same section into ``DIR/README.md`` under ``## Quantization``. The
card generator (``scripts/embedded_card.py``) reads ``quantization.json`` too and prints the table only while the
fingerprint matches the weights in ``DIR``; after retraining it says how to regenerate it instead. No number in
the section is typed by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CARD_FILE = "quantization.json"
SECTION = "## Quantization"


def card_section(data: dict[str, Any]) -> str:
    """The card's Quantization section (heading included) from a ``quantization.json`` dict."""
    return (
        f"{SECTION}\n\n"
        f"Measured with `{data['command']}` ({data['documents']} documents per task, "
        f"{data['wall_seconds'] / 60:.1f} min wall time on {data['host']}), on the weights with fingerprint "
        f"`{data['fingerprint'][:16]}...`; the dLLM-KVQ policies and KVQuant states are the newest fitted on these "
        f"weights in the store (`python -m calibration all --store <store>`). Written by the tool "
        f"(`evaluation/card.py`); after retraining, run the calibration and then the same command again.\n\n"
        f"{data['markdown'].rstrip()}\n"
    )


def write_card(directory: str | Path, *, markdown: str, fingerprint: str, command: str, documents: int | None,
               wall_seconds: float, host: str) -> Path:
    """Write ``quantization.json`` and splice `card_section` into ``README.md`` (appended when it has no such
    section); returns the JSON path.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model card folder {directory} does not exist")
    data = {"fingerprint": fingerprint, "command": command, "documents": documents if documents else "all",
            "wall_seconds": wall_seconds, "host": host, "markdown": markdown}
    path = directory / CARD_FILE
    path.write_text(json.dumps(data, indent=1) + "\n")
    readme = directory / "README.md"
    text = readme.read_text() if readme.exists() else ""
    section = card_section(data)
    # The section runs from its heading to the next level-2 heading (or the end).
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    readme.write_text(text)
    return path
