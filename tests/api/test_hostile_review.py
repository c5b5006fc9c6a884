"""A fresh reviewer's hostile review (``tests/api/hostile_review.py``): the whole script against a real
``python -m service serve`` (embedded model, a scratch directory store, an admin key), which must pass the issue's
bar (no 5xx, server RSS at most 1 GB, ready throughout, every disconnected stream cancelled) with no flag but the two
the HTTP server (uvicorn) owns; then each of its findings as a test with the answer it must get, mostly against the
same server. A second server (the fake engine, API keys, a 4 KiB body limit, a queue of 4) covers what needs other
settings.

No bar here is a wall-clock time: the script's 5 s ``SLOW`` report is for a person (``--no-time-bar``), a readiness
poll is lost only when the server does not answer in 30 s (a hang), and where time is the point (readiness during
large work, a refusal before tokenizing) it is compared with a baseline measured in the same test."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.engine.loading import load_tokenizer
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_KEY = "hostile-review-admin-key-0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER_KEY = "hostile-review-user-key"
JSON = {"content-type": "application/json"}
SCRIPT = Path(__file__).resolve().with_name("hostile_review.py")
# What the script still flags and this server does not decide: uvicorn answers a request line without Host, and
# one with a 100 KB header, itself (httptools has no header-size limit).
UVICORN_OWNED = ("HTTP/1.1 without Host", "100 KB header")
LIMIT = 1 << 20  # the default body limit for the embedded model's 4,096-token context: max(1 MiB, 256 * 4096)
EMBEDDED = Path(__file__).resolve().parents[2] / "service" / "assets" / "embedded"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("review")
    srv = ServerProcess({"DLLM_THREADS": "1", "DLLM_STORE_URL": str(tmp / "store"), "DLLM_ADMIN_KEY": ADMIN_KEY},
                        log_path=tmp / "server.log").start(timeout_s=180)
    srv.store_dir = tmp / "store"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    srv = ServerProcess({"DLLM_STORE_URL": str(tmp / "store"), "DLLM_API_KEYS": USER_KEY,
                         "DLLM_MAX_BODY_BYTES": "4096", "DLLM_MAX_QUEUE": "4"},
                        factory="tests.support.apps:fake_app_from_env", log_path=tmp / "server.log").start()
    yield srv
    srv.stop()


def error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), r.text
    return body["error"]


def post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body), headers={**JSON, **kw.pop("headers", {})},
                      timeout=kw.pop("timeout", 60), **kw)


def test_the_whole_review_passes_the_bar(server):
    # A slow request on a loaded machine is reported, not failed; a readiness poll fails only if it hangs.
    run = subprocess.run([sys.executable, str(SCRIPT), "--url", server.url, "--admin-key", ADMIN_KEY,
                          "--server-pid", str(server.proc.pid), "--no-time-bar", "--ready-timeout-s", "30"],
                         capture_output=True, text=True, timeout=600, check=False)
    out = run.stdout
    assert run.returncode == 0 and "RESULT: PASS" in out, out[-6000:] + run.stderr[-2000:] + server.log()
    assert re.search(r"^5xx: 0  over 5s: \d+ \(reported, not a failure", out, re.MULTILINE), out[-3000:]
    assert re.search(r"^readiness: 0 failed of [1-9]\d* polls", out, re.MULTILINE), out[-3000:]
    peak = re.search(r"peak (\d+) MiB", out)
    assert peak and int(peak.group(1)) <= 1024, out[-3000:]
    assert int(re.search(r"^requests: (\d+)", out, re.MULTILINE).group(1)) >= 450
    flags = [line for line in out.splitlines() if line.startswith("  FLAG ")]
    assert all(any(name in line for name in UVICORN_OWNED) for line in flags), "\n".join(flags)


# ---- 1: a non-ASCII bearer token was a 500 (hmac.compare_digest on str) --------------------------------------------
def test_a_non_ascii_bearer_token_is_401(server, keyed):
    latin1 = {"Authorization": b"Bearer \xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9"}
    r = httpx.get(server.url + "/admin/active", headers=latin1)
    assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 4}, headers=latin1)
    assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 4},
                   headers={"Authorization": f"Bearer {USER_KEY}"})
    assert r.status_code == 200, r.text


# ---- 2: JSON nested 100k deep was a 500 (RecursionError) ------------------------------------------------------------
def test_json_nested_too_deep_is_refused_naming_where(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(server.url + "/admin/policies", content=deep, headers={**ADMIN, **JSON})
    assert r.status_code == 422 and error(r)["code"] == "artifact_rejected"
    assert "nested more than 64 levels" in error(r)["message"]
    r = httpx.post(server.url + "/admin/policies", content=b'{"id": "x", "a": ' + deep + b"}", headers={**ADMIN, **JSON})
    assert r.status_code == 422 and error(r)["param"] == "a", r.text
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ' + deep + b"}", headers=JSON)
    assert r.status_code == 400 and error(r)["code"] == "invalid_json" and error(r)["param"] == "prompt", r.text
    nested = {"a": 1}
    for _ in range(70):
        nested = {"a": nested}
    r = post(server.url, "/admin/eval_scores", {"task": "t", "scores": {"acc": 1}, "cache_mode": "dual",
                                                "details": nested}, headers=ADMIN)
    assert r.status_code == 400 and error(r)["param"] == "details", r.text
    # 60 levels is legal JSON for the server (the limit is 64).
    nested = 1
    for _ in range(58):
        nested = {"a": nested}
    r = post(server.url, "/admin/eval_scores", {"task": "t", "scores": {"acc": 1}, "cache_mode": "none",
                                                "details": nested}, headers=ADMIN)
    assert r.status_code == 201, r.text


# ---- 3: a state header declaring an 8 GB tensor it does not hold was a 500 (SafetensorError) -------------------------
def test_a_kvquant_state_declaring_more_than_it_holds_is_rejected(server):
    fingerprint = httpx.get(server.url + "/admin/active", headers=ADMIN).json()["fingerprint"]
    meta = json.dumps({"schema_version": 1, "model_id": "m", "weights_fingerprint": fingerprint, "bits": 2,
                       "num_layers": 4, "channels": 10**9, "provenance": {"data": "d", "code": "c"}})
    header = json.dumps({"__metadata__": {"dllm_kvq.kvquant_state": meta},
                         "k_upper": {"dtype": "F16", "shape": [4, 10**9], "data_offsets": [0, 8 * 10**9]}}).encode()
    r = httpx.post(server.url + "/admin/kvquant_states", content=struct.pack("<Q", len(header)) + header + bytes(64),
                   headers=ADMIN)
    assert r.status_code == 422 and error(r)["code"] == "artifact_rejected", r.text
    assert "k_lower" in error(r)["message"] or "k_upper" in error(r)["message"]
    r = httpx.post(server.url + "/admin/kvquant_states", content=struct.pack("<Q", 1 << 63) + b"{}", headers=ADMIN)
    assert r.status_code == 422 and "header length" in error(r)["message"], r.text


# ---- 4/5: tokenizing and parsing large bodies blocked the event loop (/health/ready timed out) ----------------------
def test_large_work_does_not_stop_readiness(server):
    # A 900 KB chat message (chat prompts have no length bound before the template: it is tokenized) takes the
    # tokenizer a second or more; readiness must answer all the while. The baseline is that request, measured here:
    # a poll blocked behind the tokenizer on the event loop would wait about as long as the request took.
    body = {"messages": [{"role": "user", "content": "7 " * 450_000}], "max_tokens": 8}
    done, answer = threading.Event(), {}

    def send() -> None:
        t0 = time.monotonic()
        answer["r"] = post(server.url, "/v1/chat/completions", body, timeout=120)
        answer["s"] = time.monotonic() - t0
        done.set()

    thread = threading.Thread(target=send)
    thread.start()
    waits = []
    with httpx.Client(timeout=30) as client:
        while not done.is_set():
            t0 = time.monotonic()
            assert client.get(server.url + "/health/ready").status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
    thread.join()
    r = answer["r"]
    assert r.status_code == 400 and error(r)["param"] == "messages", r.text
    assert len(waits) >= 3 and max(waits) < answer["s"] / 2, (max(waits), answer["s"])


# ---- 6: no body limit (a 2 MB prompt took RSS 653 -> 938 MiB, an 8 MB policy to 1313 MiB) ----------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    r = httpx.post(server.url + "/v1/completions", content=b" " * (LIMIT + 1), headers=JSON)
    assert r.status_code == 413 and error(r)["code"] == "body_too_large", r.text
    assert f"{LIMIT:,}" in error(r)["message"]
    # Chunked (no Content-Length): refused once the bytes received pass the limit.
    r = httpx.post(server.url + "/admin/policies", content=(b"x" * 65536 for _ in range(40)), headers=ADMIN)
    assert r.status_code == 413 and error(r)["code"] == "body_too_large", r.text
    # A body of exactly the limit is read and answered.
    small = json.dumps({"prompt": "copy: 1 2", "max_tokens": 4}).encode()
    r = httpx.post(server.url + "/v1/completions", content=small + b" " * (LIMIT - len(small)), headers=JSON)
    assert r.status_code == 200, r.text


def test_a_text_prompt_that_cannot_fit_is_refused_before_tokenizing(server):
    prompt = "copy: " + "7 " * 450_000
    refusals = []
    for _ in range(3):  # the fastest of three: a load spike on a shared machine slows one, not all
        t0 = time.monotonic()
        r = post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 8})
        refusals.append(time.monotonic() - t0)
        assert r.status_code == 400 and error(r)["param"] == "prompt" and "at least" in error(r)["message"], r.text
    # The baseline, measured here on the same machine: the embedded model's tokenizer encoding the same text. A
    # refusal that tokenized first would take at least that long (plus the HTTP round trip of 900 KB).
    tokenizer = load_tokenizer(EMBEDDED)
    encodes = []
    for _ in range(2):
        t0 = time.monotonic()
        ids = tokenizer(prompt)["input_ids"]
        encodes.append(time.monotonic() - t0)
    assert len(ids) > 4096  # the text really cannot fit the context
    assert min(refusals) < min(encodes) / 2, (refusals, encodes)
    r = post(server.url, "/v1/completions", {"prompt": ["copy: 1", "7 " * 50_000], "max_tokens": 8})
    assert r.status_code == 400 and error(r)["message"].startswith("prompt 1 is"), r.text


def test_artifact_provenance_is_bounded(server):
    fingerprint = httpx.get(server.url + "/admin/active", headers=ADMIN).json()["fingerprint"]
    policy = {"model_id": "embedded", "weights_fingerprint": fingerprint, "cache_mode": "dual", "bits": 2,
              "k_group_size": 32, "v_group_size": 32, "k_bit_cap": 4.9, "layers": [{"score_type": "hybrid", "p": 1}] * 4,
              "provenance": {"data": "d", "code": "c", "details": {"blob": "z" * 70_000}}}
    r = post(server.url, "/admin/policies", policy, headers=ADMIN)
    assert r.status_code == 422 and error(r)["param"] == "provenance" and "65,536" in error(r)["message"], r.text


def test_the_body_limit_setting(keyed):
    r = httpx.post(keyed.url + "/v1/completions", content=b" " * 4097, headers=JSON)
    assert r.status_code == 413 and "4,096" in error(r)["message"], r.text


# ---- 7: loose typing where the docs say strict -----------------------------------------------------------------------
@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"stream": 1}, "stream"),
    ("/v1/completions", {"stream": "false"}, "stream"),
    ("/v1/completions", {"seed": "7"}, "seed"),
    ("/v1/completions", {"seed": 7.5}, "seed"),
    ("/v1/completions", {"n": "1"}, "n"),
    ("/v1/completions", {"kv_quant": {"method": "kivi", "bits": 2, "k_group_size": "32"}}, "kv_quant.k_group_size"),
    ("/generate", {"chat": 1}, "chat"),
    ("/generate", {"chat": "yes"}, "chat"),
])
def test_request_fields_are_strictly_typed(server, path, extra, param):
    r = post(server.url, path, {"prompt": "copy: 1 2 3", "max_tokens": 8, **extra})
    assert r.status_code == 400 and error(r)["param"] == param, r.text


def test_strict_types_take_what_json_schema_calls_legal(server):
    # A float field takes a JSON integer; an integer field takes 8.0 (JSON Schema's integer, docs/api.md).
    r = post(server.url, "/v1/completions", {"prompt": "copy: 1 2", "max_tokens": 8.0, "temperature": 1, "seed": 3.0,
                                             "threshold": 1})
    assert r.status_code == 200, r.text
    r = httpx.put(server.url + "/admin/active/dual", json={"method": "kivi", "bits": 2, "k_group_size": "32"},
                  headers=ADMIN)
    assert r.status_code == 400 and error(r)["param"] == "k_group_size", r.text


# ---- 8: NaN / Infinity scores were stored (non-standard JSON) and exported as +Inf --------------------------------
@pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_refused_naming_the_field(server, raw):
    body = b'{"task": "finite", "scores": {"acc": ' + raw + b'}, "cache_mode": "dual"}'
    r = httpx.post(server.url + "/admin/eval_scores", content=body, headers={**ADMIN, **JSON})
    assert r.status_code == 400 and error(r)["param"] == "scores.acc", r.text
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a", "temperature": ' + raw + b"}",
                   headers=JSON)
    assert r.status_code == 400 and error(r)["param"] == "temperature", r.text


def test_no_score_is_exported_non_finite(server):
    metrics = httpx.get(server.url + "/metrics").text
    assert not [line for line in metrics.splitlines() if line.startswith("dllm_eval_score") and
                re.search(r"(Inf|NaN)$", line)]


# ---- 10/11: prompts the queue can never hold; the chat route's prompt is its messages ------------------------------
def test_more_prompts_than_the_queue_holds_is_400(server, keyed):
    r = post(server.url, "/v1/completions", {"prompt": ["copy: 1 2 3"] * 1000, "max_tokens": 8})
    assert r.status_code == 400 and error(r)["param"] == "prompt" and "64" in error(r)["message"], r.text
    auth = {"Authorization": f"Bearer {USER_KEY}"}
    assert post(keyed.url, "/v1/completions", {"prompt": ["ab"] * 4, "max_tokens": 4}, headers=auth).status_code == 200
    r = post(keyed.url, "/v1/completions", {"prompt": ["ab"] * 5, "max_tokens": 4}, headers=auth)
    assert r.status_code == 400 and error(r)["param"] == "prompt", r.text


def test_a_chat_over_the_context_names_messages(server):
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "1 2"}] * 5000,
                                                  "max_tokens": 8})
    assert r.status_code == 400 and error(r)["param"] == "messages", r.text


# ---- 12: malformed bodies got vague errors -------------------------------------------------------------------------
@pytest.mark.parametrize(("content", "headers", "status", "says"), [
    (b"", JSON, 400, "the request body is empty"),
    (b'{"prompt": "a"}', {"content-type": "text/plain"}, 415, "Content-Type: application/json"),
    (b"prompt=a", {"content-type": "application/x-www-form-urlencoded"}, 415, "Content-Type: application/json"),
    (b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n1\r\n--x--',
     {"content-type": "multipart/form-data; boundary=x"}, 415, "Content-Type: application/json"),
    (b'{"prompt": "a"}', {"content-type": ""}, 415, "no Content-Type"),
    (b'{"prompt": "a"}', {**JSON, "content-encoding": "gzip"}, 415, "Content-Encoding"),
    (b'{"prompt": "\xff\xfe"}', JSON, 400, "not UTF-8"),
    ('{"prompt": "a"}'.encode("utf-16"), JSON, 400, "not UTF-8"),
    (b'{"prompt": "a", "max_tokens": ', JSON, 400, "not valid JSON: Expecting value at line 1"),
    (b"[1, 2]", JSON, 400, "must be a JSON object, got an array"),
    (b"null", JSON, 400, "must be a JSON object, got null"),
])
def test_malformed_bodies_get_clear_errors(server, content, headers, status, says):
    r = httpx.post(server.url + "/v1/completions", content=content, headers=headers)
    assert r.status_code == status and says in error(r)["message"], r.text
    assert error(r)["code"] == ("invalid_json" if status == 400 else "unsupported_media_type")


def test_the_openapi_document_declares_413_and_415(server):
    responses = httpx.get(server.url + "/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]
    assert {"413", "415"} <= set(responses)


# ---- 13: a 404 for an unknown artifact told any client where the store is ----------------------------------------
def test_serving_routes_do_not_say_where_the_store_is(server):
    config = {"method": "dllm_kvq", "bits": 2, "policy_id": "policy-doesnotexist"}
    r = post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 8, "kv_quant": config})
    assert r.status_code == 404 and error(r)["param"] == "kv_quant.policy_id", r.text
    assert str(server.store_dir) not in r.text and error(r)["message"].endswith("in the store")
    r = httpx.put(server.url + "/admin/active/dual", json=config, headers=ADMIN)  # admin may know
    assert r.status_code == 404 and str(server.store_dir) in error(r)["message"], r.text


# ---- 14: activation answered 400 and 422 for the same kind of fault --------------------------------------------------
def test_activation_answers_as_a_request_does(server):
    for config, mode, param in [({"method": "kivi", "bits": 3}, "dual", "bits"),
                                ({"method": "kivi", "bits": 2, "k_group_size": 100_000}, "dual",
                                 "kv_quant.k_group_size"),
                                ({"method": "dllm_kvq", "bits": 2, "policy_file": "/etc/hostname"}, "dual",
                                 "kv_quant.policy_file"),
                                ({"method": "kivi", "bits": 2}, "none", "cache_mode")]:
        r = httpx.put(server.url + f"/admin/active/{mode}", json=config, headers=ADMIN)
        assert r.status_code == 400 and error(r)["param"] == param, r.text
        r = post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 8, "cache_mode": mode, "kv_quant": config})
        assert r.status_code == 400 and error(r)["param"] in (param, f"kv_quant.{param}"), r.text
    fingerprint = httpx.get(server.url + "/admin/active", headers=ADMIN).json()["fingerprint"]
    policy = {"model_id": "embedded", "weights_fingerprint": fingerprint, "cache_mode": "dual", "bits": 2,
              "k_group_size": 32, "v_group_size": 32, "k_bit_cap": 4.9, "layers": [{"score_type": "hybrid", "p": 1}] * 4,
              "provenance": {"data": "review", "code": "tests/api/test_hostile_review.py"}}
    pid = post(server.url, "/admin/policies", policy, headers=ADMIN).json()["id"]
    try:
        # The stored policy is for dual, the configuration asks for prefix: the artifact is rejected, 422 both ways,
        # naming the cache mode where each was given (the activation's path; the request's cache_mode).
        config = {"method": "dllm_kvq", "bits": 2, "policy_id": pid}
        r = httpx.put(server.url + "/admin/active/prefix", json=config, headers=ADMIN)
        assert r.status_code == 422 and error(r)["param"] == "kv_quant.cache_mode", r.text
        r = post(server.url, "/v1/completions", {"prompt": "a", "max_tokens": 8, "cache_mode": "prefix",
                                                 "kv_quant": config})
        assert r.status_code == 422 and error(r)["param"] == "cache_mode", r.text  # the field the request sent
    finally:
        assert httpx.delete(server.url + f"/admin/policies/{pid}", headers=ADMIN).status_code == 204


# ---- 15: HEAD /health was a 405 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/health/ready", "/metrics"])
def test_health_routes_answer_head(server, path):
    r = httpx.head(server.url + path)
    assert r.status_code == 200 and r.content == b""
