"""``scripts/setup.sh`` ends by saying what to run next: the README's first command's server, and the tests.

The script itself pip-installs (network), so it runs in CI through ``scripts/test.sh``; here its closing message is
run on its own, as bash prints it."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.paths import REPO


@pytest.mark.integration
def test_setup_ends_with_the_command_to_run():
    text = (REPO / "scripts" / "setup.sh").read_text()
    closing = text[text.rindex("\ncat <<'NEXT'"):]
    printed = subprocess.run(["bash", "-c", closing], capture_output=True, text=True, check=True).stdout
    assert "  .venv/bin/dllm-kvq serve\n" in printed and "bash scripts/test.sh" in printed
    assert "bash scripts/setup.sh && .venv/bin/dllm-kvq serve" in (REPO / "README.md").read_text()
    assert text.rstrip().endswith("NEXT"), "the message is the script's last output"
