"""The published API is the served API (issue 13): schemathesis, stateless and with bounded examples, against a
real ``python -m service serve`` process on the embedded model, without and with the admin key.

Every check runs, ``positive_data_acceptance`` included (a schema-valid request must be answered 2xx, 3xx, 401,
403, 404, 409, 429 or 5xx, schemathesis' default; never 400 or 422), and each must report 0 failures. The
document states every rule JSON Schema can express (`service.api.rules`, `service.api.openapi`); the few it cannot
are restated by the hook module `tests.api.schemathesis_hooks`, which drops the positive cases that break them,
and only those:

* ``context``: prompt tokens + ``max_tokens`` rounded up to whole blocks <= the model's context (tokens, not
  characters: a text's length in tokens is the tokenizer's);
* ``schedule``: ``steps`` a multiple of the number of blocks, at most the response positions;
* ``work``: forward calls x tokens <= ``DLLM_MAX_REQUEST_WORK`` (set low here, so that no accepted request runs
  for more than a second or two on one CPU thread; a call is charged at least 256 tokens);
* ``activation``: ``PUT /admin/active/none`` with a quantizing method (a path parameter against the body);
* ``upload``: an uploaded artifact's content (safetensors bytes, a policy fitted to the loaded model).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_KEY = "schemathesis-admin-key-0123"
# Token-forwards one request may cost: ~1.5 s of decoding the embedded model on one CPU thread; the least that
# admits the default request (64 calls, each charged at least FORWARD_FLOOR_TOKENS: 64 x 256).
MAX_WORK = 16_384
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("st")
    env = {"DLLM_THREADS": "1", "DLLM_STORE_URL": str(workdir / "store"), "DLLM_ADMIN_KEY": ADMIN_KEY,
           "DLLM_MAX_REQUEST_WORK": str(MAX_WORK)}
    proc = ServerProcess(env, log_path=workdir / "server.log").start()
    # What the hooks restate the rules from: the server's own settings and context.
    settings = Settings(**{k.removeprefix("DLLM_").lower(): v for k, v in env.items()})
    context = httpx.get(proc.url + "/v1/models").json()["data"][0]["max_model_len"]
    proc.facts = {"url": proc.url, "context": context, "max_tokens": settings.default_max_tokens,
                  "block_length": settings.block_length, "steps": settings.steps,
                  "max_work": settings.max_request_work, "mc_num": settings.likelihood_mc_num,
                  "mc_batch_size": settings.likelihood_mc_batch_size, "mask_text": _mask_text(proc.url)}
    yield proc
    proc.stop()


def _mask_text(url: str) -> str:
    """The text of the served model's mask token (the embedded checkpoint's tokenizer; its id from the server)."""
    from service.engine.loading import load_tokenizer

    mask_id = httpx.get(url + "/tokenizer_info").json()["mask_token_id"]
    return load_tokenizer(ROOT / "service" / "assets" / "embedded").convert_ids_to_tokens(mask_id)


def _st() -> str:
    path = shutil.which("st", path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip("schemathesis is not installed (pip install -e .[test])")
    return path


@pytest.mark.parametrize("auth", [False, True], ids=["no-key", "admin-key"])
def test_schemathesis_finds_no_failure(server, tmp_path, auth):
    # One worker: hypothesis parses source in every worker thread to describe its filters, and CPython 3.11's
    # ast.parse is not thread-safe ("SystemError: AST constructor recursion depth mismatch", python/cpython#106905).
    # 30 examples per operation: about 25 accepted generation requests per generation route.
    cmd = [_st(), "run", server.url + "/openapi.json", "--checks", "all",
           "--phases", "examples,coverage,fuzzing", "-n", "30", "--no-shrink", "-w", "1", "--seed", "13",
           "--continue-on-failure", "--request-timeout", "10", "--report-dir", str(tmp_path)]
    if auth:
        cmd += ["-H", f"Authorization: Bearer {ADMIN_KEY}", "--include-path-regex", "^/admin"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.api.schemathesis_hooks",
           "DLLM_ST_SERVER": json.dumps(server.facts)}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout[-6000:] + server.log()
    assert re.search(r"(\d+) generated, \1 passed", run.stdout), run.stdout[-3000:]  # every case passed
