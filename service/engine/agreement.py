"""How close two outputs of the same request are: token agreement and exact match (DESIGN.md "Words").

One definition for the server's shadow re-decodes (`service.telemetry`) and the evaluation matrix
(`evaluation.matrix`), which compare a quantized output with the unquantized one of the same cache mode.
"""

from __future__ import annotations

from collections.abc import Sequence


def token_agreement(served: Sequence[int], reference: Sequence[int]) -> float:
    """Share of response positions, up to the longer of the two (already EOS-cut) outputs, with equal tokens.

    DESIGN.md "Words: token agreement". Two empty outputs agree fully (1.0).
    """
    length = max(len(served), len(reference))
    if length == 0:
        return 1.0
    same = sum(1 for a, b in zip(served, reference) if a == b)
    return same / length


def exact_match(served_text: str, reference_text: str) -> bool:
    """Equal text (DESIGN.md "Words: exact match")."""
    return served_text == reference_text
