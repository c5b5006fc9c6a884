"""Prompt encoding and the chat template, in one place (server, ``generate`` CLI, lm-eval model, calibration,
examples).

A chat prompt is the tokenizer's own chat template (HF ``apply_chat_template``) with the assistant generation
prompt added; rendering it as text and encoding that text without added special tokens gives the same ids
(lm-eval's ``--apply_chat_template`` path relies on it). ``developer`` turns are sent as ``system`` (OpenAI's
newer name for it; the models' templates know only ``system``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from service.engine.errors import EngineInputError

Message = dict[str, str]


def _need(tokenizer: Any, model_id: str, chat: bool, field: str) -> None:
    if tokenizer is None:
        raise EngineInputError(f"{model_id} has no tokenizer files; pass token ids instead of text", field)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise EngineInputError(f"{model_id} has no chat template; send plain text instead", field)


def _unicode(text: str, field: str) -> str:
    # JSON may escape a lone UTF-16 surrogate ("\ud800"): a Python str, but no Unicode text, so the tokenizer
    # (Rust) cannot take it; refuse it by name instead of failing inside the tokenizer.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EngineInputError(f"{field} is not valid Unicode: a lone surrogate at character {exc.start}",
                               field) from None
    return text


def _turns(messages: Sequence[Message]) -> list[Message]:
    if not messages:
        raise EngineInputError("messages is empty; give at least one message", "messages")
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), str):
            _unicode(m["content"], f"messages.{i}.content")
    return [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]


def encode_text(tokenizer: Any, text: str, model_id: str, add_special_tokens: bool | None = None,
                field: str = "prompt") -> list[int]:
    """Token ids of plain ``text`` (the tokenizer's default special tokens unless ``add_special_tokens`` says).

    Raises:
        EngineInputError: no tokenizer, or text with a lone surrogate (``field`` names the request field).
    """
    _need(tokenizer, model_id, False, field)
    _unicode(text, field)
    # verbose=False: the tokenizer warns about sequences past its model_max_length; the engine checks the context
    # itself and answers such a request with a 400 naming the field, so the warning is only noise in the log.
    if add_special_tokens is None:
        return list(tokenizer(text, verbose=False)["input_ids"])
    return list(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])


def encode_chat(tokenizer: Any, messages: Sequence[Message], model_id: str, add_generation_prompt: bool = True,
                field: str = "messages") -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}]``) through the chat template.

    Raises:
        EngineInputError: no tokenizer, no chat template, no messages, or text with a lone surrogate.
    """
    _need(tokenizer, model_id, True, field)
    return token_ids(tokenizer.apply_chat_template(_turns(messages), add_generation_prompt=add_generation_prompt,
                                                   tokenize=True, tokenizer_kwargs={"verbose": False}))


def token_ids(encoded: Any) -> list[int]:
    """The ids of one sequence from ``apply_chat_template(tokenize=True)``: transformers 4 returns them as a list,
    transformers 5 a `BatchEncoding` (a mapping whose ``input_ids`` holds them, beside ``attention_mask``)."""
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def render_chat(tokenizer: Any, messages: Sequence[Message], model_id: str, add_generation_prompt: bool = True
                ) -> str:
    """``messages`` through the chat template as text; without a generation prompt the last message is
    continued (lm-eval's multi-turn few-shot convention).

    Raises:
        EngineInputError: no tokenizer, no chat template, no messages, or text with a lone surrogate.
    """
    _need(tokenizer, model_id, True, "messages")
    return tokenizer.apply_chat_template(_turns(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=not add_generation_prompt)


def encode_prompt(tokenizer: Any, text: str, model_id: str, chat: bool) -> list[int]:
    """Token ids of one prompt text; with ``chat`` it is one user turn through the chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": _unicode(text, "prompt")}], model_id,
                           field="prompt")
    return encode_text(tokenizer, text, model_id)
