"""`calibrate all` on the tiny LLaDA2 (block-causal), in process: TRACE and the report say in one line each that
they do not apply, a dLLM-KVQ policy for ``prefix`` (what cache mode ``block`` serves) and a KVQuant state are
stored, and both serve a LLaDA2 decode in ``block`` mode (the registry's check as the server runs it)."""

from __future__ import annotations

import pytest
import torch

from calibration.block_causal import diagnose_block_causal
from calibration.cli import main
from calibration.diagnose import DiagnoseSettings
from service.artifacts.kvquant_state import KVQuantState
from service.artifacts.policy import PolicyTable
from service.engine.block_causal import BlockCausalParams
from service.engine.block_causal_batch import generate
from service.engine.loading import load_checkpoint
from service.engine.models import configured_cache_mode
from service.quant.config import KVQuantConfig
from service.quant.registry import method
from service.quant.store import make_kv_store
from service.store.base import KIND_KVQUANT_STATE, KIND_POLICY, open_store
from tests.calibration.test_job import token_id_bucket
from tests.support.llada2 import LLADA2_CKPT

CKPT = LLADA2_CKPT["llada2"]


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_checkpoint(CKPT)


def test_diagnostics_read_committed_blocks_only(loaded):
    """Records come from blocks with committed text before them: a 40-token prompt and 64-token answer at block
    32 give blocks 1, 2 and 3 (block 0 has nothing committed), 2 states each, every layer and candidate."""
    settings = DiagnoseSettings(cache_modes=("prefix",), bits=(4,), k_group_size=32)
    sums = diagnose_block_causal(loaded.model, loaded.spec, list(range(1, 41)), list(range(41, 105)), "s", settings,
                                 block_length=32, steps_per_block=2)
    cells = {key: cell for key, cell in sums.cells.items() if key.startswith("prefix/4/0/")}
    assert cells and {cell.records for cell in cells.values()} == {3 * 2}
    assert {cell.tokens for cell in cells.values()} == {2 * (32 + 64 + 96)}
    assert {key.split("/")[0] for key in sums.cells} == {"prefix"}


def test_calibrate_all_makes_a_servable_policy_and_state(loaded, tmp_path, capsys):
    bucket = token_id_bucket(tmp_path / "qa.jsonl")
    store_dir = tmp_path / "store"
    code = main(["all", "--model", str(CKPT), "--store", str(store_dir), "--bucket", f"qa={bucket}",
                 "--samples", "2", "--block-length", "32", "--max-answer-length", "64", "--steps-per-block", "2",
                 "--k-group-size", "32", "--min-records", "4", "--bits", "4", "--kvquant-bits", "4",
                 "--out", str(tmp_path / "out"), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    lines = printed.splitlines()
    for step in ("trace: does not apply to a block-causal model", "cache modes: a block-causal model",
                 "report: not written for a block-causal model"):
        assert sum(step in line for line in lines) == 1, (step, printed)
    assert (tmp_path / "out" / "activate" / "dllm_kvq-prefix-4bit.json").is_file()
    store = open_store(str(store_dir))
    (policy_id,) = store.list(KIND_POLICY)
    (state_id,) = store.list(KIND_KVQUANT_STATE)
    policy = PolicyTable.from_bytes(store.get(KIND_POLICY, policy_id))
    state = KVQuantState.from_bytes(store.get(KIND_KVQUANT_STATE, state_id))
    assert policy.cache_mode == "prefix" and policy.bits == 4 and len(policy.layers) == loaded.spec.num_layers
    spec = loaded.spec
    params = BlockCausalParams(gen_length=64, block_length=32, steps=32, threshold=0.9)
    prompt = list(range(1, 41))
    exact = generate(loaded.model, prompt, params, spec.mask_id, spec.eos_ids)
    for config, artifact in ((KVQuantConfig(method="dllm_kvq", bits=4, policy_id=policy.id), policy),
                             (KVQuantConfig(method="kvquant", bits=4, kvquant_state_id=state.id), state)):
        entry = method(config.method)
        entry.check(artifact, config, policy.v_group_size, configured_cache_mode("block", "llada2"))  # as the server checks
        artifact.validate_for(spec)
        store_ = make_kv_store(config, spec, artifact, attention="torch")
        result = generate(loaded.model, prompt, params, spec.mask_id, spec.eos_ids, kv_store=store_)
        assert result.generated_ids and result.nfe >= exact.nfe // 4
        report = store_.report()
        assert report.bytes_held > 0 and 4 <= report.k_nominal_bits < 16
