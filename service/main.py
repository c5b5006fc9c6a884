"""The app factory and its lifespan: the model, worker, stores and metrics are built once and kept on ``app.state``.

``create_app(settings)`` gives a FastAPI app; the lifespan (FastAPI's startup/shutdown) loads the engine (unless
one is handed in, as HTTP-shape tests do with a fake engine), opens the store, loads the active configurations
and subscribes to their changes, starts the worker and runs the readiness probe (one denoising step of a tiny
input through the worker). Shutdown drains the worker (``drain_timeout_s``) and closes the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import body, errors, openapi
from service.api.admin import Admin
from service.api.routes import admin, health, native, openai
from service.api.serving import OUTCOME_KEY, Serving
from service.config import Settings, served_model_name
from service.engine.engine import cache_modes
from service.engine.families import settings_rules
from service.engine.kv_store import KVStore
from service.engine.params import DecodeParams, RowOptions
from service.engine.prefix_cache import PrefixCache
from service.engine.protocol import EngineLike
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.runtime.loop import Job, Worker
from service.runtime.memory import CPU_BUDGET_BYTES, MemoryModel, default_budget
from service.runtime.scheduler import default_max_work, work_tokens
from service.store.active import ActiveConfigs, ConfigResolver, ConfigSnapshot
from service.store.base import Store, StoreAccessDenied, StoreUnavailable, open_store
from service.store.monitor import StoreMonitor
from service.telemetry import Telemetry

log = logging.getLogger(__name__)

#: The routers of the API, included without a prefix (`service.api.routes`).
ROUTERS = (openai.router, native.router, health.router, admin.router)
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")
#: nginx's status for a request whose client closed the connection (`service.api.errors`: JobCancelled).
CLIENT_CLOSED = 499


class StartupRefused(RuntimeError):
    """A setting the server cannot start with, found only once it runs (credentials the store refuses)."""


def default_kv_store_factory(spec: ModelSpec) -> Callable[[ConfigSnapshot], KVStore | None]:
    """KV store of a batch: None (the engine's full-precision store) for method none, else the quantized store
    `service.quant.make_kv_store` builds from the snapshot's config and loaded policy or state."""

    def factory(snapshot: ConfigSnapshot) -> KVStore | None:
        if snapshot.config.method == "none":
            return None
        from service.quant.store import make_kv_store

        return make_kv_store(snapshot.config, spec, snapshot.artifact)

    return factory


def load_engine(settings: Settings) -> EngineLike:
    """The engine the settings name (None: the embedded default model)."""
    from service.engine import Engine
    from service.engine.graphs import LaterSteps

    engine = Engine.load(settings.model, dtype=settings.dtype, device=settings.device, threads=settings.threads)
    # CUDA graphs of the later steps: on by default on CUDA (Engine's default), capped by cuda_graph_bytes.
    graphs = settings.cuda_graphs and engine.device.type == "cuda"
    engine.use_graphs(LaterSteps(capture=True, max_bytes=settings.cuda_graph_bytes) if graphs else None)
    return engine


class MetricsMiddleware:
    """Counts every request by route and status, and times the generation endpoints (streams included: the
    time runs until the last byte). Pure ASGI, so streaming and disconnect detection are untouched. A request
    cancelled by its client is counted with status 499 and in ``dllm_requests_cancelled_total``, also a stream
    whose 200 was already sent (the serving marks it, `service.api.serving.mark_cancelled`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = {"code": 500}
        outcome = scope[OUTCOME_KEY] = {"cancelled": False}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            telemetry: Telemetry | None = getattr(scope["app"].state, "telemetry", None)
            endpoint = _endpoint(scope)
            if telemetry is not None:
                # A request cancelled after its status went out (a stream whose client left) is a 499 too; one whose
                # body never came whole is the status `service.api.body.BodyLimit` recorded (408 or 499), not 500.
                code = CLIENT_CLOSED if outcome["cancelled"] else outcome.get("status", status["code"])
                telemetry.requests.labels(endpoint, str(code)).inc()
                if code == CLIENT_CLOSED:
                    telemetry.cancelled.labels(endpoint).inc()
                if endpoint in GENERATION_ENDPOINTS:
                    telemetry.latency.labels(endpoint).observe(time.monotonic() - start)


def _endpoint(scope: Scope) -> str:
    """The ``endpoint`` label: the path of the route the request was for, also when it was answered before routing
    (`service.api.body.BodyLimit`'s 413, a body that timed out); "other" when no route has that path."""
    route = scope.get("route")
    if route is None:
        routes = (r for router in ROUTERS for r in router.routes)  # included without a prefix: their own paths
        route = next((r for r in routes if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "path", None) or "other"


class HostAllowList:
    """Answers 400 (``code: invalid_host``) to a request whose ``Host`` header is not one of ``allowed``
    (``*.example.com`` matches subdomains, ``*`` anything): a page that rebinds its own DNS name to this server's
    address cannot drive it (issue 22). Pure ASGI; the port of the header is ignored."""

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.exact = {h.lower().strip("[]") for h in allowed if not h.startswith("*")}
        self.suffixes = tuple(h[1:].lower() for h in allowed if h.startswith("*."))
        self.any = "*" in allowed

    def accepts(self, host: str) -> bool:
        """Whether a ``Host`` header value (a name or address, with or without port) is allowed."""
        host = host.strip().lower()
        if host.startswith("["):  # [v6]:port
            name = host[1:host.find("]")] if "]" in host else host
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return self.any or name in self.exact or any(name.endswith(suffix) for suffix in self.suffixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if not self.accepts(host):
                response = errors.JSONResponse(errors.error_body(
                    "the Host header names no host this server answers to (DLLM_ALLOWED_HOSTS)",
                    "invalid_request_error", "invalid_host", None), status_code=400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def probe(worker: Worker, snapshot: ConfigSnapshot, spec: ModelSpec, timeout_s: float) -> None:
    """One denoising step of a one-token prompt and a 4-position response through the worker (readiness): cache
    mode ``none`` and one step where the family takes them, else its first cache mode and its own one step (a
    renoising family: ``max_denoising_steps`` 1, one canvas)."""
    rules = settings_rules(spec.arch)
    mode = "none" if not rules["cache_mode"].refuses("none") else cache_modes(spec)[0]
    if rules["steps"].refuses(1):
        params = DecodeParams(gen_length=4, block_length=4, cache_mode=mode, max_denoising_steps=1)
    else:
        params = DecodeParams(gen_length=4, block_length=4, cache_mode=mode, threshold=None, steps=1)
    job = worker.submit(Job([spec.pad_id if spec.pad_id != spec.mask_id else 0], params, RowOptions(), snapshot,
                            internal=True))
    await asyncio.wait_for(asyncio.wrap_future(job.future), timeout=timeout_s)


def startup_line(model_name: str, spec: ModelSpec, store: Store, active: ActiveConfigs, worker: Worker,
                 ready: bool) -> str:
    """The one line the server logs once started: model, weights fingerprint, store, the active configuration of
    every cache mode (method, bits, policy or state id, where it came from), the worker's KV memory budget and
    readiness."""

    def describe(snapshot: ConfigSnapshot) -> str:
        c = snapshot.config
        if c.method == "none":
            return f"unquantized ({snapshot.source})"
        artifact = c.artifact_id or c.artifact_file
        return f"{c.method} {c.bits}-bit{' ' + artifact if artifact else ''} ({snapshot.source})"

    served = {mode: describe(snap) for mode, snap in active.all().items()}
    configs = ", ".join(f"{mode}={served.get(mode, 'NOT ready')}" for mode in sorted(served | active.not_ready))
    budget_text = f"KV budget {worker.budget_bytes / 2**20:,.0f} MiB"
    return (f"serving {model_name!r} ({spec.model_id}, {spec.arch}, {spec.num_layers} layers), weights fingerprint "
            f"{spec.fingerprint}; store {store.location}; active: {configs}; {budget_text}; "
            f"{'ready' if ready else 'NOT ready'}")


def make_worker(settings: Settings, engine: EngineLike, kv_store_factory, telemetry: Telemetry) -> Worker:
    """The worker with the settings' limits: its KV memory budget (``kv_budget_bytes``, else a fraction of free
    GPU memory), the activation memory of a forward at ``max_batched_tokens``, measured here once, and the prefix
    cache of ``prefix_cache_bytes`` (none at 0), set on the engine too."""
    memory = MemoryModel.for_engine(engine)
    budget = settings.kv_budget_bytes or default_budget(memory.device, settings.kv_budget_fraction, CPU_BUDGET_BYTES)
    # The later steps' CUDA graphs hold up to cuda_graph_bytes of memory pools: reserved out of the budget, and
    # what they hold is reported (dllm_cuda_graph_bytes).
    from service.engine import Engine

    runner = engine.later_steps if isinstance(engine, Engine) else None  # a test's fake engine has none
    if settings.cuda_graphs and memory.device.type == "cuda":
        budget -= settings.cuda_graph_bytes
    if runner is not None:
        telemetry.cuda_graph_bytes.set_function(lambda: runner.bytes_held)
    forward = memory.measure_forward(engine, settings.max_batched_tokens)
    if runner is not None and runner.pool is not None:
        # The graphs' K/V pool holds each running request's full-precision K/V as admission counts them; its
        # buffers grow unasked only up to the KV bytes the budget admits beside the forward reserve.
        runner.pool.max_tokens = max(1, (budget - forward) // memory.full_precision_bytes_per_token)
        telemetry.kv_pool_bytes.set_function(lambda: runner.pool.bytes_held + runner.pool.packed.bytes_held)
    max_work = settings.max_request_work or default_max_work(engine.spec.max_length)
    refuse_contradictions(settings, engine, memory, budget, forward, max_work)
    # The prefix cache across requests (`service.engine.prefix_cache`): the engine's block-causal batches read and
    # fill it, the worker counts it in the budget and makes it give way, telemetry publishes its counts.
    # Only a decoder that reads it keeps one (`Capabilities.prefix_cache` empty: the block-causal family's); on
    # another (a bidirectional family's prompt K/V depend on what follows; DiffusionGemma's depend, bit for bit, on
    # the pass that encodes them) the setting is said to do nothing rather than published as a capacity nothing fills. The
    # cache kind was asked once, and DiffusionGemma's committed cache kind published 1e+06 bytes nothing used.
    why_not = engine.capabilities.prefix_cache
    reads = not why_not
    if settings.prefix_cache_bytes and not reads:
        log.warning("--prefix-cache-bytes / DLLM_PREFIX_CACHE_BYTES has no effect on %s models: %s; no prefix "
                    "cache is kept", engine.spec.arch, why_not)
    prefix_cache = PrefixCache(settings.prefix_cache_bytes) if settings.prefix_cache_bytes and reads else None
    engine.prefix_cache = prefix_cache
    if prefix_cache is not None:
        telemetry.watch_prefix_cache(prefix_cache)
    worker = Worker(engine, kv_store_factory, telemetry, memory, budget, max_rows=settings.max_batch_size,
                    max_queue=settings.max_queue, max_batched_tokens=settings.max_batched_tokens,
                    forward_bytes=forward, backfill_s=settings.backfill_s, retry_after_s=settings.retry_after_s,
                    shadow_rate=settings.shadow_rate, shadow_queue=settings.shadow_queue,
                    max_work=max_work, max_preemptions=settings.max_preemptions,
                    layer_split_tokens=settings.layer_split_tokens, prefix_cache=prefix_cache)
    if runner is not None:
        # What the graphs' pools hold past their live runs (freed runs' space, until they shrink) is memory the
        # running requests' costs do not count: admission counts it beside them.
        worker.pool_slack = lambda: runner.unused_bytes
    return worker


def default_request_bytes(settings: Settings, engine: EngineLike, memory: MemoryModel, forward: int) -> tuple[int, int]:
    """``(bytes, prompt tokens)``: the memory admission needs to run the server's default request alone (a request
    that leaves max_tokens out: ``default_max_tokens`` response positions rounded up to whole blocks, after a prompt
    as long as that response, e.g. the README's 61-token chat under the default 64), counted as the worker counts
    it (`service.runtime.loop.Worker._check_size`): full-precision KV of the whole sequence and a spare column in
    the server's cache mode as the loaded family holds it (`EngineLike.cache_cost`), the hidden states held between
    the pieces of a block-initial pass split by layers, and the larger of its own largest forward and the forward
    reserve ``forward`` (bytes)."""
    block = settings.block_length
    gen = -(-settings.default_max_tokens // block) * block
    per_token = memory.full_precision_bytes_per_token
    params = DecodeParams(gen_length=gen, block_length=block, cache_mode=settings.cache_mode)
    cost = memory.cost(gen, params, per_token)
    cache = engine.cache_cost(gen, params, cost.kv, False)  # alone: its slots' own columns
    kv = cache.kv + cache.slot_bytes * cache.slot_columns
    split = settings.layer_split_tokens and 2 * gen > settings.layer_split_tokens
    hidden = memory.hidden_bytes(2 * gen) if split else 0
    return kv + hidden + max(cost.transient, forward), gen


def refuse_contradictions(settings: Settings, engine: EngineLike, memory: MemoryModel, budget: int, forward: int,
                          max_work: int) -> None:
    """Refuse settings that cannot work together, in one line naming both (issue 36), rather than start a server
    that refuses every request and blames the prompt:

    * the memory budget below what the default request needs alone beside the forward reserve of
      ``max_batched_tokens`` (:func:`default_request_bytes`; the minimum named serves it, issue 45 item 11);
    * ``max_request_work`` below the work of a one-token request of ``default_max_tokens``: every request that
      leaves max_tokens out would be refused.

    Args: budget, forward: the budget and the forward reserve in bytes; max_work: the work ceiling in token-forwards.

    Raises: StartupRefused.
    """
    block = settings.block_length
    needed, prompt = default_request_bytes(settings, engine, memory, forward)
    if needed > budget:
        named = ("--kv-budget-bytes / DLLM_KV_BUDGET_BYTES" if settings.kv_budget_bytes else
                 "the default memory budget (--kv-budget-fraction of free GPU memory, 1 GiB on CPU)")
        if settings.cuda_graphs and memory.device.type == "cuda":
            named += (f" less --cuda-graph-bytes / DLLM_CUDA_GRAPH_BYTES {settings.cuda_graph_bytes:,} reserved for "
                      "the CUDA graphs (--no-cuda-graphs frees it)")
        raise StartupRefused(
            f"{named} of {budget:,} bytes is below the {needed:,} bytes that one request of "
            f"--default-max-tokens / DLLM_DEFAULT_MAX_TOKENS {settings.default_max_tokens:,} after a {prompt:,}-token "
            f"prompt needs beside what --max-batched-tokens / DLLM_MAX_BATCHED_TOKENS "
            f"{settings.max_batched_tokens:,} reserves for one forward ({forward:,} bytes): the default request could "
            f"never run; raise the budget to at least {needed:,} bytes or lower --max-batched-tokens")
    gen = -(-settings.default_max_tokens // block) * block
    default_work = work_tokens(1, DecodeParams(gen_length=gen, block_length=block))  # a one-token prompt, threshold
    if default_work > max_work:
        raise StartupRefused(
            f"--max-request-work / DLLM_MAX_REQUEST_WORK {max_work:,} is below the {default_work:,} token-forwards of "
            f"a request of --default-max-tokens / DLLM_DEFAULT_MAX_TOKENS {settings.default_max_tokens:,}: every "
            "request without max_tokens would be refused; raise the first or lower the second")


def create_app(
    settings: Settings | None = None,
    engine: EngineLike | None = None,
    kv_store_factory: Callable[[ConfigSnapshot], KVStore | None] | None = None,
) -> FastAPI:
    """The server app. ``settings`` default to the environment's; ``engine`` to the one the settings name."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = engine if engine is not None else await asyncio.to_thread(load_engine, settings)
        telemetry = Telemetry()
        store = open_store(settings.store_url, prefix=settings.store_prefix)
        model_name = served_model_name(settings, eng.spec.model_id)
        active = ActiveConfigs(ConfigResolver(store, eng.spec), settings.kv_quant, telemetry, model_name,
                               restore=settings.store_restore_active)
        try:
            active.reload()
        except StoreUnavailable as exc:
            log.warning("store unreachable at start-up (%s); serving the default configuration until it returns", exc)
        except StoreAccessDenied as exc:
            # Not an outage to wait out: serving the default while the store holds another configuration would
            # be quietly wrong (issue 22). One line, no traceback of the client library.
            store.close()
            raise StartupRefused(f"--store-url / DLLM_STORE_URL: {exc}") from None

        def reload_after_outage() -> None:
            with contextlib.suppress(StoreUnavailable, StoreAccessDenied):
                active.reload()

        try:  # before the store's threads start: a refusal leaves nothing running
            worker = make_worker(settings, eng, kv_store_factory or default_kv_store_factory(eng.spec), telemetry)
        except StartupRefused as exc:
            app.state.startup_refused = str(exc)  # `service.commands.serve` prints it as the last line
            store.close()
            raise
        subscription = store.subscribe(active.on_change, on_reconnect=reload_after_outage)
        monitor = StoreMonitor(store, telemetry, settings.store_check_interval_s, check=active.poll)
        worker.start()
        app.state.settings, app.state.engine, app.state.telemetry = settings, eng, telemetry
        app.state.store, app.state.active, app.state.worker = store, active, worker
        app.state.serving = Serving(eng, worker, active, settings, telemetry, model_name)
        app.state.max_body_bytes = settings.max_body_bytes or body.default_body_limit(eng.spec.max_length)
        app.state.admin = Admin(store, active, telemetry)
        app.state.probe_error = None
        try:
            await probe(worker, ConfigSnapshot(KVQuantConfig(), "none", "default"), eng.spec, timeout_s=120)
            telemetry.ready.set(0 if active.not_ready else 1)
        except Exception as exc:  # the server still starts, so /health/ready can say why it is not ready
            log.exception("readiness probe failed")
            app.state.probe_error = f"{type(exc).__name__}: {exc}"
            telemetry.ready.set(0)
        log.info(startup_line(model_name, eng.spec, store, active, worker,
                              app.state.probe_error is None and not active.not_ready))
        try:
            yield
        finally:
            telemetry.ready.set(0)
            finished = await asyncio.to_thread(worker.drain, settings.drain_timeout_s)
            app.state.drained = worker.cut_by_drain == 0  # also counts what SIGTERM's own drain cut
            if not finished:
                log.warning("drain timed out after %.0f s; cancelled what was left", settings.drain_timeout_s)
            monitor.close()
            subscription.close()
            store.close()

    app = FastAPI(title="dllm-kvq", version="0.1.0", lifespan=lifespan)
    errors.install(app)
    openapi.install(app)
    app.add_middleware(body.BodyLimit, fastapi=app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(MetricsMiddleware)
    if settings.allowed_hosts:
        app.add_middleware(HostAllowList, allowed=settings.allowed_hosts)
    return app


def app_from_env() -> Any:
    """``uvicorn --factory service.main:app_from_env``: the app with settings from the environment."""
    return create_app()
