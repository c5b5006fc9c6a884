"""Typed errors of the engine boundary."""

from __future__ import annotations


class EngineInputError(ValueError):
    """A request or load argument the engine cannot accept; the message says what is legal.

    Raised before any work starts (nothing half-written). The API maps it to HTTP 400 and the CLI to exit code 2.
    """
