"""``python -m service serve`` on SIGTERM: a clean drain exits 0; when a request outlasts the drain timeout, the
worker's drain ends first and answers it with an OpenAI-style 503 (before uvicorn's own graceful timeout could cut
it with a plain-text 500) and the process exits 1."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.support.metrics import metric_sum, metrics
from tests.support.processes import ServerProcess
from tests.support.waiting import until

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
        until(lambda: metric_sum(metrics(srv.url), "dllm_requests_running") == 1, "the long request running")
        srv.proc.send_signal(signal.SIGTERM)
        worker.join(timeout=60)
        r = box["r"]
        assert r.status_code == 503, (r.status_code, r.text, srv.log())
        error = r.json()["error"]
        assert error["type"] == "service_unavailable_error" and "drain timeout" in error["message"]
        assert srv.proc.wait(timeout=30) == 1  # the drain cut an admitted request: not a clean stop
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()


def test_a_clean_drain_exits_0(tmp_path):
    srv = ServerProcess({"DLLM_STORE_URL": str(tmp_path / "store"), "DLLM_THREADS": "1"},
                        log_path=tmp_path / "server.log").start()
    box = {}
    request = {"model": "embedded", "prompt": "next: 1 2 3", "max_tokens": 64, "ignore_eos": True}
    worker = threading.Thread(target=lambda: box.setdefault("r", httpx.post(srv.url + "/v1/completions",
                                                                           json=request, timeout=60)))
    try:
        worker.start()
        # SIGTERM once the request is admitted (or, on a fast machine, already answered), never before it arrived.
        until(lambda: "r" in box or metric_sum(metrics(srv.url), "dllm_requests_running") == 1,
              "the request admitted")
        srv.proc.send_signal(signal.SIGTERM)
        worker.join(timeout=60)
        assert box["r"].status_code == 200, (box["r"].text, srv.log())
        # uvicorn raises the captured SIGTERM again after its shutdown; a clean stop is still status 0, not 143.
        assert srv.proc.wait(timeout=30) == 0, srv.log()
    finally:
        srv.stop()
