"""HTTP shapes of the OpenAI-compatible, native and tokenizer routes, in-process with a fake engine (the worker,
store and error mapping are the real ones)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.engine.params import MAX_STOP_STRINGS
from tests.support.apps import fake_app, sse_events
from tests.support.fake_engine import BOS, EOS, OFFSET


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(store_url=str(tmp_path_factory.mktemp("store")), block_length=4, default_max_tokens=16)
    with TestClient(fake_app(settings)) as c:
        yield c


def ids(text: str) -> list[int]:
    from tests.support.fake_engine import ALPHABET

    return [OFFSET + ALPHABET.index(ch) for ch in text]


def test_completion_text_usage_and_config(client):
    r = client.post("/v1/completions", json={"model": "fake-llada", "prompt": "hello", "max_tokens": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-llada"
    assert body["choices"] == [{"index": 0, "text": "olleh", "logprobs": None, "finish_reason": "stop"}]
    # BOS + 5 prompt tokens; 5 answer tokens + EOS.
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert body["kv_config"]["kv_quant"]["method"] == "none" and body["kv_config"]["source"] == "default"


@pytest.mark.parametrize(
    "prompt,texts",
    [(["ab", "xyz"], ["ba", "zyx"]), (ids("abc"), ["cba"]), ([ids("ab"), ids("cd")], ["ba", "dc"])],
)
def test_completion_prompt_forms(client, prompt, texts):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == texts


def test_max_tokens_is_a_hard_bound_and_stop_strings_never_leak(client):
    # max_tokens 5 with block_length 4 decodes 8 response positions, and returns 5 of them (issue 13; this test
    # asserted the old rule, all 8 positions "jihgfedc", before).
    r = client.post("/v1/completions", json={"prompt": "abcdefghij", "max_tokens": 5})
    assert r.json()["choices"][0] == {"index": 0, "text": "jihgf", "logprobs": None, "finish_reason": "length"}
    r = client.post("/v1/completions", json={"prompt": "abcdefghij", "max_tokens": 12, "stop": ["fe", "zz"]})
    assert r.json()["choices"][0]["text"] == "jihg" and r.json()["choices"][0]["finish_reason"] == "stop"


def test_chat_completion(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " tnatsissaih resu"}


def test_streaming_one_chunk_per_block_then_finish_usage_done(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "abcdefghij", "max_tokens": 12, "stream": True,
                                                       "stop": "dc", "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # 3 blocks of 4: "jihg", "fe" (the "dc" that follows is a stop string, held back and cut), then the finish,
    # then OpenAI's usage chunk with no choices.
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["jihg", "fe", "", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] == 11
    assert usage["total_tokens"] == 11 + usage["completion_tokens"] and 0 < usage["completion_tokens"] <= 12
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_no_usage_in_the_stream_unless_asked(client, options, route):
    body = {"prompt": "abcdefghij"} if route == "/v1/completions" else {"messages": [{"role": "user",
                                                                                     "content": "ab"}]}
    body |= {"max_tokens": 8, "stream": True} | ({} if options is None else {"stream_options": options})
    with client.stream("POST", route, json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events) > 2
    assert all("usage" not in c and c["choices"] for c in events[:-1])


@pytest.mark.parametrize("value", [1, 0, "true", "yes", [True]])
def test_include_usage_must_be_a_boolean(client, value):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "stream": True,
                                             "stream_options": {"include_usage": value}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_usage"


def test_chat_streaming_starts_with_role(client):
    with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}],
                                                            "max_tokens": 8, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"]["content"] or "" for e in events[1:-1]) == " tnatsis"
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


def test_native_generate_returns_the_report(client):
    r = client.post("/generate", json={"prompt": ids("abc"), "max_tokens": 4, "cache_mode": "prefix"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["rows"][0]["generated_ids"] == ids("cba") + [EOS]
    assert body["rows"][0]["text"] == "cba" and body["rows"][0]["nfe"] == 1
    assert body["params"]["gen_length"] == 4 and body["params"]["cache_mode"] == "prefix"
    assert body["kv_config"]["cache_mode"] == "prefix" and body["prompt_tokens"] == 3 and body["batch_size"] == 1


def test_models_and_tokenizer_endpoints(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-llada"
    tok = client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()
    assert tok == {"tokens": ids("ab"), "count": 2, "max_model_len": 512}
    assert client.post("/tokenize", json={"prompt": "ab"}).json()["tokens"] == [BOS] + ids("ab")
    # lm-eval's remote tokenizer with --apply_chat_template posts the chat history as the prompt: rendered through
    # the chat template as messages are (add_special_tokens does not apply to a template).
    chat = [{"role": "user", "content": "ab"}]
    as_prompt = client.post("/tokenize", json={"prompt": chat, "add_special_tokens": False})
    assert as_prompt.status_code == 200 and as_prompt.json() == client.post("/tokenize", json={"messages": chat}).json()
    assert as_prompt.json()["count"] > 2
    assert client.post("/detokenize", json={"tokens": ids("ab")}).json() == {"prompt": "ab"}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<eos>" and "messages" in info["chat_template"]


def test_health_ready_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/health/ready").status_code == 200
    assert "dllm_requests_total" in client.get("/metrics").text


BAD = [
    ({"prompt": "a", "n": 9}, "n"),  # over DLLM_MAX_N (8)
    ({"prompt": "a", "top_p": 0.5}, "top_p"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # generates nothing: only with echo
    ({"prompt": "a", "echo": True, "stream": True}, "echo"),
    ({"prompt": "a", "mc_num": 8}, "mc_num"),
    ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens"),  # OpenAI refuses numeric strings and booleans too
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "a" * 600, "max_tokens": 4}, "prompt"),
    ({"prompt": "a", "kv_quant": {"method": "gptq"}}, "kv_quant.method"),
    ({"prompt": "a", "kv_quant": {"method": "kivi", "bits": 3}}, "kv_quant.bits"),
    ({"prompt": "a", "kv_quant": {"method": "kivi", "bits": 4}, "cache_mode": "none"}, "cache_mode"),
    ({"prompt": "a", "kv_quant": {"method": "dllm_kvq", "policy_file": "/etc/passwd"}}, "kv_quant.policy_file"),
    ({"prompt": "a", "cache_mode": "triple"}, "cache_mode"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [], "max_tokens": 4}, "prompt"),
    ({"prompt": [5, 10**6]}, "prompt"),
    ({"prompt": [5, 127]}, "prompt"),  # the mask id (issue 12: param was null)
    ({"prompt": "a", "kv_quant": {"method": "dllm_kvq", "bits": 2, "policy_id": "0" * 64}}, "kv_quant.policy_id"),
    ({"prompt": "a", "model": "gpt-4"}, "model"),
    ({"prompt": "a", "steps": 3, "max_tokens": 8}, "steps"),
    ({"prompt": "a", "steps": 2, "threshold": 0.5, "max_tokens": 8}, "threshold"),
    ({"prompt": "a", "threshold": 1.5}, "threshold"),
]


@pytest.mark.parametrize("payload,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_input_is_a_400_naming_the_field(client, payload, param):
    r = client.post("/v1/completions", json=payload)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert set(err) == {"message", "type", "param", "code"}


def test_native_generate_names_an_unknown_field_even_when_it_looks_like_a_union_tag(client):
    r = client.post("/generate", json={"prompt": "hi", "stream": True, "max_tokens": 32})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream" and "'stream'" in r.json()["error"]["message"]


def test_malformed_json_and_unknown_route(client):
    r = client.post("/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_chat_bad_input(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function"


def test_admin_closed_without_key(client):
    r = client.get("/admin/policies")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


@pytest.mark.parametrize("extra,param", [
    ({"kv_quant": {"method": "kivi", "bits": 2, "k_group_size": 1_000_000_000}}, "kv_quant.k_group_size"),
    ({"kv_quant": {"method": "kivi", "bits": 2, "k_group_size": 1 << 20}}, "kv_quant.k_group_size"),  # > context
    ({"steps": 1_000_000_000, "threshold": None}, "steps"),
    ({"steps": 16, "threshold": None}, "steps"),  # more steps than the 8 response positions
    ({"block_length": 1 << 20}, "block_length"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"seed": 1 << 64}, "seed"),
    ({"temperature": 2.5}, "temperature"),
    ({"ignore_eos": 0}, "ignore_eos"),
    ({"max_tokens": 1.5}, "max_tokens"),
])
def test_cost_bounds_are_fast_400s_naming_the_field(client, extra, param):
    """Issue 13: every numeric field bounded by the model and the request, checked before admission."""
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 8, "block_length": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_integer_is_json_schemas_integer(client):
    """The document says ``integer``, and JSON Schema's integers include 8.0 (issue 13: the published type is the
    accepted one); "8" and true stay refused (BAD above)."""
    body = {"prompt": [10, 11], "max_tokens": 8.0, "block_length": 4.0, "seed": 3.0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_max_tokens_cut_of_only_the_closing_eos_finishes_with_stop_on_every_route(client, stream):
    """One cut, one finish_reason rule (issue 34): "hello" decodes to "olleh" + EOS; ``max_tokens`` 5 removes only
    the closing EOS, so the answer is the engine report's own ("stop", 5 tokens) on completions, chat and
    ``/generate``, streamed or not; ``max_tokens`` 4 removes a real token ("length")."""

    def completion(max_tokens: int) -> tuple[str, str, int]:
        body = {"prompt": "hello", "max_tokens": max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]
        events = sse_events(r.iter_lines())[:-1]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        reason = next(e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0][
            "finish_reason"])
        return text, reason, events[-1]["usage"]["completion_tokens"]

    assert completion(5) == ("olleh", "stop", 5)
    assert completion(4) == ("olle", "length", 4)
    # A chat answer whose closing EOS is decoded (inside the last block of 4: its length is not a multiple of 4).
    for content in ("hello", "hell", "hel"):
        messages = [{"role": "user", "content": content}]
        whole = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 128}).json()
        assert whole["choices"][0]["finish_reason"] == "stop"
        answer = whole["usage"]["completion_tokens"] - 1  # its tokens before the closing EOS
        if answer % 4:
            break
    edge = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": answer}).json()
    assert edge["choices"][0]["finish_reason"] == "stop" and edge["usage"]["completion_tokens"] == answer
    assert edge["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]
    if not stream:
        native = client.post("/generate", json={"prompt": ids("hello"), "max_tokens": 5}).json()
        assert native["rows"][0]["finish_reason"] == "stop" and len(native["rows"][0]["generated_ids"]) == 5
