"""A daemon thread that pings the store, so ``dllm_store_up`` follows the connection with no admin traffic, and
(given the server's `ActiveConfigs.poll`) reloads when the store's version is not the one applied: a replica
converges on the newest version even when it missed events (issue 22).

Without it the gauge changed only when an admin call or a reload touched the store: Redis stopped for 20 s left
it at 1 and the store-down alert could never fire. Each ping is bounded by the backend's socket timeouts
(`service.store.redis_store`: 2 s to connect, one quick retry), so with the default interval of 2 s an outage
shows within about 7 s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from service.store.base import Store, StoreAccessDenied, StoreUnavailable
from service.telemetry import Telemetry

log = logging.getLogger(__name__)


class StoreMonitor:
    """Pings ``store`` every ``interval_s`` seconds (first at once) and sets ``telemetry.store_up`` to the answer.

    Args:
        store: any backend (:meth:`Store.ping` raises :class:`StoreUnavailable` when it cannot answer).
        telemetry: owner of ``dllm_store_up``.
        interval_s: seconds between pings.
        check: what each round calls instead of ``store.ping`` (raising StoreUnavailable / StoreAccessDenied).
    """

    def __init__(self, store: Store, telemetry: Telemetry, interval_s: float,
                 check: Callable[[], None] | None = None) -> None:
        self._store = store
        self._check = check or store.ping
        self._telemetry = telemetry
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dllm-kvq-store-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        up: bool | None = None
        while not self._stop.is_set():
            try:
                self._check()
                now_up = True
            except (StoreUnavailable, StoreAccessDenied) as exc:
                now_up = False
                if up is not False:
                    log.warning("store unreachable: %s", exc)
            except Exception:  # a reload that failed otherwise must not end the monitoring
                now_up = True
                log.exception("store check failed")
            if now_up and up is False:
                log.info("store answers again")
            up = now_up
            self._telemetry.store_up.set(1 if up else 0)
            self._stop.wait(self._interval_s)

    def close(self) -> None:
        """Stop pinging (waits for a ping in progress, bounded by the socket timeouts)."""
        self._stop.set()
        self._thread.join(timeout=10)
