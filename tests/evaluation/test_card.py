"""The matrix table in a model card: written by the tool, spliced into the card, shown only for its weights."""

import importlib.util
import json
import shutil

from evaluation.card import CARD_FILE, write_card
from service.engine.loading import read_checkpoint_tensors, weights_fingerprint
from tests.support.fastdllm import CKPT, REPO_ROOT

TABLE = "### m — 4-bit KV\n\n| Method | t |\n|---|---:|\n| KIVI (4-bit) | 50.00 |\n"


def _write(folder, fingerprint="f" * 64):
    return write_card(folder, markdown=TABLE, fingerprint=fingerprint, command="python -m evaluation matrix --x",
                      documents=8, host="x86_64 CPU")


def test_section_replaces_only_the_quantization_section(tmp_path):
    (tmp_path / "README.md").write_text("# card\n\n## Quantization\n\nold text\n\n## Reproduce\n\nsteps\n")
    _write(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "old text" not in text and text.startswith("# card\n\n## Quantization\n\nOn the weights with")
    assert "| KIVI (4-bit) | 50.00 |" in text and text.endswith("## Reproduce\n\nsteps\n")
    assert "(8 documents per task, on x86_64 CPU)" in text and "wall" not in text
    _write(tmp_path)  # idempotent
    assert (tmp_path / "README.md").read_text() == text
    assert json.loads((tmp_path / CARD_FILE).read_text())["tables"]["main"]["markdown"] == TABLE


def test_section_is_appended_when_the_card_has_none(tmp_path):
    (tmp_path / "README.md").write_text("# card\n")
    _write(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# card\n\n## Quantization\n")
    _write(tmp_path)  # idempotent at the end of the file too
    assert (tmp_path / "README.md").read_text() == text


def test_card_generator_shows_the_table_only_for_the_weights_it_was_measured_on(tmp_path):
    spec = importlib.util.spec_from_file_location("embedded_card", REPO_ROOT / "scripts" / "embedded_card.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path / "model"
    shutil.copytree(CKPT["llada"], folder)
    _write(folder, weights_fingerprint(read_checkpoint_tensors(folder)))
    assert "| KIVI (4-bit) | 50.00 |" in module.quantization_section(folder)
    _write(folder, "0" * 64)  # measured on other (older) weights
    stale = module.quantization_section(folder)
    assert "KIVI" not in stale and "`python -m evaluation matrix --x`" in stale
