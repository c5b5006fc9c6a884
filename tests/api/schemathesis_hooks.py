"""Schemathesis hooks for `tests/api/test_schemathesis.py` (loaded through ``SCHEMATHESIS_HOOKS``).

One filter: the schema-valid (positive) cases that break a rule the OpenAPI document cannot state, each filtered by
restating the rule here from the server's settings (``DLLM_ST_SERVER``, JSON written by the test: URL, context,
decoding defaults, work ceiling), never by asking the server whether it accepts the request. Token counts come from
the server's own tokenizer (``POST /tokenize``: the prompt's ids, as the generation routes encode them). Negative
cases are never filtered. The rules, named again at each check:

* ``context``: the prompt's tokens + the response positions (``max_tokens`` rounded up to whole blocks) fit the
  model's context, and a text prompt encodes to at least one token (tokens, not characters, count);
* ``schedule``: ``steps`` is a multiple of the number of blocks and at most the response positions;
* ``work``: forward calls (``steps``, else the response positions) x (prompt + response positions) is within the
  server's ``max_request_work``;
* ``grammar``: a structured-output field (``response_format`` json_schema, ``structured_outputs``, ``guided_*``)
  holds a schema or regex the grammar engine compiles (restated by compiling it with llguidance, the engine's
  library, without the server's tokenizer: `service.engine.grammar`);
* ``tools``: chat's tool fields as `service.api.tools` states them beyond the schema (unique names, a named
  ``tool_choice`` among the tools, object schemas with a finite value that compile, no structured-output field
  beside a ``tool_choice`` other than none, a conversation's call arguments the JSON text of an object, on
  ``/tokenize`` too, with its ``tools``), restated with that module's own checks and llguidance (as ``grammar``);
* ``choices``: each of the ``n`` choices costs the work above (the ceiling holds for their sum);
* ``likelihood``: a completion with ``echo`` and ``logprobs`` scores every prompt token: ``(T - 1) x (mc_num + 1)
  x T`` token-forwards within ``max_request_work``, and ``mc_num`` a multiple of the server's Monte-Carlo batch
  when above it;
* ``top_logprobs``: chat's ``top_logprobs`` needs ``logprobs`` = true;
* ``mask``: a text prompt (taken as written, special tokens included) does not hold the mask token's text (the mask
  is never input; chat content is tokenized as text and may);
* ``activation``: ``PUT /admin/active/none`` takes no quantizing method (a path parameter against the body);
* ``key_bias``: a ``kv_quant`` (a request's, a score report's, or an activation body) with ``key_bias_correction`` on quantizes keys:
  a method other than ``none``, sides ``kv`` or ``k`` (`service.quant.config.KVQuantConfig`);
* ``cache_mode``: ``block`` is the block-causal families' cache mode (LLaDA2); the suite's server runs the embedded
  model (LLaDA's layout), which refuses it naming ``cache_mode``;
* ``upload``: an uploaded artifact is a policy table or KVQuant state fitted to the loaded model (content JSON
  Schema cannot describe: safetensors bytes, layer and head counts); uploads are tested with real artifacts in
  ``tests/api/test_keys_and_admin_api.py``.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any

import httpx
import schemathesis

from service.runtime.scheduler import FORWARD_FLOOR_TOKENS

GENERATION = {"/v1/completions", "/v1/chat/completions", "/generate"}


@lru_cache(maxsize=1)
def _server() -> dict[str, Any]:
    return json.loads(os.environ["DLLM_ST_SERVER"])


@lru_cache(maxsize=4096)
def _count(request: str) -> int:
    """Token count of a ``/tokenize`` request (JSON text)."""
    r = httpx.post(_server()["url"] + "/tokenize", content=request, headers={"content-type": "application/json"},
                   timeout=30)
    r.raise_for_status()  # a text the tokenizer refuses would be a rule this module does not know yet
    return r.json()["count"]


def _tokens(value: Any, key: str = "prompt") -> int:
    return _count(json.dumps({key: value}, sort_keys=True))


def _prompt_lengths(path: str, body: dict[str, Any]) -> list[int]:
    """Tokens of each prompt of a generation request, as the route encodes it."""
    if path == "/v1/chat/completions":  # its tools are rendered into the prompt, as /tokenize renders them
        return [_count(json.dumps({"messages": body["messages"], "tools": body.get("tools") or None},
                                  sort_keys=True))]
    prompt = body["prompt"]
    if isinstance(prompt, str):
        chat = path == "/generate" and body.get("chat")
        return [_tokens([{"role": "user", "content": prompt}], "messages") if chat else _tokens(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [_tokens(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [len(p) for p in prompt]
    return [len(prompt)]


def _given(body: dict[str, Any], *names: str) -> Any:
    for name in names:
        if body.get(name) is not None:
            return body[name]
    return None


def _grammar_compiles(body: dict[str, Any]) -> bool:
    """Rule "grammar": the request's structured-output source, if any, compiles."""
    import llguidance

    from service.api.schemas import ChatCompletionRequest
    from service.engine.errors import EngineInputError

    try:
        spec = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                     **{k: body[k] for k in ("response_format", "structured_outputs",
                                                                             "guided_json", "guided_regex",
                                                                             "guided_choice") if k in body}}
                                                    ).grammar_spec()
        if spec is None:
            return True
        return not llguidance.LLMatcher.validate_grammar(spec.grammar())
    except (EngineInputError, ValueError):
        return False


def _tools_fit(body: dict[str, Any]) -> bool:
    """Rule "tools" (module docstring)."""
    import llguidance

    from service.api.schemas import ChatCompletionRequest
    from service.api.structured import CONSTRAINT_FIELDS
    from service.api.tools import conversation_calls
    from service.engine.errors import EngineInputError

    fields = ("tools", "tool_choice", "parallel_tool_calls", *CONSTRAINT_FIELDS)
    try:
        req = ChatCompletionRequest.model_validate({"messages": body["messages"],
                                                    **{k: body[k] for k in fields if k in body}})
        for i, m in enumerate(req.messages):
            conversation_calls(m.tool_calls, f"messages.{i}.tool_calls")
        tools = req.tool_request(next((f for f in CONSTRAINT_FIELDS if req._constrains(f)), None))
        spec = tools.grammar_spec() if tools is not None else None
        return spec is None or not llguidance.LLMatcher.validate_grammar(spec.grammar())
    except (EngineInputError, ValueError):
        return False


def _conversation_fits(body: dict[str, Any]) -> bool:
    """Rule "tools" on ``/tokenize``: the calls of a conversation (``messages``, or a ``prompt`` of messages) and
    the tools it offers."""
    from service.api.schemas import TokenizeRequest
    from service.api.tools import conversation_calls
    from service.engine.errors import EngineInputError

    try:
        req = TokenizeRequest.model_validate(body)
    except ValueError:
        return True  # refused by the schema's own rules: not a positive case this rule decides
    messages = req.prompt if isinstance(req.prompt, list) else req.messages or []
    try:
        for i, m in enumerate(messages):
            conversation_calls(m.tool_calls, f"messages.{i}.tool_calls")
        req.offered()
    except EngineInputError:
        return False
    return True


def _likelihood_fits(body: dict[str, Any]) -> bool:
    """Rule "likelihood" (module docstring)."""
    server = _server()
    mc_num = int(body.get("mc_num") or server["mc_num"])
    batch = min(server["mc_batch_size"], mc_num)
    if mc_num % batch:
        return False
    return all(tokens >= 1 and (server["max_work"] is None
                                or (tokens - 1) * (mc_num + 1) * tokens <= server["max_work"])
               for tokens in _prompt_lengths("/v1/completions", body))


def _key_bias_fits(kv: Any) -> bool:
    """Rule "key_bias": the correction needs quantized keys."""
    if not isinstance(kv, dict) or kv.get("key_bias_correction") is not True:
        return True
    return kv.get("method", "none") != "none" and kv.get("sides", "kv") in ("kv", "k")


def _generation_fits(path: str, body: dict[str, Any]) -> bool:
    server = _server()
    if body.get("cache_mode") == "block" or not _key_bias_fits(body.get("kv_quant")):
        return False  # rules "cache_mode" and "key_bias"
    if not _grammar_compiles(body):
        return False
    if path == "/v1/chat/completions" and not _tools_fit(body):
        return False
    if path != "/v1/chat/completions" and not (path == "/generate" and body.get("chat")):
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt or [] if isinstance(p, str)]
        if any(server["mask_text"] in text for text in texts):
            return False  # rule "mask"
    if path == "/v1/chat/completions" and body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        return False  # rule "top_logprobs"
    if path == "/v1/completions" and body.get("echo") is True:
        if body.get("logprobs") is not None and not _likelihood_fits(body):
            return False
        if body.get("max_tokens") == 0:  # nothing generated: the prompts only
            return all(1 <= t <= server["context"] for t in _prompt_lengths(path, body))
    max_tokens = int(_given(body, "max_completion_tokens", "max_tokens") or server["max_tokens"])
    block = int(_given(body, "block_length") or server["block_length"])
    response = -(-max_tokens // block) * block
    # The schedule is one choice: named in the request, both fields come from it.
    named = _given(body, "threshold", "steps") is not None
    steps = _given(body, "steps") if named else server["steps"]
    # Rule "schedule": steps a multiple of the number of blocks, at most one token revealed per step.
    if steps is not None and (int(steps) % (response // block) or int(steps) > response):
        return False
    for tokens in _prompt_lengths(path, body):
        # Rule "context": at least one prompt token, and prompt + response positions within the context.
        if tokens < 1 or tokens + response > server["context"]:
            return False
        # Rule "work": the request's token-forwards within the server's ceiling (if it has one).
        calls = int(steps) if steps is not None else response
        choices = int(body.get("n") or 1)  # rule "choices"
        held = max(tokens + response, FORWARD_FLOOR_TOKENS)  # a call's tokens, at least its fixed cost
        if server["max_work"] is not None and calls * held * choices > server["max_work"]:
            return False
    return True


@schemathesis.hook
def filter_case(context, case) -> bool:
    """Keep every case but the positive ones that break a rule of the module docstring."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return True
    path, method = case.operation.path, case.operation.method.lower()
    body = case.body if isinstance(case.body, dict) else None
    if body is not None and not _key_bias_fits(body.get("kv_quant")):
        return False  # rule "key_bias" (a generation request's, an evaluation score report's)
    if path in GENERATION and body is not None:
        return _generation_fits(path, body)
    if path == "/tokenize" and body is not None:
        return _conversation_fits(body)
    if path == "/admin/active/{cache_mode}" and body is not None:
        # Rule "activation": cache mode none reuses nothing to quantize.
        if not _key_bias_fits(body):
            return False  # rule "key_bias"
        return not (case.path_parameters.get("cache_mode") == "none" and body.get("method", "none") != "none")
    return not (path == "/admin/{kind}" and method == "post")  # rule "upload"
