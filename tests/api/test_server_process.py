"""The server as a real uvicorn process with the real worker, store (the suite's own Redis, tests/conftest.py,
under its own key prefix) and routes, and a fake engine whose speed and faults the tests control; the official openai client and
prometheus_client.parser. Cases: concurrency and batching, a configuration swap under load, disconnect, worker
fault, full queue, device fault, Redis stop/restart, SIGTERM drain, admin and bad input."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient

from service.config import Settings
from service.quant.config import KVQuantConfig
from service.store.redis_store import RedisStore
from tests.support.apps import ADMIN_KEY, fake_app, sse_events
from tests.support.artifacts import policy_for
from tests.support.fake_engine import FakeEngine
from tests.support.metrics import metric_sum, metrics
from tests.support.processes import SHARED_REDIS_URL, RedisProcess, ServerProcess
from tests.support.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FACTORY = "tests.support.apps:fake_app_from_env"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = FakeEngine().spec


@pytest.fixture(scope="module")
def prefix():
    p = f"test-server-{uuid.uuid4().hex[:8]}"
    yield p
    RedisStore(SHARED_REDIS_URL, prefix=p).delete_everything()


def start(tmp_path, prefix, delay=0.02, **env) -> ServerProcess:
    base = {"DLLM_STORE_URL": SHARED_REDIS_URL, "DLLM_STORE_PREFIX": prefix, "DLLM_ADMIN_KEY": ADMIN_KEY,
            "DLLM_BLOCK_LENGTH": "4", "FAKE_BLOCK_DELAY_S": str(delay)}
    return ServerProcess({**base, **{k: str(v) for k, v in env.items()}}, FACTORY,
                         log_path=tmp_path / f"server-{uuid.uuid4().hex[:6]}.log").start()


@pytest.fixture(scope="module")
def server(tmp_path_factory, prefix):
    """One server for the tests that leave it healthy (each uses its own cache mode where it swaps)."""
    srv = start(tmp_path_factory.mktemp("server"), prefix, DLLM_MAX_BATCH_SIZE=8, DLLM_SHADOW_RATE=1.0)
    yield srv
    srv.stop()


def test_openai_client_concurrency_batching_and_metrics(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="fake-llada", prompt="hello", max_tokens=8)
    assert out.choices[0].text == "olleh" and out.usage.completion_tokens == 6
    chat = client.chat.completions.create(model="fake-llada", messages=[{"role": "user", "content": "ab"}],
                                          max_tokens=8)
    assert chat.choices[0].message.content == " tnatsis"
    stream = client.chat.completions.create(model="fake-llada", messages=[{"role": "user", "content": "ab"}],
                                            max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " tnatsis"

    prompts = [f"request {chr(97 + i)}" for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: client.completions.create(model="fake-llada", prompt=p, max_tokens=16),
                             prompts))
    assert [o.choices[0].text for o in outs] == [p[::-1] for p in prompts]
    m = metrics(server.url)
    # One observation per request (the most rows it decoded together with): 16 concurrent requests (+3 single
    # ones) of which some shared forwards with others.
    assert metric_sum(m, "dllm_batch_size_count") == 19 and metric_sum(m, "dllm_batch_size_sum") > 19
    assert metric_sum(m, "dllm_batch_size_bucket", le="1.0") < 19
    assert metric_sum(m, "dllm_requests_total", endpoint="/v1/completions", status="200") == 17
    assert metric_sum(m, "dllm_request_latency_seconds_count", endpoint="/v1/chat/completions") == 2
    assert metric_sum(m, "dllm_prompt_tokens_total") > 0 and metric_sum(m, "dllm_requests_running") == 0
    assert metric_sum(m, "dllm_active_config_info", cache_mode="dual", method="none") == 1
    assert metric_sum(m, "dllm_ready") == 1


def test_configuration_swap_under_load(server, tmp_path):
    """Every report names one configuration; requests admitted after the swap answered use the new one; another
    replica on the same store follows through the pub/sub event."""
    store = RedisStore(SHARED_REDIS_URL, prefix=server.env["DLLM_STORE_PREFIX"])
    replica = TestClient(fake_app(Settings(store_url=SHARED_REDIS_URL, store_prefix=server.env["DLLM_STORE_PREFIX"],
                                           block_length=4)))
    replica.__enter__()
    replica_before = replica.post("/generate", json={"prompt": "ab", "max_tokens": 4, "cache_mode": "prefix"}).json()
    kivi = {"method": "kivi", "bits": 2}
    results, stop = [], threading.Event()

    def load():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not stop.is_set():
                sent = time.monotonic()
                r = c.post("/generate", json={"prompt": "abcdef", "max_tokens": 8, "cache_mode": "prefix"})
                results.append((sent, r))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        until(lambda: results, "a request answered before the swap")
        r = httpx.put(server.url + "/admin/active/prefix", json=kivi, headers=ADMIN)
        swapped = time.monotonic()
        until(lambda: [sent for sent, _ in results if sent > swapped], "a request sent after the swap answered")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert r.status_code == 200, r.text
    assert r.json()["served_before"]["method"] == "none" and r.json()["new"]["method"] == "kivi"
    assert all(r.status_code == 200 for _, r in results)
    methods = [(sent, r.json()["kv_config"]["kv_quant"]["method"]) for sent, r in results]
    assert {m for _, m in methods} == {"none", "kivi"}
    assert all(m == "kivi" for sent, m in methods if sent > swapped)
    assert store.get_active(SPEC.fingerprint, "prefix").config == KVQuantConfig(**kivi)
    audit = httpx.get(server.url + "/admin/audit", headers=ADMIN).json()
    assert audit[0]["new"]["method"] == "kivi" and len(audit[0]["key_id"]) == 12
    # Shadow re-decodes (rate 1) of the kivi requests are labelled with the served configuration.
    until(lambda: metric_sum(metrics(server.url), "dllm_shadow_requests_total", method="kivi", bits="2",
                             cache_mode="prefix") >= 1, "a shadow re-decode of a kivi request")
    m = metrics(server.url)
    assert metric_sum(m, "dllm_config_changes_total", cache_mode="prefix") == 1
    try:
        assert replica_before["kv_config"]["kv_quant"]["method"] == "none"

        def replica_follows():
            after = replica.post("/generate", json={"prompt": "ab", "max_tokens": 4, "cache_mode": "prefix"}).json()
            return after if after["kv_config"]["kv_quant"]["method"] == "kivi" else None

        after = until(replica_follows, "the replica follows the swap")
        assert after["kv_config"]["kv_quant"] == {**kivi, "k_group_size": 32, "sides": "kv", "keep_dequantized": False}
        assert after["kv_config"]["source"] == "active"
    finally:
        replica.__exit__(None, None, None)


def test_admin_policies_upload_validate_activate_delete(server):
    url = server.url
    assert httpx.get(url + "/admin/policies").status_code == 401
    assert httpx.get(url + "/admin/policies", headers={"Authorization": "Bearer wrong-key-0000000000"}
                     ).status_code == 401
    before = httpx.get(url + "/admin/policies", headers=ADMIN).json()["data"]
    for bad, param in ((policy_for(SPEC, fingerprint="ab" * 32), "weights_fingerprint"),
                       (policy_for(SPEC, num_layers=5), "layers")):
        r = httpx.post(url + "/admin/policies", content=bad.to_json(), headers=ADMIN)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/admin/policies", content=b'{"bits": 3}', headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "artifact_rejected"
    assert httpx.get(url + "/admin/policies", headers=ADMIN).json()["data"] == before  # nothing stored

    good = policy_for(SPEC, cache_mode="dual", bits=4)
    r = httpx.post(url + "/admin/policies", content=good.to_json(), headers=ADMIN)
    assert r.status_code == 201 and r.json()["id"] == good.id
    assert httpx.get(url + f"/admin/policies/{good.id}", headers=ADMIN).json()["bits"] == 4
    # Activation checks the policy against the cache mode and bits asked for.
    r = httpx.put(url + "/admin/active/prefix", json={"method": "dllm_kvq", "bits": 4, "policy_id": good.id},
                  headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["param"] == "kv_quant.cache_mode"
    r = httpx.put(url + "/admin/active/dual", json={"method": "dllm_kvq", "bits": 4, "policy_id": "policy-none"},
                  headers=ADMIN)
    assert r.status_code == 404
    r = httpx.put(url + "/admin/active/dual", json={"method": "gptq"}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "method"
    r = httpx.put(url + "/admin/active/dual", json={"method": "dllm_kvq", "bits": 4, "policy_id": good.id},
                  headers=ADMIN)
    assert r.status_code == 200
    gen = httpx.post(url + "/generate", json={"prompt": "abc", "max_tokens": 4}).json()
    assert gen["kv_config"]["kv_quant"]["policy_id"] == good.id and gen["kv_config"]["source"] == "active"
    assert httpx.delete(url + f"/admin/policies/{good.id}", headers=ADMIN).status_code == 409
    httpx.put(url + "/admin/active/dual", json={"method": "none"}, headers=ADMIN)
    assert httpx.delete(url + f"/admin/policies/{good.id}", headers=ADMIN).status_code == 204
    view = httpx.get(url + "/admin/active", headers=ADMIN).json()
    assert view["serving"]["dual"]["kv_quant"]["method"] == "none" and view["store"]["dual"]["config"]["method"] == "none"

    r = httpx.post(url + "/admin/eval_scores", headers=ADMIN, json={
        "task": "gsm8k", "scores": {"exact_match": 0.5}, "kv_quant": {"method": "kivi", "bits": 4},
        "cache_mode": "dual"})
    assert r.status_code == 201, r.text
    assert metric_sum(metrics(url), "dllm_eval_score", task="gsm8k", metric="exact_match", method="kivi") == 0.5


def test_worker_fault_fails_that_batch_and_the_next_request_succeeds(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "boom!", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["code"] == "batch_failed"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "enif"
    assert httpx.get(server.url + "/health/ready").status_code == 200
    assert metric_sum(metrics(server.url), "dllm_worker_faults_total", fatal="false") == 1


def test_full_queue_429_disconnect_frees_the_slot_and_sigterm_drains(tmp_path, prefix):
    # 0.5 s a block: a long request (120 blocks) takes a minute uncancelled, twice the 30 s the clients below wait
    # for an answer. So a client answered at all proves the request ahead of it was cancelled: no wall-clock bound.
    srv = start(tmp_path, prefix, delay=0.5, DLLM_MAX_BATCH_SIZE=1, DLLM_MAX_QUEUE=1)

    def rows(name: str) -> float:
        return metric_sum(metrics(srv.url), name)

    try:
        long = {"prompt": "abcdefgh", "max_tokens": 480, "ignore_eos": True, "stream": True}  # 120 blocks: 60 s
        box = {}
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()
                next(lines)  # the first block arrived: it runs
                queued = threading.Thread(target=lambda: box.setdefault("r", c.post(
                    "/v1/completions", json={"prompt": "queued", "max_tokens": 4})))
                queued.start()
                until(lambda: rows("dllm_requests_waiting") == 1, "the second request queued")
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
                assert r.status_code == 429 and r.headers["Retry-After"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
            # The stream's client went away mid-stream: its job is cancelled and the queued one runs, within its
            # client's 30 s, long before the minute the stream would have taken.
            queued.join(timeout=60)
            assert box["r"].status_code == 200
            assert box["r"].json()["choices"][0]["text"] == "deue"
        # A non-streaming client that gives up (read timeout: it closes the connection) frees its slot too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={**long, "stream": False}, timeout=0.5)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "next", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        m = metrics(srv.url)
        # Both clients that went away, the stream (whose headers said 200) and the plain one, are cancellations.
        assert metric_sum(m, "dllm_requests_total", endpoint="/v1/completions", status="499") == 2
        assert metric_sum(m, "dllm_requests_cancelled_total", endpoint="/v1/completions") == 2
        assert metric_sum(m, "dllm_requests_total", status="429") == 1
        assert metric_sum(m, "dllm_requests_running") == 0 and metric_sum(m, "dllm_requests_waiting") == 0
        # A handled disconnect logs nothing above INFO (it once left asyncio's "exception was never retrieved").
        time.sleep(0.5)  # the abandoned futures are collected
        assert not [line for line in srv.log().splitlines() if "ERROR" in line or "never retrieved" in line
                    or "Traceback" in line], srv.log()

        # SIGTERM: the request in flight finishes (10 blocks, 5 s), then the process exits cleanly.
        t = threading.Thread(target=lambda: box.__setitem__("r", httpx.post(
            srv.url + "/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 40, "ignore_eos": True},
            timeout=60)))
        t.start()
        until(lambda: rows("dllm_requests_running") == 1, "the request running before SIGTERM")
        srv.proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        assert box["r"].status_code == 200 and box["r"].json()["choices"][0]["text"] == "hgfedcba"
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown, so the exit status is -SIGTERM.
        assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        srv.stop()


def test_redis_stop_serving_continues_admin_503_recovery_then_device_fault(tmp_path):
    own = RedisProcess(tmp_path)
    own.start()
    srv = ServerProcess({"DLLM_STORE_URL": own.url, "DLLM_ADMIN_KEY": ADMIN_KEY, "DLLM_BLOCK_LENGTH": "4"},
                        FACTORY, log_path=tmp_path / "server.log").start()
    try:
        kivi = {"method": "kivi", "bits": 4}
        assert httpx.put(srv.url + "/admin/active/dual", json=kivi, headers=ADMIN).status_code == 200
        own.stop()
        r = httpx.post(srv.url + "/generate", json={"prompt": "abc", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["kv_config"]["kv_quant"]["method"] == "kivi"  # last loaded
        r = httpx.get(srv.url + "/admin/policies", headers=ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        assert httpx.put(srv.url + "/admin/active/dual", json={"method": "none"}, headers=ADMIN).status_code == 503
        assert metric_sum(metrics(srv.url), "dllm_store_up") == 0
        own.start()
        # Another replica changes the configuration while this one reconnects; the reload picks it up.
        RedisStore(own.url).set_active(SPEC, "dual", KVQuantConfig(method="kivi", bits=2))
        def recovered() -> bool:
            if httpx.get(srv.url + "/admin/policies", headers=ADMIN).status_code != 200:
                return False
            gen = httpx.post(srv.url + "/generate", json={"prompt": "abc", "max_tokens": 4}).json()
            return gen["kv_config"]["kv_quant"]["bits"] == 2

        until(recovered, "the server recovers after Redis returned", timeout_s=60, interval_s=0.2)

        # A device fault: that batch fails, readiness fails, new requests are refused; the process stays alive.
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "gpu#", "max_tokens": 4})
        assert r.status_code == 500
        ready = httpx.get(srv.url + "/health/ready")
        assert ready.status_code == 503 and "device fault" in ready.json()["error"]["message"]
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4}).status_code == 503
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()
        own.stop()


def test_streaming_raw_sse_and_bad_input_over_http(server):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "abcdefgh", "max_tokens": 8, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["hgfe", "dcba", ""]
    # No stream_options: no usage anywhere in the stream (OpenAI sends it only with include_usage).
    assert all("usage" not in e or e["usage"] is None for e in events[:-1]) and events[-1] == "[DONE]"
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "abcdefgh", "max_tokens": 8, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.iter_lines())
    # Usage comes only when asked for, as one last chunk with no choices (issue 13, OpenAI's stream_options).
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["hgfe", "dcba", ""]
    assert all(e["usage"] is None for e in events[:-2])
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8 and events[-1] == "[DONE]"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "n": 9})  # over DLLM_MAX_N (8)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert redis.Redis.from_url(SHARED_REDIS_URL).ping()
