"""``python -m service serve``: start the HTTP server (uvicorn, one process: one worker owns the model).

Every setting of `service.config.Settings` is also a flag (``--max-batch-size 8``); a flag overrides the
``DLLM_*`` environment. With no ``--model`` (and no ``DLLM_MODEL``) the embedded default model is served.
SIGTERM: readiness fails and new requests are refused at once, admitted ones finish (up to ``drain_timeout_s``).
Exit status: 0 after a clean stop, 1 when the drain timeout cut admitted requests, 2 for a bad setting, 3 when
start-up failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any

from pydantic import BaseModel, ValidationError

from service.commands import add_model_flags, describe_validation_error
from service.config import Settings


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` with one flag per setting."""
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server", description=__doc__)
    add_model_flags(p, Settings.model_fields)
    p.set_defaults(func=run)


# Seconds uvicorn waits beyond the worker's drain, for the 503s of what the drain cancelled to be written.
DRAIN_MARGIN_S = 5
# Exit statuses besides 0 (stopped, everything admitted finished) and 2 (bad setting).
DRAIN_CUT = 1  # SIGTERM's drain timeout ran out and cancelled admitted requests (they got a 503)
STARTUP_FAILED = 3  # uvicorn's own status for a failed start-up


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings: environment, overridden by the flags given (JSON for structured settings such as kv_quant)."""
    overrides: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name}: not valid JSON ({exc.msg} at char {exc.pos})") from None
        overrides[name] = value
    return Settings(**overrides)


def run(args: argparse.Namespace) -> int:
    """Build the settings, the app and a uvicorn server that drains on SIGTERM; run until stopped."""
    import uvicorn

    from service.main import create_app

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"error: bad setting: {describe_validation_error(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: bad setting: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT, stop admitting before uvicorn stops accepting connections."""

        def handle_exit(self, sig, frame) -> None:
            worker = getattr(app.state, "worker", None)
            if worker is not None:
                # The worker's drain ends first and answers what is left with a JSON 503; uvicorn's own
                # graceful timeout (later, below) would cut those requests with a plain-text 500.
                threading.Thread(target=worker.drain, args=(settings.drain_timeout_s,), daemon=True).start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.drain_timeout_s) + DRAIN_MARGIN_S)
    server = DrainingServer(config)
    # uvicorn restores the SIGTERM handler it found and raises the captured signal again after its graceful
    # shutdown; with Python's default handler that kills the process (status 143) even after a clean drain.
    # A handler that only notes the signal lets the drained server return: a stop that was asked for is no
    # failure. SIGINT keeps its default (KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        return STARTUP_FAILED  # the lifespan failed (uvicorn logged why)
    return 0 if getattr(app.state, "drained", True) else DRAIN_CUT
