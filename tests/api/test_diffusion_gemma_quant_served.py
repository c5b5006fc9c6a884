"""The tiny DiffusionGemma served with a quantized committed cache (issue 43 items 3 and 5): a real server
(`python -m service serve` under uvicorn, its own store) started with ``DLLM_KV_QUANT`` KIVI 4-bit, the shadow
re-decode on every quantized request, and the artifacts of dLLM-KVQ and KVQuant in its store:

- each method answers and its report holds the committed K/V packed (bytes under bf16's), with its configuration
  and effective bits, which the Prometheus series of the family's cache mode (``dual``) then show;
- a hot swap of ``/admin/active/dual`` between none and KIVI while clients decode: no errors, each answer names
  what it ran with;
- a dLLM-KVQ policy ranking by attention (which this family cannot give, `service.quant.canvas`) is a 400 naming
  the policy, in a request and at a swap to it (which changes nothing), and the server answers afterwards;
- the shadow re-decode measures a seeded request's agreement with the unquantized cache (an unseeded one is
  skipped: its re-decode would draw other canvases);
- admission (`service.runtime.memory.MemoryModel`) counts a quantized row's packed bytes per layer kind: at least
  what the row holds after its decode, well under full precision."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from service.engine import Engine
from service.engine.loading import load_checkpoint
from service.engine.params import DecodeParams, RowOptions
from service.runtime.memory import MemoryModel
from service.store.base import KIND_POLICY, open_store
from tests.support.apps import ADMIN_KEY
from tests.support.artifacts import kvquant_state_for, policy_for
from tests.support.dgemma_kv import store_for
from tests.support.llada2 import start_llada2_server
from tests.support.metrics import metric_sum, metrics
from tests.support.paths import REPO
from tests.support.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: A prompt past the tiny model's sliding window (12): its sliding layers drop what the window left.
PROMPT = list(range(5, 25))
REQUEST = {"prompt": PROMPT, "max_tokens": 40, "max_denoising_steps": 3, "seed": 3}
KIVI4 = {"method": "kivi", "bits": 4, "k_group_size": 8}


@pytest.fixture(scope="module")
def spec():
    return load_checkpoint(TINY).spec


@pytest.fixture(scope="module")
def artifacts(spec):
    # The server's cache mode for this family is dual (its reports' kv_config): the policies are dual's.
    return {"qerror": policy_for(spec, cache_mode="dual", bits=4, p=1, score_type="qerror", k_group_size=8),
            "attention": policy_for(spec, cache_mode="dual", bits=4, p=1, score_type="attention", k_group_size=8),
            "kvquant": kvquant_state_for(spec, bits=4, k_range=2.5)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, artifacts):
    work = tmp_path_factory.mktemp("dgemma-quant")
    store = open_store(str(work / "store"))
    store.put_model(KIND_POLICY, artifacts["qerror"])
    store.put_model(KIND_POLICY, artifacts["attention"])
    srv = start_llada2_server(TINY, work, DLLM_KV_QUANT=json.dumps(KIVI4), DLLM_ADMIN_KEY=ADMIN_KEY,
                              DLLM_SHADOW_RATE="1.0")
    # A KVQuant state is uploaded as a client would (its bytes: safetensors).
    r = httpx.post(srv.url + "/admin/kvquant_states", content=artifacts["kvquant"].to_bytes(), headers=ADMIN,
                   timeout=60)
    assert r.status_code == 201, r.text
    yield srv
    srv.stop()


def tiny_engine() -> Engine:
    torch.set_num_threads(1)
    loaded = load_checkpoint(TINY)
    return Engine(loaded.model, loaded.spec, loaded.tokenizer, torch.float32, torch.device("cpu"))


def generate(server, **extra) -> httpx.Response:
    return httpx.post(server.url + "/generate", json={**REQUEST, **extra}, timeout=180)


def configs(artifacts) -> dict[str, dict]:
    return {"kivi4": KIVI4, "kivi2": {"method": "kivi", "bits": 2, "k_group_size": 8},
            "dllm_kvq": {"method": "dllm_kvq", "bits": 4, "k_group_size": 8, "policy_id": artifacts["qerror"].id},
            "kvquant": {"method": "kvquant", "bits": 4, "k_group_size": 8,
                        "kvquant_state_id": artifacts["kvquant"].id}}


def test_the_shadow_re_decode_measures_seeded_requests_of_this_family(server):
    """Runs first (the server has shadowed nothing yet). A seeded quantized request is re-decoded with the
    unquantized cache and the same seed; one without a seed is not (its re-decode would draw other canvases)."""

    def shadowed() -> float:
        return metric_sum(metrics(server.url), "dllm_shadow_requests_total", method="kivi", cache_mode="dual")

    unseeded = {k: v for k, v in REQUEST.items() if k != "seed"}
    assert httpx.post(server.url + "/generate", json=unseeded, timeout=180).status_code == 200
    assert generate(server).status_code == 200  # the default KIVI 4-bit, seeded
    until(lambda: shadowed() >= 1, "the seeded request's shadow re-decode recorded", timeout_s=120)
    # Shadows run in order: had the unseeded request been queued, it would be done before this one's.
    assert generate(server, seed=4).status_code == 200
    until(lambda: shadowed() >= 2, "the second seeded request's shadow re-decode recorded", timeout_s=120)
    m = metrics(server.url)
    assert shadowed() == 2
    agreement = metric_sum(m, "dllm_shadow_token_agreement_sum", method="kivi")
    assert 0 <= agreement <= 2 and metric_sum(m, "dllm_shadow_token_agreement_count", method="kivi") == 2


def test_each_method_holds_the_committed_kv_packed_and_the_metrics_show_it(server, artifacts):
    plain = generate(server, kv_quant={"method": "none"})
    assert plain.status_code == 200, plain.text
    plain = plain.json()
    assert plain["kv_config"]["kv_quant"]["method"] == "none"
    reports = {}
    for name, config in configs(artifacts).items():
        extra = {} if name == "kivi4" else {"kv_quant": config}  # kivi4: the server's default configuration
        r = generate(server, **extra)
        assert r.status_code == 200, (name, r.text)
        report = reports[name] = r.json()
        assert report["kv_config"]["kv_quant"]["method"] == config["method"], name
        assert report["kv_config"]["source"] == ("default" if name == "kivi4" else "request")
        assert report["rows"][0]["generated_ids"] and report["rows"][0]["finish_reason"] in ("length", "stop")
        kv = report["kv"]
        assert kv["config"]["bits"] == config["bits"] and 0 < kv["bytes_held"] < kv["bf16_bytes"], (name, kv)
        assert kv["k_nominal_bits"] >= config["bits"] and config["bits"] < kv["v_storage_bits"] < 16, (name, kv)
    assert reports["kivi2"]["kv"]["bytes_held"] < reports["kivi4"]["kv"]["bytes_held"]
    # Each served answer is the engine's decode alone with the same store (tests/support/dgemma_kv.py builds the
    # same configurations and artifacts), and the quantized caches change some of them: the store was used.
    engine = tiny_engine()
    params = DecodeParams(gen_length=64, max_denoising_steps=3)  # max_tokens 40 in whole blocks of 32
    row = [RowOptions(seed=REQUEST["seed"], max_tokens=REQUEST["max_tokens"])]
    assert plain["rows"][0]["generated_ids"] == engine.generate([PROMPT], params, row).rows[0].generated_ids
    for name, (method, bits) in {"kivi4": ("kivi", 4), "kivi2": ("kivi", 2), "dllm_kvq": ("dllm_kvq", 4),
                                 "kvquant": ("kvquant", 4)}.items():
        alone = engine.generate([PROMPT], params, row, kv_store=store_for(method, bits, engine.spec))
        assert reports[name]["rows"][0]["generated_ids"] == alone.rows[0].generated_ids, name
    assert any(r["rows"][0]["generated_ids"] != plain["rows"][0]["generated_ids"] for r in reports.values())
    m = metrics(server.url)
    for name in ("kivi4", "kivi2"):
        kv = reports[name]["kv"]
        labels = {"method": "kivi", "bits": str(configs(artifacts)[name]["bits"]), "cache_mode": "dual"}
        for tensor in ("k", "v"):
            for accounting in ("nominal", "storage"):
                value = metric_sum(m, "dllm_kv_effective_bits", **labels, tensor=tensor, accounting=accounting)
                assert value == pytest.approx(kv[f"{tensor}_{accounting}_bits"]), (name, tensor, accounting)
        assert metric_sum(m, "dllm_kv_bytes_held", **labels) == kv["bytes_held"]
        assert metric_sum(m, "dllm_kv_bf16_bytes", **labels) == kv["bf16_bytes"]
    for method in ("dllm_kvq", "kvquant"):
        assert metric_sum(m, "dllm_kv_bytes_held", method=method, cache_mode="dual") > 0, method


def test_an_attention_ranked_policy_is_a_400_in_a_request_and_at_a_swap(server, artifacts):
    bad = {"method": "dllm_kvq", "bits": 4, "k_group_size": 8, "policy_id": artifacts["attention"].id}
    r = generate(server, kv_quant=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_quant.policy_id" and "qerror" in r.json()["error"]["message"]
    swap = httpx.put(server.url + "/admin/active/dual", json=bad, headers=ADMIN, timeout=60)
    assert swap.status_code == 400, swap.text
    assert swap.json()["error"]["param"] == "kv_quant.policy_id"
    active = httpx.get(server.url + "/admin/active", headers=ADMIN, timeout=60)
    assert "dllm_kvq" not in active.text  # the refused swap changed nothing
    r = generate(server)
    assert r.status_code == 200 and r.json()["kv_config"]["kv_quant"]["method"] == "kivi", r.text


def test_a_hot_swap_between_none_and_kivi_while_clients_decode(server):
    answers, failures, stop = [], [], threading.Event()

    def load():
        with httpx.Client(base_url=server.url, timeout=180) as c:
            while not stop.is_set():
                r = c.post("/generate", json={**REQUEST, "max_tokens": 24})
                (answers if r.status_code == 200 else failures).append(r)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        until(lambda: answers, "a request answered before the swaps", timeout_s=120)
        for config in ({"method": "none"}, KIVI4, {"method": "none"}, KIVI4):
            seen = len(answers)
            r = httpx.put(server.url + "/admin/active/dual", json=config, headers=ADMIN, timeout=60)
            assert r.status_code == 200, r.text
            until(lambda n=seen: len(answers) > n + 1, "requests answered after the swap", timeout_s=120)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, [r.text for r in failures]
    methods = {r.json()["kv_config"]["kv_quant"]["method"] for r in answers}
    assert methods == {"none", "kivi"}, methods
    for r in answers:
        kv = r.json()["kv"]
        if r.json()["kv_config"]["kv_quant"]["method"] == "kivi":
            assert kv["bytes_held"] < kv["bf16_bytes"]


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq", "kvquant"])
@pytest.mark.parametrize("prompt_len", [5, 40])
def test_admission_counts_a_quantized_row_by_layer_kind(spec, method, prompt_len):
    """The bytes admission counts for a quantized request (per kind, its store's packed bytes per token; sliding
    layers bounded) are at least what its row holds after the decode, and well under full precision."""
    engine = tiny_engine()
    memory = MemoryModel.for_engine(engine)
    params = DecodeParams(gen_length=64, max_denoising_steps=2)
    prompt = [5 + i % 400 for i in range(prompt_len)]
    per_token = memory.kv_bytes_per_token(("test", method), lambda: store_for(method, 4, spec))
    assert memory.quantized(("test", method)) and per_token > 0
    counted = memory.cost(prompt_len, params, per_token, ("test", method)).kv
    full = memory.cost(prompt_len, params, per_token).kv  # no configuration named: full precision
    store = store_for(method, 4, spec)
    report = engine.generate([prompt], params, [RowOptions(seed=1, max_tokens=64)], kv_store=store)
    held = report.kv.bytes_held
    assert 0 < held <= counted < 0.75 * full, (held, counted, full)
    assert counted <= 2 * held + 4096, (held, counted)  # an upper bound, not a blanket one


def test_a_configuration_the_cache_refuses_fails_its_request_alone_as_a_400(spec, artifacts):
    """A configuration that reached the worker unchecked (the configuration check refuses it first, above; a
    store entry written by an older replica need not have been): the worker's probe of it raises, and the request
    fails alone with the 400 naming the policy, the worker still serving the next request."""
    from service.api.errors import MAPPING
    from service.quant.config import KVQuantConfig
    from service.quant.store import make_kv_store
    from service.runtime.loop import Job, Worker
    from service.store.active import ConfigSnapshot
    from service.telemetry import Telemetry

    engine = tiny_engine()
    policy = artifacts["attention"]
    bad = KVQuantConfig(method="dllm_kvq", bits=4, k_group_size=8, artifact_id=policy.id)

    def factory(snapshot):
        if snapshot.config.method == "none":
            return None
        return make_kv_store(snapshot.config, spec, policy, attention="torch")

    worker = Worker(engine, factory, Telemetry(), MemoryModel.for_engine(engine), 1 << 30, max_rows=4)
    params = DecodeParams(gen_length=32, max_denoising_steps=2)
    refused = Job(PROMPT, params, RowOptions(seed=1), ConfigSnapshot(bad, "dual", "request", artifact=policy))
    fine = Job(PROMPT, params, RowOptions(seed=1), ConfigSnapshot(KVQuantConfig(method="none"), "dual", "request"))
    worker.submit(refused)
    worker.submit(fine)
    worker.start()
    try:
        with pytest.raises(Exception) as raised:
            refused.future.result(timeout=300)
        assert fine.future.result(timeout=300).row.generated_ids
    finally:
        worker.stop()
    status = next(s for kind, s, _, _ in MAPPING if isinstance(raised.value, kind))
    assert status == 400 and raised.value.field == "kv_quant.policy_id", raised.value
