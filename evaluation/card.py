"""Put the matrix into a model card: ``quantization.json`` beside the weights, and the card's Quantization section.

``dllm-kvq evaluate matrix ... --card DIR`` (one model) writes ``DIR/quantization.json``: per table (``--table``
main, 3, kv) the markdown exactly as the tool rendered it, the command, the slice and the host, with the
fingerprint of the weights they were measured on, and splices them into ``DIR/README.md`` under
``## Quantization``. The
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
#: ``--table`` -> (subsection heading, what it shows), in card order.
TABLES = {
    "main": ("", ""),
    "3": ("### K-policy controls (Table 3)",
          "Is a fixed, layer-independent K rule as good as the fitted per-layer policy?"),
    "kv": ("### K-only and V-only quantization",
           "Where does the loss come from: quantizing K, or V?"),
}


def _entry_markdown(table: str, entry: dict[str, Any]) -> str:
    heading, question = TABLES[table]
    head = f"{heading}\n\n{question} " if heading else ""
    return (f"{head}Measured with `{entry['command']}` ({entry['documents']} documents per task, on "
            f"{entry['host']}).\n\n{entry['markdown'].rstrip()}\n")


def card_section(data: dict[str, Any]) -> str:
    """The card's Quantization section (heading included) from a ``quantization.json`` dict: the main matrix, then
    Table 3 and the K/V ablation when they were measured (``tables``; a file from before holds the main one flat)."""
    tables = data.get("tables") or {"main": data}
    parts = [(f"{SECTION}\n\nOn the weights with fingerprint `{data['fingerprint'][:16]}...`; the dLLM-KVQ policies "
             "and KVQuant states are the newest fitted on these weights in the store (`.venv/bin/dllm-kvq calibrate all "
             "--store <store>`). Written by the tool (`evaluation/card.py`); after retraining, run the calibration "
             "and then the same commands again.\n")]
    parts += [_entry_markdown(name, tables[name]) for name in TABLES if name in tables]
    return "\n".join(parts)


def write_card(directory: str | Path, *, markdown: str, fingerprint: str, command: str, documents: int | None,
               host: str, table: str = "main") -> Path:
    """Record one table (``table``: a key of `TABLES`) in ``quantization.json`` and splice `card_section` into
    ``README.md`` (appended when it has no such section); returns the JSON path. Tables measured on other weights
    are dropped. Nothing in the card depends on when or how fast it ran (no wall time: the run's own
    ``matrix.json`` has it), so the same results write the same files and a rerun leaves git clean.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model card folder {directory} does not exist")
    path = directory / CARD_FILE
    old = json.loads(path.read_text()) if path.exists() else {}
    tables = (old.get("tables") or {"main": old}) if old.get("fingerprint") == fingerprint else {}
    tables[table] = {"command": command, "documents": documents if documents else "all", "host": host,
                     "markdown": markdown}
    main = tables.get("main", {})
    data = {"fingerprint": fingerprint, "command": main.get("command", command), "tables": tables}
    path.write_text(json.dumps(data, indent=1) + "\n")
    readme = directory / "README.md"
    text = readme.read_text() if readme.exists() else ""
    section = card_section(data)
    # The section runs from its heading to the next level-2 heading (or the end).
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        # A blank line before the next section; none added at the end of the file (a rewrite is byte-identical).
        text = pattern.sub(lambda m: section + ("\n" if m.end() < len(text) else ""), text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    readme.write_text(text)
    return path
