"""The server on the tiny Fast-dLLM checkpoints (no tokenizer: token ids only), in-process: ``/generate`` gives
the reference's tokens, also when two requests are decoded in one batch; text needs a tokenizer (400)."""

from __future__ import annotations

import concurrent.futures

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.main import create_app
from tests.support.fastdllm import CKPT, golden


def _runs(arch: str, mode: str, schedule: str, gen_length: int) -> list[dict]:
    return [r for r in golden(f"{arch}_generate.json")["runs"] if r["mode"] == mode and r["schedule"] == schedule
            and r["params"]["gen_length"] == gen_length and not r["fragile"]]


@pytest.mark.parametrize("arch,mode,schedule", [("llada", "dual", "threshold"), ("dream", "prefix", "fixed")])
def test_generate_matches_the_reference_alone_and_batched(tmp_path, arch, mode, schedule):
    runs = _runs(arch, mode, schedule, 64)[:2]
    settings = Settings(model=str(CKPT[arch]), store_url=str(tmp_path / "store"), threads=1,
                        max_batch_size=4)

    def body(run):
        p = run["params"]
        knobs = {"threshold": p["threshold"]} if schedule == "threshold" else {"steps": p["steps"]}
        # The goldens decode every position (the reference does not stop at EOS).
        return {"prompt": run["prompt_ids"], "max_tokens": p["gen_length"], "block_length": p["block_length"],
                "cache_mode": mode, "ignore_eos": True, **knobs}

    with TestClient(create_app(settings)) as client:
        alone = client.post("/generate", json=body(runs[0]))
        assert alone.status_code == 200, alone.text
        assert alone.json()["rows"][0]["generated_ids"] == runs[0]["generated_ids"]
        # The engine skips the reference's empty calls after a block its first pass filled: NFE <= the golden's.
        assert alone.json()["rows"][0]["nfe"] <= runs[0]["nfe"] and alone.json()["batch_size"] == 1
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            batched = list(pool.map(lambda run: client.post("/generate", json=body(run)), runs))
        for run, r in zip(runs, batched, strict=True):
            assert r.json()["rows"][0]["generated_ids"] == run["generated_ids"]
        assert {r.json()["batch_size"] for r in batched} == {2}
        r = client.post("/v1/completions", json={"prompt": "text", "max_tokens": 32})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        r = client.post("/generate", json={**body(runs[0]), "prompt": [client.app.state.engine.spec.mask_id]})
        assert r.status_code == 400 and "mask" in r.json()["error"]["message"]
