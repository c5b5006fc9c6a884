"""``python -m tests.support.serve_fake``: the fake-engine app served as ``dllm-kvq serve`` serves the real one
(`service.commands.serve.serve_app`: connection bounds, Host allow-list, drain), settings from ``DLLM_*``."""

from __future__ import annotations

import sys

from service.commands.serve import bind, serve_app
from service.config import Settings, effective_allowed_hosts
from tests.support.apps import fake_app

if __name__ == "__main__":
    settings = Settings()
    settings = settings.model_copy(update={"allowed_hosts": effective_allowed_hosts(settings)})
    sys.exit(serve_app(fake_app(settings), settings, bind(settings.host, settings.port)))
