"""`cut_response`: the one rule that turns a row's decoded response positions into what a client gets back.

Used by the engine's report (`Engine.generate`, hence the ``generate`` CLI and the lm-eval model), the decode
loop's per-block ids, and the server (completions, chat, ``/generate``; streamed and not). The rule, OpenAI's
(``max_tokens`` is a hard upper bound; ``usage.completion_tokens`` counts the tokens returned):

1. At most ``max_tokens`` tokens are kept: decoding runs in whole blocks (`service.engine.params.response_length`),
   the response is cut back.
2. Unless ``ignore_eos``, the response ends at the first EOS (the EOS is a returned token, its text is empty).
3. The text ends before the earliest stop string; the tokens returned run up to the one that completed it.

``finish_reason`` is ``stop`` at an EOS or a stop string (also when the ``max_tokens`` cut removed only an EOS
that ended the response), else ``length`` (the cut removed other tokens, or ``ignore_eos`` ran to the end).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Cut:
    """A cut response.

    Attributes:
        ids: the token ids returned (an ending EOS included; ``len(ids)`` is ``usage.completion_tokens``).
        text: their text (special tokens skipped, stop string excluded), or None without a decoder.
        finish_reason: ``stop`` or ``length`` (module docstring).
    """

    ids: list[int]
    text: str | None
    finish_reason: Literal["stop", "length"]


def first_stop(text: str, stops: Iterable[str]) -> int:
    """Index in ``text`` of the earliest occurrence of any non-empty stop string, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def cut_response(
    ids: Sequence[int],
    eos_ids: Iterable[int],
    ignore_eos: bool = False,
    max_tokens: int | None = None,
    stops: Sequence[str] = (),
    decode: Callable[[list[int]], str | None] | None = None,
) -> Cut:
    """Cut decoded response ids at ``max_tokens``, EOS and the first stop string (module docstring).

    Args:
        ids: response token ids in position order (a prefix of the window while decoding runs).
        eos_ids: the model's EOS ids.
        ignore_eos: keep tokens after an EOS (EOS text is empty when decoded without special tokens).
        max_tokens: the most tokens returned; None: no bound.
        stops: stop strings (empty ones are ignored).
        decode: ids -> text (special tokens skipped), or None (or returning None: no text, and stop strings
            cannot apply).

    Returns:
        The :class:`Cut`.
    """
    ids = list(ids)
    kept = ids if max_tokens is None else ids[:max_tokens]
    eos = set(eos_ids)
    ended = False
    if not ignore_eos:
        at = next((i for i, token in enumerate(kept) if token in eos), None)
        if at is not None:
            kept, ended = kept[: at + 1], True
        elif len(kept) < len(ids) and ids[len(kept)] in eos:
            ended = True  # the max_tokens cut removed only the EOS that ended the response
    text = decode(kept) if decode is not None else None
    if text is None:  # no tokenizer: ids only, stop strings cannot apply
        return Cut(kept, None, "stop" if ended else "length")
    at = first_stop(text, stops)
    if at < 0:
        return Cut(kept, text, "stop" if ended else "length")
    # The tokens returned run up to the one that completed a stop string: the shortest prefix whose text already
    # holds one (monotone in the prefix length, so bisect).
    lo, hi = 1, len(kept)
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(decode(kept[:mid]) or "", stops) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return Cut(kept[:lo], text[:at], "stop")
