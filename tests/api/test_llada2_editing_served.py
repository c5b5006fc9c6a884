"""LLaDA2.1's token editing over HTTP (issue 45 item 4): ``editing_threshold``, ``max_post_steps`` and
``min_transfer`` are request fields of completions and chat and ``DLLM_*`` settings, and a request with them decodes
as ``dllm-kvq generate`` with the same flags; a checkpoint without a tokenizer returns the ids of a token-id
completion (vLLM's ``prompt_token_ids`` / ``token_ids``) and its refusals name the served model, never a host path.
Real servers on the tiny checkpoints (tests/data/llada2), the real openai client, the CLI's own ``main``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.cli import service_main
from tests.support.llada2 import LLADA2_CHAT, LLADA2_CKPT, llada2_golden, start_llada2_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: LLaDA2.1 golden runs without eos_early_stop (no request field): the reference's defaults, a low threshold with
#: few post steps, a floor of 2 reveals and no post step, and no edit at all (editing threshold 2.0).
RUNS = [r for r in llada2_golden("llada21_generate.json")["runs"]
        if not r["params"].get("eos_early_stop") and r["params"]["prompt_len"] == 17 and r["params"]["gen_length"] == 64]


def editing_fields(params: dict) -> dict:
    """A golden run's editing settings as request fields: the reference's "never edit" (threshold 2.0) is 1.0 as
    a field (a probability, at most 1; no probability is above 1, so it edits nothing either)."""
    return {"editing_threshold": min(params["editing_threshold"], 1.0), "max_post_steps": params["max_post_steps"],
            "min_transfer": params.get("num_to_transfer", 1)}


def cli(checkpoint, prompt: list[int], gen_length: int, threshold: float, **editing) -> dict:
    """``dllm-kvq generate`` with the request's settings as flags: its JSON report."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in editing.items()]
    out = service_main("generate", "--threads", "1", "--model", str(checkpoint), "--prompt-ids",
                       ",".join(map(str, prompt)), "--gen-length", str(gen_length), "--block-length", "32",
                       "--threshold", str(threshold), "--steps-per-block", "32", *flags, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The LLaDA2.1 tiny checkpoint (no tokenizer files)."""
    srv = start_llada2_server(LLADA2_CKPT["llada21"], tmp_path_factory.mktemp("llada21-editing"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """The LLaDA2.0 tiny chat checkpoint (no editing by default) with editing set by the server's settings."""
    srv = start_llada2_server(LLADA2_CHAT, tmp_path_factory.mktemp("llada2-chat-editing"),
                              DLLM_EDITING_THRESHOLD="0.5", DLLM_MAX_POST_STEPS="4")
    yield srv
    srv.stop()


@pytest.mark.parametrize("run", RUNS, ids=[r["id"] for r in RUNS])
def test_a_completion_with_editing_fields_decodes_as_generate_with_the_same_flags(server, run):
    p = run["params"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="llada21-tiny", prompt=run["prompt_ids"], max_tokens=p["gen_length"],
                                    extra_body={"threshold": p["threshold"], "block_length": p["block_length"],
                                                "cache_mode": "block", **editing_fields(p)})
    choice = out.choices[0]
    expected = cli(LLADA2_CKPT["llada21"], run["prompt_ids"], p["gen_length"], p["threshold"],
                   **editing_fields(p))["generated_ids"]
    assert expected == run["generated_ids"] or run["fragile"]
    # Without a tokenizer the text is empty: the ids are the answer, under vLLM's return_token_ids names.
    assert choice.text == "" and choice.model_extra["token_ids"] == expected
    assert choice.model_extra["prompt_token_ids"] == run["prompt_ids"]
    assert out.usage.completion_tokens == len(expected)


def test_an_editing_threshold_above_1_is_a_400_naming_it_and_1_is_served(server):
    """``editing_threshold`` is a probability (issue 45 review: 1.5 was accepted): above 1 is a 400 naming the
    field; 1 (no probability is above it: no edit) is served, as the reference's never-edit runs decode."""
    body = {"model": "llada21-tiny", "prompt": [481, 67, 379, 219, 481], "max_tokens": 32, "cache_mode": "block"}
    for value in (1.5, 2.0, -0.1):
        r = httpx.post(server.url + "/v1/completions", json={**body, "editing_threshold": value}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "editing_threshold" and error["type"] == "invalid_request_error", error
    r = httpx.post(server.url + "/v1/completions", json={**body, "editing_threshold": 1.0}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_tokenizerless_checkpoint_refuses_text_and_chat_naming_no_host_path(server):
    for path, body, param in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                              ("/v1/completions", {"prompt": "hi"}, "prompt"),
                              ("/v1/completions", {"prompt": [481, 67], "stream": True}, "stream")):
        r = httpx.post(server.url + path, json={"model": "llada21-tiny", "max_tokens": 8, **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "llada21-tiny has no tokenizer" in error["message"], error
        assert "tests/" not in error["message"] and str(LLADA2_CKPT["llada21"].parent) not in error["message"]


def test_the_servers_editing_settings_apply_and_a_chat_may_set_its_own(chat_server):
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0)
    prompt = list(range(5, 22))
    served = client.completions.create(model="llada2-tiny-chat", prompt=prompt, max_tokens=64,
                                       extra_body={"threshold": 0.5, "return_token_ids": True})
    # DLLM_EDITING_THRESHOLD / DLLM_MAX_POST_STEPS turn editing on for a 2.0 checkpoint, as the flags do.
    edited = cli(LLADA2_CHAT, prompt, 64, 0.5, editing_threshold=0.5, max_post_steps=4)["generated_ids"]
    assert served.choices[0].model_extra["token_ids"] == edited
    assert edited != cli(LLADA2_CHAT, prompt, 64, 0.5)["generated_ids"], "editing changes nothing here: pick another"
    messages = [{"role": "user", "content": "w5 w6 w7 w8 w9"}]
    ids = httpx.post(chat_server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    chat = client.chat.completions.create(model="llada2-tiny-chat", messages=messages, max_tokens=64,
                                          extra_body={"threshold": 0.5, "editing_threshold": 0.6, "max_post_steps": 2,
                                                      "min_transfer": 2})
    alone = cli(LLADA2_CHAT, ids, 64, 0.5, editing_threshold=0.6, max_post_steps=2, min_transfer=2)
    assert chat.choices[0].message.content == alone["text"] and chat.usage.completion_tokens == len(
        alone["generated_ids"])


def test_editing_fields_are_refused_by_name_on_another_family(tmp_path):
    from tests.support.processes import embedded_server

    with embedded_server(tmp_path, "editing") as srv:
        for route, body in (("/v1/completions", {"prompt": "copy: 1 2 3"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "copy: 1 2 3"}]})):
            for field, value in (("editing_threshold", 0.5), ("max_post_steps", 4), ("min_transfer", 2)):
                r = httpx.post(srv.url + route, json={"model": "embedded", "max_tokens": 8, field: value,
                                                      **body}, timeout=60)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == field and error["type"] == "invalid_request_error", error
                assert "token editing" in error["message"], error


def test_a_tokenizerless_checkpoint_refuses_stop_strings_and_detokenize_by_the_field_sent(server):
    """A stop string can never match without a tokenizer (the response has no text): it was a 200 that ignored it.
    /detokenize answered "send token ids instead of text" naming ``prompt``, which it had been sent."""
    ids = [481, 67, 379, 219, 481]
    for path, body in (("/v1/completions", {"model": "llada21-tiny", "prompt": ids}), ("/generate", {"prompt": ids})):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 8, "stop": ["x"]}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "stop" and "llada21-tiny has no tokenizer" in error["message"], error
    r = httpx.post(server.url + "/v1/completions", json={"model": "llada21-tiny", "prompt": ids, "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 200, r.text  # without stop: served, its token_ids the answer
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, 2]}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tokens" and "has no tokenizer, so it cannot detokenize" in error["message"], error


def test_many_post_steps_on_a_short_response_are_a_400_naming_max_post_steps(server):
    """max_post_steps is LLaDA2.1's per-block pass count, as max_denoising_steps is DiffusionGemma's: 500,000 of them
    after one block of 32 were priced at 500,032 x 37 token-forwards, under the default ceiling, and accepted; each
    forward is now charged at least ``FORWARD_FLOOR_TOKENS``."""
    body = {"model": "llada21-tiny", "prompt": [481, 67, 379, 219, 481], "max_tokens": 8, "max_post_steps": 500_000}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_post_steps" and "ceiling of " in error["message"], error
