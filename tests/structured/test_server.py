"""Structured output through a real server (``python -m service serve``, the embedded model) and the official
openai client: ``chat.completions.parse`` with a pydantic model, a streamed JSON schema, vLLM's fields on
completions under each cache mode, a schema that cannot compile (400 naming the field), and a ``max_tokens`` too
short for any valid output (a 400 naming ``max_tokens``, issue 45)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DIGITS = "4 1 4 4 2 9 7 4 3 2 8 3 3 8 5 9 9 6 6 4 8 5 6 3 6 6 3 5 5 2 2 1 8 6 7 1 1 9 9 1 8 7 2 7 7 3 4 8"
LEDGER = r"( [0-9]){48}"


class Ledger(BaseModel):
    op: Literal["copy", "next", "sum"]
    digits: Annotated[list[Annotated[int, Field(ge=0, le=9)]], Field(min_length=1, max_length=4)]
    ok: bool


@pytest.fixture(scope="module")
def server(shared_embedded_server):
    return shared_embedded_server  # tests/conftest.py: one embedded server for the session


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_parse_with_a_pydantic_model_and_streamed(client):
    messages = [{"role": "user", "content": f"copy: {DIGITS}"}]
    done = client.chat.completions.parse(model="embedded", messages=messages, response_format=Ledger, max_tokens=64)
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(done.choices[0].message.parsed, Ledger)

    # Strict as OpenAI defines it (and as `parse` sends it): no property beyond the model's. Without
    # additionalProperties false the grammar allows more keys after `ok`, and this model, which knows only digits,
    # writes one until max_tokens.
    strict = {**Ledger.model_json_schema(), "additionalProperties": False}
    schema = {"type": "json_schema", "json_schema": {"name": "ledger", "schema": strict, "strict": True}}
    chunks = list(client.chat.completions.create(model="embedded", messages=messages, response_format=schema,
                                                 max_tokens=64, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Ledger.model_validate_json(text)


@pytest.mark.parametrize("cache_mode", ["none", "prefix", "dual"])
def test_vllm_fields_on_completions(client, cache_mode):
    extra = {"cache_mode": cache_mode}
    regex = client.completions.create(model="embedded", prompt=f"next: {DIGITS}", max_tokens=64,
                                      extra_body={**extra, "structured_outputs": {"regex": LEDGER}})
    assert regex.choices[0].finish_reason == "stop" and re.fullmatch(LEDGER, regex.choices[0].text)
    choice = client.completions.create(model="embedded", prompt="sum: 1 2", max_tokens=8,
                                       extra_body={**extra, "guided_choice": ["copy", "next", "sum"]})
    assert choice.choices[0].text in ("copy", "next", "sum")
    chat = client.chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "copy: 1 2"}], max_tokens=32,
        extra_body={**extra, "guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9}},
                                             "required": ["n"], "additionalProperties": False}})
    assert 0 <= json.loads(chat.choices[0].message.content)["n"] <= 9


def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert bad.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="embedded", prompt="x", max_tokens=8, extra_body={"guided_regex": "(["})
    assert bad.value.body["param"] == "guided_regex"
    # No finite value (every "a" holds another such object), though its first token is fine: a 400 before any
    # decoding (was a 500 from the decoding loop at the parser's work limit); the server decodes on.
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": endless}})
    assert bad.value.body["param"] == "response_format.json_schema.schema"
    assert "no finite JSON value" in bad.value.body["message"]
    assert client.completions.create(model="embedded", prompt="x", max_tokens=8).choices


def test_max_tokens_too_short_is_a_400_and_the_least_it_names_closes(client):
    """Was ``length`` with a cut output; since issue 45 a ``max_tokens`` no complete output fits is refused before
    decoding, and at the least it names the output is complete (``tests/structured/test_closing_server.py``)."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="embedded", prompt=f"copy: {DIGITS}", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": LEDGER}})
    assert bad.value.body["param"] == "max_tokens"
    least = int(re.search(r"at least (\d+)", bad.value.body["message"]).group(1))
    done = client.completions.create(model="embedded", prompt=f"copy: {DIGITS}", max_tokens=least,
                                     extra_body={"structured_outputs": {"regex": LEDGER}})
    assert done.choices[0].finish_reason == "stop" and re.fullmatch(LEDGER, done.choices[0].text)


def test_a_schema_failing_mid_decode_fails_alone_beside_a_running_request(server, client):
    """A schema the checks before decoding pass but llguidance cannot complete (its work limit, after the first
    item: `tests.engine.test_failing_row`) fails mid-decode: that request gets a 400 naming the field, while a
    streamed request running beside it (in the same iterations: its ``dllm_batch_size`` is 2) finishes with the
    text it has alone, and the worker counts no fault (was: a 500 ``batch_failed`` for every request of the
    iteration)."""
    import httpx

    from tests.engine.test_failing_row import FAILS_AFTER_ITEM
    from tests.support.metrics import metric_sum, metrics

    plain = {"model": "embedded", "prompt": f"copy: {DIGITS}", "max_tokens": 256, "ignore_eos": True}
    alone = httpx.post(server.url + "/v1/completions", json=plain, timeout=120).json()["choices"][0]["text"]
    before = metrics(server.url)
    failing = {"model": "embedded", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64,
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": FAILS_AFTER_ITEM}}}
    with (httpx.Client(base_url=server.url, timeout=120) as http,
          http.stream("POST", "/v1/completions", json={**plain, "stream": True}) as stream):
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # the plain request is running
        r = http.post("/v1/chat/completions", json=failing)
        rest = [line for line in lines if line.startswith("data: ")]
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "structured_output_failed",
                                                             "response_format.json_schema.schema")
    assert "could not satisfy response_format.json_schema.schema" in error["message"]
    assert "Too many items" in error["message"]
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == alone
    after = metrics(server.url)
    assert metric_sum(after, "dllm_batch_size_count") - metric_sum(before, "dllm_batch_size_count") == 1
    assert metric_sum(after, "dllm_batch_size_sum") - metric_sum(before, "dllm_batch_size_sum") == 2
    assert metric_sum(after, "dllm_worker_faults_total") == metric_sum(before, "dllm_worker_faults_total")
