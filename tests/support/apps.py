"""App factories for tests: the server around the fake engine, in-process or as ``uvicorn --factory``."""

from __future__ import annotations

import json
import os

from service.config import Settings
from service.main import create_app
from tests.support.fake_engine import FakeEngine

ADMIN_KEY = "test-admin-key-0123456789"


def fake_app(settings: Settings | None = None, block_delay_s: float = 0.0):
    """The real app (worker, store, routes) with a fake engine (which ignores the KV store it is given, so none
    is built)."""
    return create_app(settings, engine=FakeEngine(block_delay_s=block_delay_s), kv_store_factory=lambda snap: None)


def fake_admin_client(store_dir):
    """A TestClient of `fake_app` over a directory store, blocks of 4 and the admin key (a context manager)."""
    from fastapi.testclient import TestClient

    return TestClient(fake_app(Settings(store_url=str(store_dir), block_length=4, admin_key=ADMIN_KEY)))


def fake_app_from_env():
    """``uvicorn --factory tests.support.apps:fake_app_from_env``: settings from DLLM_*, the fake engine's delay
    from ``FAKE_BLOCK_DELAY_S``."""
    return fake_app(Settings(), block_delay_s=float(os.environ.get("FAKE_BLOCK_DELAY_S", "0")))


def sse_events(lines) -> list:
    """Parse SSE ``data:`` lines into JSON objects; ``[DONE]`` is kept as the string."""
    out = []
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
