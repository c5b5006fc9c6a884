"""Bounds on idle and slow HTTP clients, at the connection level of uvicorn (issue 22).

uvicorn closes a kept-alive connection that stays silent for ``timeout_keep_alive`` seconds, but any byte
cancels that timer, a fresh connection that never sends a byte is never timed out, nor is a request body that
stops arriving; and it accepts connections until the process runs out of file descriptors (then ``accept`` fails
and even ``/health`` is refused). :func:`guarded_protocol` makes a subclass of uvicorn's HTTP protocol that adds:

* a **header timeout**: a connection must send a whole request head within ``header_timeout_s`` of connecting
  (or of the end of its previous answer), whatever it trickles meanwhile, else it is closed;
* a **body timeout**: while a request body is being received, a connection that sends nothing for
  ``body_timeout_s`` is answered 408 (``code: request_timeout``) and closed (the application sees a disconnect,
  and the scope key :data:`BODY_TIMED_OUT` says why);
* a **cap on open connections** below the file-descriptor limit: over it, the connection that has waited
  longest for a request head is closed to make room; when every connection is in a request, the newcomer gets a
  503 (``code: too_many_connections``, ``Retry-After``) and is closed.

The timeouts are checked once a second by :meth:`GuardedProtocol.sweep`, which the server calls
(`service.commands.serve`); nothing here holds a timer per connection.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, ClassVar

log = logging.getLogger(__name__)

#: File descriptors left to everything but client connections (model files, store, logs, the listening socket).
FD_RESERVE = 128


def default_max_connections(reserve: int = FD_RESERVE) -> int:
    """The open-file soft limit minus ``reserve`` (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - reserve)


@dataclass(frozen=True)
class ConnectionLimits:
    """What :class:`GuardedProtocol` enforces (seconds; a count of connections)."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    retry_after_s: int = 1


def _refusal(retry_after_s: int) -> bytes:
    body = json.dumps({"error": {"message": "too many open connections; retry later", "type":
                                 "service_unavailable_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: {retry_after_s}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def _timed_out(body_timeout_s: float) -> bytes:
    body = json.dumps({"error": {"message": f"the request body stopped arriving for {body_timeout_s:g} s "
                                 "(DLLM_BODY_TIMEOUT_S); send it whole", "type": "invalid_request_error",
                                 "param": None, "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


#: ASGI scope key set on a request whose body timed out (:meth:`GuardedProtocol.sweep`): the 408 already went out,
#: and `service.api.body.BodyLimit` records it as the request's status rather than as a client that left (499).
BODY_TIMED_OUT = "dllm.body_timed_out"


class GuardedProtocol:
    """Mixin over a uvicorn HTTP protocol class (httptools' or h11's: both keep ``cycle``, ``flow``,
    ``transport``, ``connections``, ``on_response_complete``); see the module docstring."""

    limits: ConnectionLimits
    #: Connections closed by each bound, for the log (class-wide counters: one server per process).
    closed: ClassVar[dict[str, int]] = {"header_timeout": 0, "body_timeout": 0, "evicted": 0, "refused": 0}

    def connection_made(self, transport: Any) -> None:
        now = time.monotonic()
        self.waiting_since = now  # waiting for a request head since
        self.last_data = now
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.limits.max_connections:  # type: ignore[attr-defined]
            self._make_room()

    def data_received(self, data: bytes) -> None:
        self.last_data = time.monotonic()
        super().data_received(data)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        self.waiting_since = time.monotonic()
        super().on_response_complete()  # type: ignore[misc]

    def in_request(self) -> bool:
        """A request head has arrived and its answer is not finished."""
        cycle = getattr(self, "cycle", None)
        return cycle is not None and not cycle.response_complete

    def _make_room(self) -> None:
        idle = [c for c in self.connections  # type: ignore[attr-defined]
                if c is not self and isinstance(c, GuardedProtocol) and not c.in_request()
                and not c.transport.is_closing()]  # type: ignore[attr-defined]
        if idle:
            oldest = min(idle, key=lambda c: c.waiting_since)
            oldest.transport.close()  # type: ignore[attr-defined]
            self._count("evicted")
            return
        self.transport.write(_refusal(self.limits.retry_after_s))  # type: ignore[attr-defined]
        self.transport.close()  # type: ignore[attr-defined]
        self._count("refused")

    def sweep(self, now: float) -> None:
        """Close this connection if it broke the header or the body timeout (called about once a second)."""
        transport = self.transport  # type: ignore[attr-defined]
        if transport is None or transport.is_closing():
            return
        if not self.in_request():
            if now - self.waiting_since > self.limits.header_timeout_s:
                transport.close()
                self._count("header_timeout")
            return
        cycle = self.cycle  # type: ignore[attr-defined]
        reading_body = cycle.more_body and not self.flow.read_paused  # type: ignore[attr-defined]
        if reading_body and now - self.last_data > self.limits.body_timeout_s:
            if not cycle.response_started:  # nothing went out yet: say why before closing (a client-side outcome)
                cycle.scope[BODY_TIMED_OUT] = True  # the app sees a disconnect; this tells it why (a 408)
                transport.write(_timed_out(self.limits.body_timeout_s))
            transport.close()
            self._count("body_timeout")

    @classmethod
    def _count(cls, what: str) -> None:
        GuardedProtocol.closed[what] += 1
        total = GuardedProtocol.closed[what]
        if total & (total - 1) == 0:  # 1, 2, 4, 8 ...: a flood logs a few lines, not one per connection
            log.warning("closed %d connection(s) so far: %s (%s)", total, what.replace("_", " "),
                        ", ".join(f"{k} {v}" for k, v in GuardedProtocol.closed.items()))


def guarded_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's HTTP protocol class (httptools' where installed, else h11's) with :class:`GuardedProtocol`
    bound to ``limits``: pass it as ``uvicorn.Config(http=...)``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools missing: the pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type("GuardedHTTPProtocol", (GuardedProtocol, base), {"limits": limits})


def sweep(connections: set[Any]) -> None:
    """Apply the timeouts to every guarded connection of a server (``server_state.connections``)."""
    now = time.monotonic()
    for connection in list(connections):
        if isinstance(connection, GuardedProtocol):
            connection.sweep(now)
