"""Wait for something that must happen, with a generous deadline that only guards a hang.

A test on a loaded, shared machine must not fail because a correct server was slow: a fixed ``time.sleep`` before
an assertion, or a deadline of a few seconds, is a wall-clock bound in disguise. :func:`until` polls instead, and
fails only when the condition has not held for ``timeout_s`` (30 s by default), i.e. when it never happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def until(condition: Callable[[], T], what: str, timeout_s: float = 30.0, interval_s: float = 0.1) -> T:
    """Poll ``condition()`` every ``interval_s`` seconds until it returns a truthy value, and return that value.

    Fails the test (``pytest.fail``, naming ``what``) when it has not within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:g} s (a hang guard): {what}")
        time.sleep(interval_s)
