"""The published API is the served API (issue 13): schemathesis, stateless and with bounded examples, against a
real ``python -m service serve`` process on the embedded model, without and with the admin key.

Every check runs except ``positive_data_acceptance`` (a schema-valid request must be accepted), which still
finds rules the document does not state yet (see the exclusion below); all others must report 0 failures.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_KEY = "schemathesis-admin-key-0123"
# Rules a schema-valid request can still break (cross-field or runtime: prompt + max_tokens over the context,
# steps a multiple of the blocks, token ids past the vocabulary, unhonoured OpenAI values such as top_p != 1,
# exactly one of prompt/messages in /tokenize): issue 13 item 5, left open.
NOT_YET = "positive_data_acceptance"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("st")
    proc = ServerProcess({"DLLM_THREADS": "1", "DLLM_STORE_URL": str(workdir / "store"),
                          "DLLM_ADMIN_KEY": ADMIN_KEY, "DLLM_MAX_REQUEST_WORK": "2000000"},
                         log_path=workdir / "server.log").start()
    yield proc
    proc.stop()


def _st() -> str:
    path = shutil.which("st", path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip("schemathesis is not installed (pip install -e .[test])")
    return path


@pytest.mark.parametrize("auth", [False, True], ids=["no-key", "admin-key"])
def test_schemathesis_finds_no_failure(server, tmp_path, auth):
    cmd = [_st(), "run", server.url + "/openapi.json", "--checks", "all", "--exclude-checks", NOT_YET,
           "--phases", "examples,coverage,fuzzing", "-n", "10", "--no-shrink", "-w", "2", "--seed", "13",
           "--continue-on-failure", "--request-timeout", "10", "--report-dir", str(tmp_path)]
    if auth:
        cmd += ["-H", f"Authorization: Bearer {ADMIN_KEY}", "--include-path-regex", "^/admin"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + server.log()
    assert re.search(r"(\d+) generated, \1 passed", run.stdout), run.stdout[-3000:]  # every case passed
