"""Log-probabilities in OpenAI's shapes (issue 25): the engine's `TokenLogprob` entries of returned tokens (captured
at the step that revealed each one, `service.engine.decode.capture_logprobs`) and of scored prompt tokens
(`service.engine.likelihood`), as the legacy completions' ``logprobs`` object and as chat's ``logprobs.content``.

Kept apart from `service.api.serving` so that the answer-shaping there stays readable; the serving calls these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from service.api import schemas as s
from service.engine.report import TokenLogprob


def token_text(tokenizer: Any, token: int) -> str:
    """The text of one token as a client reads it (special tokens spelled out; ``<id>`` without a tokenizer)."""
    if tokenizer is None:
        return f"<{token}>"
    return tokenizer.decode([token])


def _alternatives(tokenizer: Any, entry: TokenLogprob, with_chosen: bool) -> dict[str, float]:
    """Alternatives by text; ``with_chosen`` adds the token itself, as OpenAI's legacy completions always do."""
    top = {token_text(tokenizer, t): v for t, v in entry.top}
    if with_chosen:
        top.setdefault(token_text(tokenizer, entry.token), entry.logprob)
    return top


def completion_logprobs(tokenizer: Any, generated: Sequence[TokenLogprob], prompt_ids: Sequence[int] | None = None,
                        prompt_scores: Sequence[TokenLogprob] | None = None, offset: int = 0
                        ) -> s.CompletionLogprobs:
    """The legacy ``logprobs`` of one choice.

    Args:
        tokenizer: for the token texts (None: ``<id>``).
        generated: the returned tokens' entries, in order.
        prompt_ids, prompt_scores: with an echo, the prompt's ids and the values of its tokens 1.. (token 0 gets
            None); the alternatives of a prompt token are the first reveal step's, without the token itself (its
            value is an ELBO increment, not one of theirs).
        offset: the character offset of the first token in the choice's text.
    """
    tokens, values, tops = [], [], []
    if prompt_ids is not None:
        scores = list(prompt_scores or ())
        tokens += [token_text(tokenizer, t) for t in prompt_ids]
        values += [None] + [e.logprob for e in scores]
        tops += [None] + [_alternatives(tokenizer, e, with_chosen=False) for e in scores]
    tokens += [token_text(tokenizer, e.token) for e in generated]
    values += [e.logprob for e in generated]
    tops += [_alternatives(tokenizer, e, with_chosen=True) for e in generated]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return s.CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(tokenizer: Any, generated: Sequence[TokenLogprob]) -> s.ChatLogprobs:
    """Chat's ``logprobs`` of the returned tokens (``bytes``: the UTF-8 of each token's text)."""

    def entry(token: int, value: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return s.ChatLogprobs(content=[
        s.ChatTokenLogprob(**entry(e.token, e.logprob), top_logprobs=[s.TopLogprob(**entry(t, v)) for t, v in e.top])
        for e in generated])


def tokens_within(decode: Callable[[list[int]], str | None], ids: Sequence[int], chars: int) -> int:
    """How many leading ``ids`` have their whole text within the first ``chars`` characters (a stream sends a
    token's log-probability with the chunk that completes its text; its text is monotone in the prefix)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(decode(list(ids[:mid])) or "") <= chars:
            lo = mid
        else:
            hi = mid - 1
    return lo
