"""Issue 22, findings 2 and 3, with a real redis-server started with ``requirepass``: the password never leaves
(every output path is scanned: HTTP bodies and headers of every route a client or an operator reaches, the server
log, ``/metrics``, the commands' stderr), and credentials the store refuses are a start-up error in one line (or,
when they stop working later, not ready with the reason), never a quiet default. A stored entry that cannot be
read while the store answers makes its cache mode not ready, without echoing the stored bytes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from service.quant.config import KVQuantConfig
from service.store.redis_store import RedisStore
from tests.support.apps import ADMIN_KEY
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine
from tests.support.metrics import metric_sum, metrics
from tests.support.processes import ServerProcess, free_port, wait_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FACTORY = "tests.support.apps:fake_app_from_env"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = FakeEngine().spec
ROOT = Path(__file__).resolve().parents[2]
DUAL = {"method": "kivi", "bits": 2}


class PasswordRedis:
    """A private redis-server with ``requirepass`` (no persistence) that a test may stop and start again."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.password = f"pw-{uuid.uuid4().hex}"
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def url(self, password: str | None = None) -> str:
        return f"redis://:{password or self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> PasswordRedis:
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir), "--requirepass",
                                      self.password], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def protected(tmp_path):
    server = PasswordRedis(tmp_path).start()
    yield server
    server.stop()


def replica(tmp_path: Path, url: str, name: str, ready: bool = True) -> ServerProcess:
    return ServerProcess({"DLLM_STORE_URL": url, "DLLM_ADMIN_KEY": ADMIN_KEY, "DLLM_BLOCK_LENGTH": "4",
                          "DLLM_STORE_CHECK_INTERVAL_S": "0.5"}, FACTORY,
                         log_path=tmp_path / f"{name}.log").start(ready=ready)


def wait_for(condition, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"not within {timeout_s} s: {what}")


def command(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "service", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, check=False)


def everything_a_client_sees(srv: ServerProcess) -> str:
    """Bodies and headers of every route family, while the store is away: admin (503s), health, metrics,
    serving, the OpenAPI document."""
    seen = []
    calls = [("GET", "/admin/active", None), ("GET", "/admin/audit", None), ("GET", "/admin/policies", None),
             ("PUT", "/admin/active/dual", DUAL), ("POST", "/admin/policies", None),
             ("DELETE", "/admin/policies/x1", None), ("GET", "/health", None), ("GET", "/health/ready", None),
             ("GET", "/metrics", None), ("GET", "/v1/models", None), ("GET", "/openapi.json", None),
             ("POST", "/v1/completions", {"model": "fake-llada", "prompt": "ab", "max_tokens": 4}),
             ("POST", "/v1/completions", {"model": "fake-llada", "prompt": "ab", "max_tokens": 4,
                                          "kv_quant": {"method": "dllm_kvq", "bits": 4, "policy_id": "p-absent"}})]
    for method, path, body in calls:
        if method == "POST" and path == "/admin/policies":
            r = httpx.post(srv.url + path, content=policy_for(SPEC).to_json(), headers=ADMIN, timeout=30)
        else:
            r = httpx.request(method, srv.url + path, json=body, headers=ADMIN, timeout=30)
        seen.append(f"{method} {path} -> {r.status_code} {dict(r.headers)} {r.text}")
    return "\n".join(seen)


def test_the_password_leaves_through_no_output(tmp_path, protected):
    srv = replica(tmp_path, protected.url(), "secret")
    try:
        assert httpx.post(srv.url + "/admin/policies", content=policy_for(SPEC).to_json(),
                          headers=ADMIN).status_code == 201
        assert httpx.put(srv.url + "/admin/active/dual", json=DUAL, headers=ADMIN).status_code == 200
        protected.stop()  # every store error path now runs: ping, events, admin calls, artifact loads
        wait_for(lambda: metric_sum(metrics(srv.url), "dllm_store_up") == 0, what="dllm_store_up 0")
        seen = everything_a_client_sees(srv)
        assert "503" in seen and "store_unavailable" in seen and "redis://:***@127.0.0.1" in seen
        time.sleep(1.5)  # the events listener and the monitor log their retries
    finally:
        srv.stop()
    outputs = {"http": seen, "server log": srv.log_path.read_text()}
    # The commands, against the stopped store and with the password in a mistyped scheme.
    export = command("policies", "export", str(tmp_path / "out"), "--store", protected.url())
    assert export.returncode == 1 and "redis://:***@127.0.0.1" in export.stderr, export.stderr
    typo = command("policies", "export", str(tmp_path / "out"), "--store",
                   protected.url().replace("redis://", "redis:/"))
    assert typo.returncode == 2 and "unknown scheme" in typo.stderr, typo.stderr
    from_env = command("policies", "export", str(tmp_path / "out"), env={"DLLM_STORE_URL": protected.url()})
    assert from_env.returncode == 1, from_env.stderr
    outputs |= {"policies export": export.stdout + export.stderr, "typo": typo.stdout + typo.stderr,
                "from env": from_env.stdout + from_env.stderr}
    assert "store unreachable" in outputs["server log"]  # the log did say what happened
    for where, text in outputs.items():
        assert protected.password not in text, f"the password leaked through {where}"


def test_a_wrong_password_is_a_start_up_error_in_one_line(tmp_path, protected):
    # The store holds dual = kivi 2-bit: a replica that cannot read it must not serve its default instead.
    RedisStore(protected.url()).set_active(SPEC, "dual", KVQuantConfig(**DUAL))
    wrong = f"wrong-{uuid.uuid4().hex}"
    served = command("serve", "--store-url", protected.url(wrong), "--port", str(free_port()))
    assert served.returncode == 3, served.stderr
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1 and "DLLM_STORE_URL" in lines[0] and "refused the credentials" in lines[0], lines
    assert wrong not in served.stderr and protected.password not in served.stderr
    # The app factory on its own (uvicorn --factory) does not start either.
    srv = ServerProcess({"DLLM_STORE_URL": protected.url(wrong), "DLLM_ADMIN_KEY": ADMIN_KEY}, FACTORY,
                        log_path=tmp_path / "factory.log")
    with pytest.raises(RuntimeError, match="exited"):
        srv.start(timeout_s=60, ready=False)
    log = srv.log_path.read_text()
    assert "refused the credentials" in log and wrong not in log


def test_credentials_refused_later_make_the_server_not_ready_with_the_reason(tmp_path, protected):
    RedisStore(protected.url()).set_active(SPEC, "dual", KVQuantConfig(**DUAL))
    srv = replica(tmp_path, protected.url(), "revoked")
    try:
        assert httpx.get(srv.url + "/health/ready").status_code == 200
        admin = redis.Redis.from_url(protected.url())
        admin.config_set("requirepass", "rotated-" + uuid.uuid4().hex)
        admin.client_kill_filter(_type="normal", skipme=True)  # the server's connections must log in again
        wait_for(lambda: httpx.get(srv.url + "/health/ready").status_code == 503, what="not ready")
        r = httpx.get(srv.url + "/health/ready")
        assert "refused the credentials" in r.json()["error"]["message"], r.text
        assert protected.password not in r.text
        assert metric_sum(metrics(srv.url), "dllm_ready") == 0
    finally:
        srv.stop()


def test_an_unreadable_stored_entry_makes_its_mode_not_ready(tmp_path, protected):
    raw = redis.Redis.from_url(protected.url())
    stored = b"\x00\xffnot json at all"
    raw.hset("dllm-kvq:active", f"{SPEC.fingerprint}:dual", stored)
    srv = replica(tmp_path, protected.url(), "unreadable", ready=False)
    try:
        r = httpx.get(srv.url + "/health/ready")
        assert r.status_code == 503 and "cache mode dual" in r.json()["error"]["message"], r.text
        dual = httpx.post(srv.url + "/v1/completions", json={"model": "fake-llada", "prompt": "ab", "max_tokens": 4,
                                                             "cache_mode": "dual"}, timeout=30)
        assert dual.status_code == 503 and dual.json()["error"]["code"] == "config_unavailable", dual.text
        assert "not json" not in dual.text and "\\u0000" not in dual.text  # no stored bytes echoed
        prefix = httpx.post(srv.url + "/v1/completions", json={"model": "fake-llada", "prompt": "ab",
                                                               "max_tokens": 4, "cache_mode": "prefix"}, timeout=30)
        assert prefix.status_code == 200
        # An operator's activation replaces it and the mode is ready again.
        assert httpx.put(srv.url + "/admin/active/dual", json=DUAL, headers=ADMIN).status_code == 200
        assert httpx.get(srv.url + "/health/ready").status_code == 200
    finally:
        srv.stop()
