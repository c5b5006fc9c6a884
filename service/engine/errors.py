"""Typed errors of the engine boundary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: What pydantic puts before the message of a ValueError or AssertionError raised in a validator: noise to the reader
#: of an error ("kv_quant.method: Value error, unknown method 'bogus'", issue 45).
PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def validation_message(error: Mapping[str, Any]) -> str:
    """The message of one pydantic error (an item of ``ValidationError.errors()``) without pydantic's prefix."""
    message = str(error.get("msg", ""))
    for prefix in PYDANTIC_PREFIXES:
        message = message.removeprefix(prefix)
    return message


class EngineInputError(ValueError):
    """A request or load argument the engine cannot accept; the message says what is legal.

    Raised before any work starts (nothing half-written). ``field`` names the offending input (a `DecodeParams`
    or `RowOptions` field, or ``prompt``; None when no single field is at fault); the API maps the error to
    HTTP 400 with that ``param``, the CLI to exit code 2.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class GrammarLaneFull(RuntimeError):
    """The large-grammar compile lane has its most compiles waiting (`service.engine.grammar.LARGE_LANE_QUEUE`):
    retry after ``retry_after_s`` seconds. The API maps it to HTTP 429 (the request was fine; the server is busy),
    ``field`` naming the grammar's request field."""

    def __init__(self, message: str, field: str | None, retry_after_s: int) -> None:
        super().__init__(message)
        self.field, self.retry_after_s = field, retry_after_s
