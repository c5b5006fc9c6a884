"""Real processes for integration tests: private ``redis-server`` processes on free ports (the suite's own, see
``tests/conftest.py``, and the ones stop/restart tests start), the server, and helpers to wait for a port."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

#: The environment variable naming the suite's Redis (set by ``tests/conftest.py``, or by the caller).
TEST_REDIS_ENV = "DLLM_TEST_REDIS_URL"


def shared_redis_url() -> str:
    """The suite's own Redis (DB 0), never a user's; fails clearly when redis-server is not installed."""
    url = os.environ.get(TEST_REDIS_ENV)
    if not url:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server; scripts/test.sh does it "
                           f"when root), or set {TEST_REDIS_ENV}")
    return url


def __getattr__(name: str) -> str:
    # ``from tests.support.processes import SHARED_REDIS_URL``: read when a test module imports it, after
    # tests/conftest.py started the suite's Redis (a plain constant would be fixed before that).
    if name == "SHARED_REDIS_URL":
        return shared_redis_url()
    raise AttributeError(name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until something accepts connections on 127.0.0.1:port (RuntimeError after timeout or if proc died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


class RedisProcess:
    """A private redis-server (no persistence) that a test may stop and start again on the same port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


class ServerProcess:
    """The server as a real uvicorn process on a free port.

    ``factory`` is ``module:function`` for ``uvicorn --factory`` (the fake-engine app), or None for the real
    ``python -m service serve``. ``env`` adds DLLM_* settings.
    """

    def __init__(self, env: dict[str, str], factory: str | None = None, log_path: Path | None = None) -> None:
        import os

        self.port = free_port()
        # DLLM_CREATE_STORE: each test server starts on a fresh directory store of its own, which it creates.
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "DLLM_PORT": str(self.port), "DLLM_HOST": "127.0.0.1",
                    "DLLM_CREATE_STORE": "true", **env}
        self.factory = factory
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0, ready: bool = True) -> ServerProcess:
        """Start and wait until ``/health/ready`` answers 200 (``ready=False``: until ``/health`` does, for a
        server that is expected to report not-ready)."""
        import os
        import sys

        if self.factory is not None:
            cmd = [sys.executable, "-m", "uvicorn", "--factory", self.factory, "--host", "127.0.0.1", "--port",
                   str(self.port), "--log-level", "warning"]
        else:
            cmd = [sys.executable, "-m", "service", "serve", "--log-level", "warning"]
        # The child keeps its own copy of the log descriptor, so ours can be closed at once.
        with open(self.log_path or os.devnull, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).resolve().parents[2])
        self.wait_ready(timeout_s, "/health/ready" if ready else "/health")
        return self

    def wait_ready(self, timeout_s: float, path: str = "/health/ready") -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log()}")
            try:
                if httpx.get(self.url + path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout_s} s; log: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""

    def stop(self, sig: int | None = None, timeout_s: float = 30.0) -> int | None:
        import signal

        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def embedded_server(log_dir: Path, name: str, **env: str):
    """``python -m service serve`` on the embedded model with the suite's own Redis under a fresh key prefix (deleted
    afterwards), one torch thread; ``env`` adds DLLM_* settings. Yields the started :class:`ServerProcess`."""
    import uuid

    from service.store.redis_store import RedisStore

    prefix = f"test-{name}-{uuid.uuid4().hex[:8]}"
    srv = ServerProcess({"DLLM_STORE_URL": shared_redis_url(), "DLLM_STORE_PREFIX": prefix, "DLLM_THREADS": "1",
                         **env},
                        log_path=log_dir / "server.log").start(timeout_s=180)
    try:
        yield srv
    finally:
        srv.stop()
        RedisStore(shared_redis_url(), prefix=prefix).delete_everything()
