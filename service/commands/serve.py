"""``python -m service serve``: start the HTTP server (uvicorn, one process: one worker owns the model).

Every setting of `service.config.Settings` is also a flag (``--max-batch-size 8``); a flag overrides the
``DLLM_*`` environment. With no ``--model`` (and no ``DLLM_MODEL``) the embedded default model is served.
SIGTERM: readiness fails and new requests are refused at once, admitted ones finish (up to ``drain_timeout_s``).
Exit status: 0 after a clean stop, 1 when the drain timeout cut admitted requests, 2 for a bad setting (one that
is refused alone, or settings that cannot work together, such as a memory budget below what the default request
needs: refused once the model is loaded), 3 when start-up failed (the port cannot be bound, the store refuses the
credentials of its URL, or the model failed to load: one line).
Idle and slow clients are bounded (`service.connections`: header, body and keep-alive timeouts, a cap on open
connections below the file-descriptor limit), and on a loopback bind only the loopback Host names are answered
unless ``allowed_hosts`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from service.commands import add_model_flags, prog
from service.config import DEFAULT_STORE_URL, Settings, effective_allowed_hosts


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` with one flag per setting."""
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server", description=__doc__)
    add_model_flags(p, Settings.model_fields, show_default=True)
    p.set_defaults(func=run)


# Seconds uvicorn waits beyond the worker's drain, for the 503s of what the drain cancelled to be written.
DRAIN_MARGIN_S = 5
# Exit statuses besides 0 (stopped, everything admitted finished).
DRAIN_CUT = 1  # SIGTERM's drain timeout ran out and cancelled admitted requests (they got a 503)
BAD_SETTING = 2  # a setting refused alone, or settings that cannot work together (argparse's own usage status)
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
                raise ValueError(_not_json(name, exc)) from None
        overrides[name] = value
    try:
        return Settings(**overrides)
    except SettingsError as exc:  # pydantic-settings could not parse an environment variable (its JSON)
        found = re.search(r'field "(\w+)"', str(exc))
        if found is None or found.group(1) not in Settings.model_fields:
            raise
        name, cause = found.group(1), exc.__cause__
        line = (_not_json(name, cause) if isinstance(cause, json.JSONDecodeError) else
                f"--{name.replace('_', '-')} / DLLM_{name.upper()}: cannot be read ({cause or exc})")
        raise ValueError(line) from None


# What a structured setting looks like, for the line that refuses one that is not JSON.
JSON_EXAMPLES = {"kv_quant": '{"method": "kivi", "bits": 4}'}


def _not_json(name: str, exc: json.JSONDecodeError) -> str:
    example = JSON_EXAMPLES.get(name)
    return (f"--{name.replace('_', '-')} / DLLM_{name.upper()}: not valid JSON ({exc.msg} at char {exc.pos})"
            + (f"; it is a JSON object, e.g. '{example}'" if example else ""))


def describe_settings_error(exc: ValidationError) -> str:
    """One ``--flag / DLLM_NAME: reason`` per error (the flag and the variable that set the setting), WITHOUT the
    input values (pydantic's own message repeats them, admin and API keys included)."""
    from service.engine.errors import validation_message

    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        loc = [str(part) for part in error["loc"]]
        message = validation_message(error)
        if loc and loc[0] in Settings.model_fields:
            where = f"--{loc[0].replace('_', '-')} / DLLM_{loc[0].upper()}" + "".join(f".{p}" for p in loc[1:])
            message = f"{where}: {message}"
        lines.append(message)
    return "; ".join(lines)


def check_model_settings(settings: Settings) -> str | None:
    """What is wrong with the model, dtype or device settings, as one line naming the flag and what to do, or None;
    checked before the port is bound and the model loads (the lifespan would fail with a traceback)."""
    from service.engine.errors import EngineInputError
    from service.engine.loading import resolve_checkpoint_dir, resolve_device

    for flag, check, value in (("--device / DLLM_DEVICE", resolve_device, settings.device),
                               ("--model / DLLM_MODEL", resolve_checkpoint_dir, settings.model)):
        try:
            check(value)
        except EngineInputError as exc:
            return f"{flag}: {exc}"
    return check_served(settings) or check_family_settings(settings)


def check_served(settings: Settings) -> str | None:
    """One line naming ``--model`` when the checkpoint's family is not served in this version
    (`Capabilities.served`; DiffusionGemma, which ``dllm-kvq generate`` decodes), read from ``config.json`` alone,
    else None: such a server would start, fail its readiness probe and answer nothing."""
    from service.engine.families import capabilities_of
    from service.engine.loading import model_class

    arch = model_class(settings.model).arch
    if capabilities_of(arch).served:
        return None
    return (f"--model / DLLM_MODEL: {arch} models are not served in this version; decode them with "
            f"`{prog('service', 'generate')} --model DIR ...` (docs/diffusion_gemma.md)")


def check_family_settings(settings: Settings) -> str | None:
    """The decoding setting the model's family does not serve, as one line naming its flag, or None: each
    default decoding setting (``DecodeSettings``, which every request falls back on) against the family's
    declaration (`service.engine.families.check_family_settings`, from ``config.json`` alone: no weights read)
    and the family's check of them against the checkpoint (`RevealRule.check_defaults`: DiffusionGemma's
    ``generation_config.json`` and canvas), so that ``serve --cache-mode block`` on LLaDA does not start "ready"
    and refuse every request for a field the client never sent (issue 45 item 3)."""
    from service.engine.errors import EngineInputError
    from service.engine.families import check_family_settings as check
    from service.engine.loading import checkpoint_config

    try:
        cls, config, directory = checkpoint_config(settings.model)
        check(cls.arch, settings.decode_settings())
        # Then the values read against the checkpoint (DiffusionGemma's generation_config.json, its canvas):
        # `--t-max 0.3` under the checkpoint's t_min 0.4 started "ready" and refused every request.
        cls.reveal_rule.check_defaults(directory, config, settings.decode_settings(), settings.model_fields_set)
    except EngineInputError as exc:
        name = exc.field or ""
        return f"--{name.replace('_', '-')} / DLLM_{name.upper()}: {exc}"
    return None


def admin_note(settings: Settings) -> str | None:
    """The start-up note of a server without an admin key, else None: its /admin routes answer 403, but it still
    applies what is written into its store (the server follows the store's events whatever its key)."""
    if settings.admin_key is not None:
        return None
    from service.store.base import redact_url

    policies = prog("service", "policies")
    return (f"note: admin is closed (DLLM_ADMIN_KEY is not set): /admin answers 403 and `{policies} activate --server "
            f"...` is refused; the active configuration still follows the store {redact_url(settings.store_url)} (`{policies} "
            "activate` on that store changes what this server serves); to open admin, start it again after "
            "`export DLLM_ADMIN_KEY=<16+ characters>`")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a busy port fails at once in one line (not after
    the server has logged that it is ready); uvicorn serves on it (as its own ``Config.bind_socket`` would make it).

    Raises:
        OSError: the address cannot be bound (in use, not an address of this host, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def missing_store_directory(settings: Settings) -> str | None:
    """None, or the one line saying that the directory store the settings name does not exist: a typo in
    ``--store-url`` would otherwise start a new, empty store and serve without the artifacts the operator meant.
    A new store is asked for with ``--create-store``; the default store (``DEFAULT_STORE_URL``) is always created."""
    from service.store.base import check_store_url

    path = check_store_url(settings.store_url)
    if not path or settings.create_store or settings.store_url == DEFAULT_STORE_URL or Path(path).expanduser().is_dir():
        return None
    return (f"--store-url / DLLM_STORE_URL: no store directory {Path(path).expanduser().resolve()}; name an existing "
            "store, or add --create-store (DLLM_CREATE_STORE=true) to start a new, empty one there")


def resolve_kv_quant_artifact(settings: Settings) -> tuple[Settings, str | None]:
    """The settings with the ``kv_quant`` setting's artifact id in full (an unambiguous prefix names it too), and
    None; or the settings as given and the one line saying that the id names no stored artifact, or several, or
    that its file is not there: the server would load the model and then never turn ready. A store that does not
    answer is no reason here (the server starts and reports it)."""
    from service.quant.registry import method
    from service.store.base import AmbiguousId, ArtifactNotFound, StoreError, open_store

    config = settings.kv_quant
    entry = method(config.method)
    flag = "--kv-quant / DLLM_KV_QUANT"
    if config.artifact_file is not None and not Path(config.artifact_file).expanduser().is_file():
        return settings, f"{flag}: {entry.spelling('artifact_file')} {config.artifact_file!r} is not a file"
    if config.artifact_id is None or entry.store_kind is None:
        return settings, None
    try:
        store = open_store(settings.store_url, prefix=settings.store_prefix)
        try:
            full_id = store.resolve_id(entry.store_kind, config.artifact_id)
        finally:
            store.close()
    except ArtifactNotFound:
        return settings, (f"{flag}: no {entry.store_kind} with {entry.spelling('artifact_id')} {config.artifact_id!r} "
                          f"in the store {store.location}; `{prog('service', 'policies')} list` shows what it holds")
    except AmbiguousId as exc:
        return settings, f"{flag}: {exc}"
    except StoreError:
        return settings, None
    return settings.model_copy(update={"kv_quant": config.model_copy(update={"artifact_id": full_id})}), None


def check_store(settings: Settings) -> str | None:
    """None, or the one line saying why the server cannot start with its store: the store answers but refuses the
    credentials (an unreachable store is no reason: the server starts and reports it)."""
    from service.store.base import StoreAccessDenied, StoreError, open_store

    try:
        store = open_store(settings.store_url, prefix=settings.store_prefix)
    except StoreAccessDenied as exc:
        return f"--store-url / DLLM_STORE_URL: {exc}"
    except StoreError:
        return None
    try:
        store.version()
    except StoreAccessDenied as exc:
        return f"--store-url / DLLM_STORE_URL: {exc}"
    except StoreError:
        return None
    finally:
        store.close()
    return None


def served_url(sock: socket.socket) -> str:
    """``http://host:port`` of a listening socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(app: Any, settings: Settings) -> Any:
    """The uvicorn server of ``app`` under ``settings``: SIGTERM drains the worker first; connections bounded
    (`service.connections`)."""
    import uvicorn

    from service.connections import ConnectionLimits, default_max_connections, guarded_protocol, sweep

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT, stop admitting before uvicorn stops accepting connections; apply the connection
        timeouts once a second."""

        def handle_exit(self, sig, frame) -> None:
            worker = getattr(app.state, "worker", None)
            if worker is not None:
                # The worker's drain ends first and answers what is left with a JSON 503; uvicorn's own
                # graceful timeout (later, below) would cut those requests with a plain-text 500.
                threading.Thread(target=worker.drain, args=(settings.drain_timeout_s,), daemon=True).start()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn logs no address for sockets it was handed: say once where the server answers, after the
            # lifespan (model loaded) and the listeners started.
            await super().startup(sockets=sockets)
            if self.started and sockets:
                logging.getLogger(__name__).info("listening on %s (OpenAI base URL %s/v1)", *[served_url(sockets[0])] * 2)

        async def on_tick(self, counter: int) -> bool:
            if counter % 10 == 0:
                sweep(self.server_state.connections)
            return await super().on_tick(counter)

    limits = ConnectionLimits(settings.header_timeout_s, settings.body_timeout_s,
                              settings.max_connections or default_max_connections(), settings.retry_after_s)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.drain_timeout_s) + DRAIN_MARGIN_S,
                            timeout_keep_alive=settings.keep_alive_timeout_s, http=guarded_protocol(limits))
    return DrainingServer(config)


def run(args: argparse.Namespace) -> int:
    """Build the settings, the app and a uvicorn server that drains on SIGTERM; run until stopped."""
    from service.main import create_app

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"error: bad setting: {describe_settings_error(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: bad setting: {exc}", file=sys.stderr)
        return 2
    try:
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        print(f"error: --port / DLLM_PORT: cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc}); "
              "stop what is using it or choose another --port", file=sys.stderr)
        return STARTUP_FAILED
    problem = check_model_settings(settings)
    if problem:
        sock.close()
        print(f"error: {problem}", file=sys.stderr)
        return 2
    missing = missing_store_directory(settings)
    if missing is not None:
        sock.close()
        print(f"error: {missing}", file=sys.stderr)
        return 2
    refused = check_store(settings)
    if refused is not None:
        sock.close()
        print(f"error: {refused}", file=sys.stderr)
        return STARTUP_FAILED
    settings, absent = resolve_kv_quant_artifact(settings)
    if absent is not None:
        sock.close()
        print(f"error: {absent}", file=sys.stderr)
        return 2
    note = admin_note(settings)
    if note:
        print(note, file=sys.stderr)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings.model_copy(update={"allowed_hosts": effective_allowed_hosts(settings)})
    app = create_app(settings)
    return serve_app(app, settings, sock)


class _DropRefusalTraceback(logging.Filter):
    """Drops the log record of a start-up refused for its settings (the traceback text of `StartupRefused`):
    :func:`serve_app` prints the refusal itself, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "StartupRefused" not in record.getMessage()


def serve_app(app: Any, settings: Settings, sock: socket.socket) -> int:
    """Serve ``app`` on the bound ``sock`` until stopped; the exit status (see the module docstring)."""
    server = uvicorn_server(app, settings)
    # uvicorn restores the SIGTERM handler it found and raises the captured signal again after its graceful
    # shutdown; with Python's default handler that kills the process (status 143) even after a clean drain.
    # A handler that only notes the signal lets the drained server return: a stop that was asked for is no
    # failure. SIGINT keeps its default (KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    # A refusal of the settings (`service.main.StartupRefused`) is printed below in one line; uvicorn would log the
    # lifespan's traceback of it first (Starlette hands it the formatted traceback as the failure's message).
    quiet = _DropRefusalTraceback()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    try:
        server.run(sockets=[sock])
    except SystemExit:
        if server.started:
            raise  # a failed start-up is uvicorn's sys.exit(3): answered below, with the reason when there is one
    finally:
        uvicorn_log.removeFilter(quiet)
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    if not server.started:
        refused = getattr(app.state, "startup_refused", None)
        if refused:  # settings that cannot work together (`service.main.refuse_contradictions`): one line, last
            print(f"error: {refused}", file=sys.stderr)
            return BAD_SETTING  # what --help promises for a bad setting
        return STARTUP_FAILED  # the lifespan failed (uvicorn logged why)
    return 0 if getattr(app.state, "drained", True) else DRAIN_CUT
