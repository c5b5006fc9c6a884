"""``python -m tests.support.serve_fake``: the fake-engine app served as ``dllm-kvq serve`` serves the real one
(`service.commands.serve.serve_app`: connection bounds, Host allow-list, drain), settings from ``DLLM_*``.
``FAKE_UNHANDLED_ROUTE=1`` adds ``GET /test/unhandled``, which raises an error no handler maps (a bug's stand-in)."""

from __future__ import annotations

import os
import sys

from service.commands.serve import bind, serve_app
from service.config import Settings, effective_allowed_hosts
from tests.support.apps import fake_app


def _unhandled() -> None:
    raise RuntimeError("a bug no handler maps")


if __name__ == "__main__":
    settings = Settings()
    settings = settings.model_copy(update={"allowed_hosts": effective_allowed_hosts(settings)})
    app = fake_app(settings)
    if os.environ.get("FAKE_UNHANDLED_ROUTE") == "1":
        app.add_api_route("/test/unhandled", _unhandled)
    sys.exit(serve_app(app, settings, bind(settings.host, settings.port)))
