"""Typed errors of the engine boundary."""

from __future__ import annotations


class EngineInputError(ValueError):
    """A request or load argument the engine cannot accept; the message says what is legal.

    Raised before any work starts (nothing half-written). ``field`` names the offending input (a `DecodeParams`
    or `RowOptions` field, or ``prompt``; None when no single field is at fault); the API maps the error to
    HTTP 400 with that ``param``, the CLI to exit code 2.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
