"""Issue 22, finding 4 and the Host check of finding 9: idle and slow clients are bounded. A real server process
(the fake engine served exactly as ``dllm-kvq serve`` serves: `tests.support.serve_fake`) and raw sockets:
1,100 idle connections under ``ulimit -n 1024`` leave ``/health`` answering; silent, half-header, partial-body and
kept-alive connections are closed by their timeouts; over the connection cap with every connection in a request,
a newcomer gets a 503; a Host header outside the allow-list is refused."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.processes import free_port
from tests.support.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FLOOD = 1_100
FD_LIMIT = 1024


class Server:
    """``python -m tests.support.serve_fake`` on a free port, optionally under a lower open-file limit."""

    def __init__(self, tmp_path: Path, fd_limit: int | None = None, **env: str) -> None:
        self.port = free_port()
        self.log_path = tmp_path / f"server-{self.port}.log"

        cmd = [sys.executable, "-m", "tests.support.serve_fake"]
        if fd_limit is not None:  # util-linux prlimit: the server's own open-file limit, soft and hard
            if shutil.which("prlimit") is None:
                pytest.skip("prlimit (util-linux) is not installed")
            cmd = ["prlimit", f"--nofile={fd_limit}:{fd_limit}", *cmd]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1", "DLLM_PORT": str(self.port),
                                       "DLLM_STORE_URL": str(tmp_path / "store"), "DLLM_CREATE_STORE": "true", "DLLM_LOG_LEVEL": "warning",
                                       "DLLM_BLOCK_LENGTH": "4", **env})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                httpx.get(self.url + "/health", timeout=1)  # any answer (a Host allow-list may refuse this one)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()  # the caller never gets this object to stop
        pytest.fail(f"the server did not start: {self.log()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def connect(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if send:
        sock.sendall(send)
    return sock


def closed_by_server(sock: socket.socket, timeout_s: float = 30.0) -> bytes | None:
    """What the server sent before closing ``sock`` (None: still open after ``timeout_s``, a failure bound only)."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


@pytest.fixture
def many_fds():
    """This test process opens more than 1,024 sockets: raise its own soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 200:
        pytest.skip(f"the open-file hard limit {hard} is under {FLOOD + 200}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 200), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_health_answers_under_1100_idle_connections_at_ulimit_1024(tmp_path, many_fds):
    # Long timeouts: the cap alone must keep the server answering.
    srv = Server(tmp_path, fd_limit=FD_LIMIT, DLLM_HEADER_TIMEOUT_S="300", DLLM_BODY_TIMEOUT_S="300")
    flood: list[socket.socket] = []
    try:
        kinds = [b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # silent; half a header
                 (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")]  # a partial body
        for i in range(FLOOD):
            flood.append(connect(srv.port, kinds[i % 3]))
        answers = [httpx.get(srv.url + "/health", timeout=30).status_code for _ in range(3)]
        assert answers == [200, 200, 200], srv.log()
        assert srv.open_fds() < FD_LIMIT
        assert "Too many open files" not in srv.log() and "Errno 24" not in srv.log()
    finally:
        for sock in flood:
            sock.close()
        srv.stop()


def test_silent_trickling_partial_and_kept_alive_connections_are_closed(tmp_path):
    srv = Server(tmp_path, DLLM_HEADER_TIMEOUT_S="1", DLLM_BODY_TIMEOUT_S="1", DLLM_KEEP_ALIVE_TIMEOUT_S="1")
    try:
        silent = connect(srv.port)
        trickle = connect(srv.port, b"GET /health HTTP/1.1\r\n")
        partial = connect(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                    b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        kept = connect(srv.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for _ in range(8):  # a byte of header every 0.3 s: each byte used to restart uvicorn's only timer
            time.sleep(0.3)
            try:
                trickle.sendall(b"X")
            except OSError:
                break
        assert closed_by_server(silent) == b""
        assert closed_by_server(trickle) == b""
        assert closed_by_server(partial) is not None
        answered = closed_by_server(kept)
        assert answered is not None and answered.startswith(b"HTTP/1.1 200")  # answered, then closed when idle
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_over_the_cap_with_every_connection_in_a_request_a_newcomer_gets_503(tmp_path):
    srv = Server(tmp_path, DLLM_MAX_CONNECTIONS="4", DLLM_BODY_TIMEOUT_S="300")
    busy = []
    try:
        for _ in range(4):  # each in a request: its head arrived, its body has not
            busy.append(connect(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                          b"application/json\r\nContent-Length: 1000\r\n\r\n{"))
        # The four may not all be registered yet on a loaded machine: ask again until the cap answers (a hang guard).
        def refused() -> bytes | None:
            got = closed_by_server(connect(srv.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
            return got if got is not None and got.startswith(b"HTTP/1.1 503") else None

        answer = until(refused, "a newcomer over the cap gets 503")
        assert b"too_many_connections" in answer and b"retry-after" in answer.lower()
        for sock in busy:
            sock.close()
        until(lambda: httpx.get(srv.url + "/health").status_code == 200, "health answers once the busy ones left")
    finally:
        for sock in busy:
            sock.close()
        srv.stop()


def test_a_host_header_outside_the_allow_list_is_refused(tmp_path):
    srv = Server(tmp_path)  # a loopback bind: the loopback names only (a DNS-rebinding page uses its own name)
    try:
        for host in ("localhost", f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", f"[::1]:{srv.port}"):
            assert httpx.get(srv.url + "/health", headers={"Host": host}).status_code == 200, host
        r = httpx.get(srv.url + "/v1/models", headers={"Host": "rebind.attacker.example"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", r.text
    finally:
        srv.stop()
    named = Server(tmp_path, DLLM_ALLOWED_HOSTS="llm.example.com,*.internal.example")
    try:
        assert httpx.get(named.url + "/health", headers={"Host": "llm.example.com"}).status_code == 200
        assert httpx.get(named.url + "/health", headers={"Host": "a.internal.example:8000"}).status_code == 200
        assert httpx.get(named.url + "/health", headers={"Host": "127.0.0.1"}).status_code == 400
    finally:
        named.stop()


def test_an_unhandled_error_answers_500_and_keeps_the_connection(tmp_path):
    import http.client

    srv = Server(tmp_path, FAKE_UNHANDLED_ROUTE="1")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/test/unhandled")
        first = conn.getresponse()
        body = first.read()
        sock = conn.sock
        assert first.status == 500 and b'"internal_error"' in body and b"a bug" not in body, body
        assert sock is not None  # not closed by the server (http.client drops a socket the answer closes)
        conn.request("GET", "/health")
        second = conn.getresponse()
        assert second.status == 200 and conn.sock is sock
        second.read()
        conn.close()
        assert "a bug no handler maps" in srv.log()  # logged for the operator
    finally:
        srv.stop()


def _requests_total(srv: Server) -> dict[tuple[str, str], float]:
    """``dllm_requests_total`` by (endpoint, status), from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics").text
    return {(s.labels["endpoint"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "dllm_requests_total"}


def test_a_stalled_body_is_a_408_and_an_oversized_one_a_413_under_their_route(tmp_path):
    """A body that stops arriving was cut after the timeout but counted as ``endpoint="other",status="500"``, which
    feeds the 5xx alert (deploy/prometheus/alerts.yml); a 413 was counted under "other" too."""
    srv = Server(tmp_path, DLLM_BODY_TIMEOUT_S="1", DLLM_MAX_BODY_BYTES="1000")
    try:
        stalled = connect(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                    b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        answer = closed_by_server(stalled)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        big = httpx.post(srv.url + "/generate", content=b"x" * 2000, headers={"content-type": "application/json"})
        assert big.status_code == 413, big.text
        counted = until(lambda: (c := _requests_total(srv)).get(("/v1/completions", "408")) and c,
                        "the stalled request is counted", timeout_s=5)
        assert counted.get(("/generate", "413")) == 1, counted
        assert not any(status.startswith("5") or endpoint == "other" for endpoint, status in counted), counted
    finally:
        srv.stop()
