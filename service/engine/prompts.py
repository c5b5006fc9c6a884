"""Prompt encoding and the chat template, in one place (server, ``generate`` CLI, lm-eval model, calibration,
examples).

A chat prompt is the tokenizer's own chat template (HF ``apply_chat_template``) with the assistant generation
prompt added; rendering it as text and encoding that text without added special tokens gives the same ids
(lm-eval's ``--apply_chat_template`` path relies on it). ``developer`` turns are sent as ``system`` (OpenAI's
newer name for it; the models' templates know only ``system``).

**Control tokens come from the template only** (issue 25; vLLM PR #31735, transformers#29279): text in a message's
content that spells a special token (``<|eot_id|><|start_header_id|>assistant...``, ``<|startoftext|>``,
``<|mdm_mask|>``) is tokenized as text, so a client cannot forge a turn, a BOS or a mask. Messages without such
text give exactly the template's ids as before; with it, the template is rendered around markers that stand for
the special texts of the content, split at the template's own control tokens, and each piece between them is
encoded with the specials of the content as text (:func:`encode_as_text`). A template that knows tools also writes
the tools (names, descriptions, schemas) and the calls' arguments: their strings are marked the same way. ``special_in_content=True`` keeps the
old behaviour (the server's ``DLLM_ALLOW_SPECIAL_TOKENS_IN_CONTENT``).
"""

from __future__ import annotations

import re
import uuid
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


def special_texts(tokenizer: Any) -> list[str]:
    """The texts of the tokenizer's special tokens (its named ones and every added token marked special), longest
    first (so a regex alternation prefers the longest match)."""
    texts = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    texts |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
              if getattr(t, "special", False)}
    return sorted((t for t in texts if t), key=len, reverse=True)


def encode_as_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (no added BOS/EOS) with every special token's spelling tokenized as plain text.

    transformers' ``split_special_tokens=True`` does it where the installed version honours it (fast tokenizers:
    4.45 and later, checked here by the result); otherwise each special spelling is encoded in two pieces (its
    first character, the rest), neither of which is a special token.
    """
    specials = special_texts(tokenizer)
    special_ids = {tokenizer.convert_tokens_to_ids(t) for t in specials}
    try:
        ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"])
    except TypeError:  # a tokenizer whose call does not take the argument
        ids = None
    if ids is not None and not special_ids.intersection(ids):
        return ids
    pattern = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
    out: list[int] = []
    for piece in pattern.split(text):
        parts = (piece[:1], piece[1:]) if piece in specials else (piece,)
        for part in parts:
            if part:
                out += tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"]
    return out


def _strings(value: Any) -> list[str]:
    """Every string in ``value`` (a message, a tool: nested dicts and lists), dict keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _mark(value: Any, sub: Any) -> Any:
    """``value`` with ``sub`` applied to every string in it (dict keys included), except a message's ``role``."""
    if isinstance(value, str):
        return sub(value)
    if isinstance(value, Mapping):
        return {sub(k) if isinstance(k, str) else k: v if k == "role" else _mark(v, sub) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mark(v, sub) for v in value]
    return value


def _content_specials(tokenizer: Any, turns: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None
                      ) -> list[str]:
    """The special-token texts that occur in some message's text (its content, and the tool calls a template that
    knows tools renders) or in a tool the template renders (names, descriptions, schemas)."""
    texts = _strings([{k: v for k, v in m.items() if k != "role"} for m in turns]) + _strings(list(tools or ()))
    return [t for t in special_texts(tokenizer) if any(t in c for c in texts)]


def _encode_chat_content_as_text(tokenizer: Any, turns: list[Message], add_generation_prompt: bool,
                                 found: list[str], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """The template's ids with the special texts ``found`` in the contents tokenized as text (module docstring)."""
    tag = uuid.uuid4().hex  # markers no content can already hold
    spelled = re.compile("|".join(map(re.escape, found)))
    def sub(text: str) -> str:
        return spelled.sub(lambda mt: f"\ue000{tag}{found.index(mt.group())}\ue001", text)

    # Every string a template may write is marked: contents, and a template that knows tools also writes the
    # tools' names, descriptions and schemas and the calls' arguments.
    marked = _mark(turns, sub)
    rendered = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **_tools_kwarg(_mark(tools, sub) if tools else tools))
    controls = special_texts(tokenizer)
    unmark = re.compile(f"\ue000{tag}(\\d+)\ue001")
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, controls)) + ")", rendered):
        if piece in controls:  # a control token of the template itself
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            ids += encode_as_text(tokenizer, unmark.sub(lambda mt: found[int(mt.group(1))], piece))
    return ids


def encode_chat(tokenizer: Any, messages: Sequence[Message], model_id: str, add_generation_prompt: bool = True,
                field: str = "messages", special_in_content: bool = False,
                tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}]``) through the chat template; special-token text in a
    content is tokenized as text unless ``special_in_content`` (module docstring). ``tools`` (OpenAI's ``tools``
    items) are handed to a template that takes them (:func:`knows_tools`); otherwise the caller writes them into
    the turns (`service.engine.tool_format.generic_turns`).

    Raises:
        EngineInputError: no tokenizer, no chat template, no messages, or text with a lone surrogate.
    """
    _need(tokenizer, model_id, True, field)
    turns = _turns(messages)
    found = [] if special_in_content else _content_specials(tokenizer, turns, tools)
    if found:
        return _encode_chat_content_as_text(tokenizer, turns, add_generation_prompt, found, tools)
    return token_ids(tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt,
                                                   tokenize=True, tokenizer_kwargs={"verbose": False},
                                                   **_tools_kwarg(tools)))


def knows_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template renders ``tools`` (it reads a variable of that name, as the
    templates of Qwen2.5, Llama 3.1 and Hermes do); LLaDA's, Dream's and the embedded model's do not."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _tools_kwarg(tools: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    # Only when there are tools: a tokenizer without tool support need not take the argument.
    return {"tools": list(tools)} if tools else {}


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


def encode_prompt(tokenizer: Any, text: str, model_id: str, chat: bool, special_in_content: bool = False
                  ) -> list[int]:
    """Token ids of one prompt text; with ``chat`` it is one user turn through the chat template (its special-token
    text tokenized as text unless ``special_in_content``, as :func:`encode_chat`)."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": _unicode(text, "prompt")}], model_id,
                           field="prompt", special_in_content=special_in_content)
    return encode_text(tokenizer, text, model_id)
