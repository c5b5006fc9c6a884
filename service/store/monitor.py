"""A daemon thread that pings the store, so ``dllm_store_up`` follows the connection with no admin traffic.

Without it the gauge changed only when an admin call or a reload touched the store: Redis stopped for 20 s left
it at 1 and the store-down alert could never fire. Each ping is bounded by the backend's socket timeouts
(`service.store.redis_store`: 2 s to connect, one quick retry), so with the default interval of 2 s an outage
shows within about 7 s.
"""

from __future__ import annotations

import logging
import threading

from service.store.base import Store, StoreUnavailable
from service.telemetry import Telemetry

log = logging.getLogger(__name__)


class StoreMonitor:
    """Pings ``store`` every ``interval_s`` seconds (first at once) and sets ``telemetry.store_up`` to the answer.

    Args:
        store: any backend (:meth:`Store.ping` raises :class:`StoreUnavailable` when it cannot answer).
        telemetry: owner of ``dllm_store_up``.
        interval_s: seconds between pings.
    """

    def __init__(self, store: Store, telemetry: Telemetry, interval_s: float) -> None:
        self._store = store
        self._telemetry = telemetry
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dllm-kvq-store-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        up: bool | None = None
        while not self._stop.is_set():
            try:
                self._store.ping()
                now_up = True
            except StoreUnavailable as exc:
                now_up = False
                if up is not False:
                    log.warning("store unreachable: %s", exc)
            if now_up and up is False:
                log.info("store answers again")
            up = now_up
            self._telemetry.store_up.set(1 if up else 0)
            self._stop.wait(self._interval_s)

    def close(self) -> None:
        """Stop pinging (waits for a ping in progress, bounded by the socket timeouts)."""
        self._stop.set()
        self._thread.join(timeout=10)
