"""Issue 36, items 3 and 4: settings that cannot work together are refused at start-up in one line naming both, and
every request has a default work ceiling (token-forwards, the unit of `service.runtime.scheduler.work_tokens`) that
refuses with a 400 before any work: the issue's 2 x (n 8, top_logprobs 20, max_tokens 4,032) and a likelihood of a
2,200-token prompt at mc_num 128. The real app and routes around the fake engine (a 4,096-token context here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.main import StartupRefused, create_app
from service.runtime.memory import MemoryModel
from service.runtime.scheduler import default_max_work, work_tokens
from tests.support.fake_engine import FakeEngine
from tests.support.processes import ServerProcess

CONTEXT = 4096


def _app(tmp_path, **settings):
    engine = FakeEngine(max_length=CONTEXT)
    return create_app(Settings(store_url=str(tmp_path / "store"), **settings), engine=engine,
                      kv_store_factory=lambda snap: None)


def _forward_reserve(max_batched_tokens: int) -> int:
    engine = FakeEngine(max_length=CONTEXT)
    return MemoryModel.for_engine(engine).measure_forward(engine, max_batched_tokens)


def test_a_budget_below_the_forward_reserve_is_refused_naming_both(tmp_path):
    budget = _forward_reserve(16384) // 2
    with pytest.raises(StartupRefused) as info, TestClient(_app(tmp_path, kv_budget_bytes=budget)):
        pass
    message = str(info.value)
    assert "\n" not in message and "--kv-budget-bytes" in message and "--max-batched-tokens" in message, message
    assert f"{budget:,} bytes" in message and "raise the budget" in message


def test_the_same_budget_starts_with_a_smaller_forward_reserve(tmp_path):
    budget = _forward_reserve(16384) // 2
    assert _forward_reserve(256) * 2 < budget
    with TestClient(_app(tmp_path, kv_budget_bytes=budget, max_batched_tokens=256)) as client:
        assert client.get("/health/ready").status_code == 200


def test_a_work_ceiling_below_the_default_max_tokens_is_refused_naming_both(tmp_path):
    with pytest.raises(StartupRefused) as info, TestClient(_app(tmp_path, max_request_work=1000,
                                                                default_max_tokens=64)):
        pass
    message = str(info.value)
    assert "--max-request-work" in message and "--default-max-tokens" in message and "\n" not in message, message


@pytest.mark.integration
def test_the_command_refuses_such_settings_in_one_line_without_a_traceback(tmp_path):
    """`dllm-kvq serve` as a user starts it: the refusal is the output's last line, and no traceback comes
    before it (uvicorn logged the lifespan's traceback of the refusal first)."""
    env = {**os.environ, "DLLM_KV_BUDGET_BYTES": "8000000", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "service", "serve", "--port", "0", "--store-url",
                           str(tmp_path / "store"), "--create-store"], env=env, capture_output=True, text=True, check=False,
                          timeout=300)
    assert done.returncode == 2, done.stderr  # what `serve --help` says of a bad setting (issue 45 item 11)
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --kv-budget-bytes / DLLM_KV_BUDGET_BYTES of 8,000,000 bytes"), lines[-1]
    assert "Traceback" not in done.stderr and "StartupRefused" not in done.stderr, done.stderr


#: The README's chat (61 prompt tokens) and its answer, sent without max_tokens: the default request.
README_CHAT = "next: 4 1 4 4 2 9 7 4 3 2 8 3 3 8 5 9 9 6 6 4 8 5 6 3 6 6 3 5 5 2 2 1 8 6 7 1 1 9 9 1 8 7 2 7 7 3 4 8"
README_ANSWER = " 5 2 5 5 3 0 8 5 4 3 9 4 4 9 6 0 0 7 7 5 9 6 7 4 7 7 4 6 6 3 3 2 9 7 8 2 2 0 0 2 9 8 3 8 8 4 5 9"


def _refused_minimum(tmp_path, budget: int) -> int:
    """Start `dllm-kvq serve` at ``budget`` bytes: it must be refused with exit 2; the minimum its line names."""
    env = {**os.environ, "DLLM_KV_BUDGET_BYTES": str(budget), "OMP_NUM_THREADS": "1", "DLLM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "service", "serve", "--port", "0", "--store-url",
                           str(tmp_path / "store"), "--create-store"], env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    assert done.returncode == 2, done.stderr
    found = re.search(r"raise the budget to at least ([\d,]+) bytes", done.stderr.strip().splitlines()[-1])
    assert found, done.stderr
    return int(found.group(1).replace(",", ""))


@pytest.mark.integration
def test_at_the_minimum_budget_it_names_the_server_answers_a_default_chat(tmp_path):
    """Issue 45 item 11: at exactly the minimum the refusal names, the server starts and answers the README's chat
    without max_tokens (it used to start and refuse it: "shorten the prompt"); one byte less is refused naming the
    same minimum."""
    minimum = _refused_minimum(tmp_path, 8_000_000)
    assert _refused_minimum(tmp_path, minimum - 1) == minimum
    srv = ServerProcess({"DLLM_KV_BUDGET_BYTES": str(minimum), "DLLM_STORE_URL": str(tmp_path / "served"),
                         "DLLM_THREADS": "1"}, log_path=tmp_path / "server.log").start(timeout_s=180)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": "embedded", "messages": [{"role": "user", "content": README_CHAT}]}, timeout=120)
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == README_ANSWER


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with TestClient(_app(tmp_path_factory.mktemp("work"), block_length=4)) as c:
        yield c


def _completion(client, **body):
    return client.post("/v1/completions", json={"model": "fake-llada", "prompt": "hi", **body})


def test_the_default_ceiling_is_two_whole_context_responses():
    assert default_max_work(CONTEXT) == 2 * CONTEXT * CONTEXT


def test_n8_top_logprobs_20_max_tokens_4032_is_a_400_before_any_work(client):
    for _ in range(2):
        r = _completion(client, n=8, logprobs=5, max_tokens=4032)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_tokens" and f"ceiling of {default_max_work(CONTEXT):,}" in error["message"]
    chat = client.post("/v1/chat/completions", json={"model": "fake-llada", "messages": [{"role": "user",
                       "content": "hi"}], "n": 8, "logprobs": True, "top_logprobs": 20, "max_tokens": 4032})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens", chat.text


def test_one_whole_context_response_is_within_the_default_ceiling(client):
    from service.engine.params import DecodeParams
    assert work_tokens(8, DecodeParams(gen_length=4032, block_length=4)) < default_max_work(CONTEXT)


def test_a_likelihood_over_the_default_ceiling_is_a_400_naming_mc_num_before_any_work(client):
    prompt = [5 + i % 100 for i in range(2200)]  # token ids: a 2,200-token prompt (none the mask id, 127)
    r = _completion(client, prompt=prompt, echo=True, logprobs=1, max_tokens=0, mc_num=128)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "over_memory_budget" and error["param"] == "prompt", error
    assert "mc_num" in error["message"] and f"{default_max_work(CONTEXT):,}" in error["message"], error
    small = _completion(client, prompt=prompt[:100], echo=True, logprobs=1, max_tokens=0, mc_num=8)
    assert small.status_code == 200, small.text


def test_a_cancelled_likelihood_stops_within_one_forward_and_the_gauges_drop():
    """A likelihood is one forward per iteration with a cancel check before each (`PromptLikelihood.step`): a
    timed-out or disconnected request (`service.api.serving.Serving.run` cancels its jobs) stops within one forward
    of the cancel, leaves the batch and the running gauges return to zero. Counted in forwards, not seconds."""
    import time

    from service.engine.likelihood import LikelihoodTask
    from service.engine.params import DecodeParams, RowOptions
    from service.quant.config import KVQuantConfig
    from service.runtime.loop import Job, JobCancelled, Worker
    from service.store.active import ConfigSnapshot
    from service.telemetry import Telemetry

    engine, telemetry = FakeEngine(max_length=CONTEXT), Telemetry()
    worker = Worker(engine, lambda snap: None, telemetry, MemoryModel.for_engine(engine), 1 << 30)
    ids = [5 + i % 100 for i in range(200)]
    params = DecodeParams(gen_length=4, block_length=4, cache_mode="none", threshold=None, steps=1)
    job = Job(ids, params, RowOptions(), ConfigSnapshot(KVQuantConfig(), "none", "default"),
              task=LikelihoodTask(tuple(ids), 8, 8, 0, 0))  # 199 forwards in all
    worker.submit(job)
    worker.start()
    try:
        for _ in range(3000):  # until it has run a forward (a hang bound, not a time bar)
            if job.cohort is not None and job.cohort.forwards >= 1:
                break
            time.sleep(0.01)
        assert telemetry.running._value.get() == 1
        job.cancel()
        at_cancel = job.cohort.forwards
        with pytest.raises(JobCancelled):
            job.future.result(timeout=60)
        assert job.cohort.forwards <= at_cancel + 1 < 199
        assert telemetry.running._value.get() == 0 and telemetry.kv_reserved._value.get() == 0
    finally:
        worker.stop()
