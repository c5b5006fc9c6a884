"""``max_tokens`` is a hard upper bound and usage counts the tokens returned (issue 13), on every route, streamed
and not, with the real embedded model behind ``python -m service serve``; ``/generate`` takes ``model`` and ends
an ``ignore_eos`` decode with ``length``, and the ``generate`` CLI cuts exactly as ``/generate`` does (issue 12).

The prompt asks the embedded model to copy 48 digits: its answer is longer than any ``max_tokens`` used here
except the last, so each cut below removes digits."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from tests.support.apps import sse_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DIGITS = "4 1 4 4 2 9 7 4 3 2 8 3 3 8 5 9 9 6 6 4 8 5 6 3 6 6 3 5 5 2 2 1 8 6 7 1 1 9 9 1 8 7 2 7 7 3 4 8"
COPY = [{"role": "user", "content": f"copy: {DIGITS}"}]


@pytest.fixture(scope="module")
def server(shared_embedded_server):
    return shared_embedded_server  # tests/conftest.py: one embedded server for the session


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("max_tokens", [1, 33])
def test_max_tokens_is_a_hard_bound_with_finish_reason_length(client, max_tokens):
    # Today's bug: 1 returned 17 completion tokens and 33 returned 49, both with finish_reason "stop".
    chat = client.chat.completions.create(model="embedded", messages=COPY, max_tokens=max_tokens)
    assert chat.usage.completion_tokens == max_tokens and chat.choices[0].finish_reason == "length"
    done = client.completions.create(model="embedded", prompt=f"copy: {DIGITS}", max_tokens=max_tokens)
    assert done.usage.completion_tokens <= max_tokens


def test_streamed_chunks_never_go_past_the_cut(server, client):
    whole = client.chat.completions.create(model="embedded", messages=COPY, max_tokens=33)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "model": "embedded", "messages": COPY, "max_tokens": 33, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.iter_lines())
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 33


def test_usage_counts_the_tokens_returned_when_a_stop_string_cuts(server, client):
    full = client.chat.completions.create(model="embedded", messages=COPY, max_tokens=64)
    cut = client.chat.completions.create(model="embedded", messages=COPY, max_tokens=64, stop=["9"])
    assert cut.choices[0].message.content == full.choices[0].message.content.split("9")[0]
    assert cut.choices[0].finish_reason == "stop"
    # The tokens returned run up to the one that completed the stop string; /generate returns those very ids.
    gen = httpx.post(server.url + "/generate", timeout=120, json={
        "model": "embedded", "prompt": f"copy: {DIGITS}", "chat": True, "max_tokens": 64, "stop": ["9"]}).json()
    ids = gen["rows"][0]["generated_ids"]
    assert cut.usage.completion_tokens == len(ids) < full.usage.completion_tokens
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith(cut.choices[0].message.content) and text.rstrip().endswith("9")


def test_generate_with_ignore_eos_ends_with_length_and_matches_the_cli(server):
    body = {"prompt": f"copy: {DIGITS}", "chat": True, "max_tokens": 64, "ignore_eos": True}
    gen = httpx.post(server.url + "/generate", timeout=120, json=body).json()
    row = gen["rows"][0]
    assert row["finish_reason"] == "length" and len(row["generated_ids"]) == 64
    cli = subprocess.run(
        [sys.executable, "-m", "service", "generate", "--threads", "1", "--prompt", f"copy: {DIGITS}", "--chat",
         "--gen-length", "64", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert cli.returncode == 0, cli.stderr
    cli_row = json.loads(cli.stdout)["rows"][0]
    # Same cut either way (the CLI used to stop its text at the first EOS).
    assert (cli_row["generated_ids"], cli_row["text"], cli_row["finish_reason"]) == (
        row["generated_ids"], row["text"], row["finish_reason"])


def test_generate_takes_a_model_checked_against_the_served_one(server):
    ok = httpx.post(server.url + "/generate", timeout=120, json={"model": "embedded", "prompt": "copy: 1 2",
                                                                 "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["model"] == "embedded"
    bad = httpx.post(server.url + "/generate", json={"model": "gpt-4", "prompt": "copy: 1 2"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"
