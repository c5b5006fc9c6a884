"""``key_bias_correction`` on DiffusionGemma is refused, not ignored (service/quant/canvas.py `check_scores`): its
decoder attends over the dequantized committed K/V as plain tensors, with no per-key bias, so before this the flag
was accepted, echoed in ``kv_config`` and changed nothing. A request naming it and an admin swap to it are a 400
whose ``param`` is ``kv_quant.key_bias_correction`` (the swap changes nothing), ``generate`` exits 2 naming it, and
a server started with it serves none of the quantized cache modes (NOT ready, as for any setting it cannot
serve)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.apps import ADMIN_KEY
from tests.support.cli import service_main
from tests.support.llada2 import start_llada2_server
from tests.support.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
KIVI2 = {"method": "kivi", "bits": 2, "k_group_size": 8}
CORRECTED = {**KIVI2, "key_bias_correction": True}
REQUEST = {"prompt": list(range(5, 25)), "max_tokens": 40, "max_denoising_steps": 3, "seed": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("dgemma-key-bias")
    srv = start_llada2_server(TINY, work, DLLM_KV_QUANT=json.dumps(KIVI2), DLLM_ADMIN_KEY=ADMIN_KEY)
    yield srv
    srv.stop()


def test_a_request_and_a_swap_naming_it_are_a_400(server):
    r = httpx.post(server.url + "/generate", json={**REQUEST, "kv_quant": CORRECTED}, timeout=180)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_quant.key_bias_correction" and "key_bias_correction" in error["message"]
    swap = httpx.put(server.url + "/admin/active/dual", json=CORRECTED, headers=ADMIN, timeout=60)
    assert swap.status_code == 400, swap.text
    assert swap.json()["error"]["param"] == "kv_quant.key_bias_correction"
    active = httpx.get(server.url + "/admin/active", headers=ADMIN, timeout=60)
    assert "key_bias_correction" not in active.text  # the refused swap changed nothing
    r = httpx.post(server.url + "/generate", json=REQUEST, timeout=180)
    assert r.status_code == 200, r.text
    served = r.json()["kv_config"]["kv_quant"]
    assert served["method"] == "kivi" and "key_bias_correction" not in served, served


def test_generate_exits_2_naming_it():
    done = service_main("generate", "--model", str(TINY), "--prompt-ids", "5,6,7,8,9", "--gen-length", "32",
                        "--kv-quant", "kivi", "--kv-bits", "2", "--kv-group-size", "8", "--kv-key-bias-correction")
    assert done.returncode == 2 and "key_bias_correction" in done.stderr, done.stderr
