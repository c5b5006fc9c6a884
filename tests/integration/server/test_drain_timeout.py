"""``python -m service serve`` on SIGTERM when a request outlasts the drain timeout: the worker's drain ends first
and answers it with an OpenAI-style 503, before uvicorn's own graceful timeout could cut it with a plain-text 500."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_request_cut_by_the_drain_timeout_gets_a_json_503(tmp_path):
    srv = ServerProcess({"DLLM_STORE_URL": str(tmp_path / "store"), "DLLM_DRAIN_TIMEOUT_S": "1",
                         "DLLM_THREADS": "1"}, log_path=tmp_path / "server.log").start()
    box = {}
    # No cache, every block, a long response: many seconds on this CPU, far beyond the 1 s drain.
    long = {"model": "embedded", "prompt": "next: 1", "max_tokens": 2048, "ignore_eos": True, "cache_mode": "none"}
    worker = threading.Thread(target=lambda: box.setdefault("r", httpx.post(srv.url + "/v1/completions", json=long,
                                                                           timeout=60)))
    try:
        worker.start()
        time.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        worker.join(timeout=30)
        r = box["r"]
        assert r.status_code == 503, (r.status_code, r.text, srv.log())
        error = r.json()["error"]
        assert error["type"] == "service_unavailable_error" and "drain timeout" in error["message"]
        assert srv.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()
