"""``examples/ask.py`` and ``examples/kv_metrics.py`` take the same thing, the server's root URL (docs/quickstart.md step 8),
and a server that is not running or answers with an error is one line on stderr with exit status 2, not a
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import pytest

from tests.support.paths import REPO
from tests.support.processes import free_port

pytestmark = pytest.mark.integration  # every test runs an example script as a process

EXAMPLES = ("ask.py", "kv_metrics.py")


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"examples/{script}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("script", EXAMPLES)
def test_a_server_that_is_not_running_is_one_line(script):
    url = f"http://127.0.0.1:{free_port()}"
    done = _run(script, "--url", url)
    assert done.returncode == 2, done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: cannot reach the server at {url}/ (") and "Connection refused" in line
    assert line.endswith("start it (.venv/bin/dllm-kvq serve) or give its root URL with --url or DLLM_SERVER_URL")


class _Record(BaseHTTPRequestHandler):
    """Answers 404 to everything and notes the paths asked for."""

    paths: ClassVar[list[str]] = []

    def _answer(self):
        self.paths.append(self.path)
        self.send_response(404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_both_take_the_root_url_and_an_error_answer_is_one_line(how):
    server = HTTPServer(("127.0.0.1", 0), _Record)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_port}"
    try:
        for script, path in zip(EXAMPLES, ("/v1/chat/completions", "/metrics"), strict=True):
            _Record.paths.clear()
            done = (_run(script, "--url", root) if how == "flag" else _run(script, env={"DLLM_SERVER_URL": root}))
            assert _Record.paths == [path]  # ask.py adds /v1 itself
            assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
            assert done.stderr.startswith(f"error: {root}{path} answered 404")
    finally:
        server.shutdown()


@pytest.mark.integration
def test_the_documented_examples_run_without_a_warning(tmp_path):
    """The quickstart's ask.py and kv_metrics.py against a real server print no warning (ask.py used to print a
    transformers model-type warning, from loading the tokenizer with AutoTokenizer): Python warnings are errors here,
    and neither stream may carry a warning from a library's logger."""
    from tests.support.processes import ServerProcess

    srv = ServerProcess({"DLLM_STORE_URL": str(tmp_path / "store"), "DLLM_THREADS": "1"},
                        log_path=tmp_path / "server.log").start(timeout_s=180)
    try:
        for script, args in (("ask.py", ("--questions", "1")), ("kv_metrics.py", ())):
            done = _run(script, "--url", srv.url, *args, env={"PYTHONWARNINGS": "error"})
            assert done.returncode == 0, done.stderr[-3000:]
            assert done.stderr == "", done.stderr[-3000:]
            assert "warn" not in done.stdout.lower() and "[transformers]" not in done.stdout, done.stdout[-3000:]
    finally:
        srv.stop()
