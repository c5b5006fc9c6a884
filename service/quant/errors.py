"""Typed errors of the KV quantizers (all ``ValueError``: bad input at the quantizer boundary)."""

from __future__ import annotations


class KVQuantError(ValueError):
    """A quantizer was given something it cannot quantize; the message says what is legal, ``field`` names the
    offending `KVQuantConfig` field (or ``cache_mode``) when one is at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NonFiniteKVError(KVQuantError):
    """NaN or +/-inf in the K or V to be quantized (never turned into a silent zero or a corrupted neighbour)."""
