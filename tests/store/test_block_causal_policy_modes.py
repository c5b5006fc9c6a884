"""A block-causal model (LLaDA2) decodes cache modes prefix and dual alike in block: the dLLM-KVQ policy that
`calibrate` fits for it (filed under prefix) resolves for dual's configuration too, so ``DLLM_KV_QUANT`` with it
(which sets prefix and dual, as docs/llada2.md says) leaves the server ready. A bidirectional model keeps the
strict check: its prefix and dual caches differ."""

from __future__ import annotations

import pytest

from service.engine.loading import load_checkpoint
from service.quant.config import KVQuantConfig
from service.store.active import ConfigResolver
from service.store.base import KIND_POLICY, open_store
from service.store.config_check import ArtifactUnfit
from tests.support.artifacts import policy_for
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def specs():
    return {"llada2": load_checkpoint(REPO / "tests/data/llada2/llada2-tiny").spec, "llada": load_checkpoint(None).spec}


def _resolver(tmp_path, spec, fitted_for):
    store = open_store(str(tmp_path / "store"))
    policy = policy_for(spec, cache_mode=fitted_for, bits=4)
    store.put_model(KIND_POLICY, policy)
    return ConfigResolver(store, spec), KVQuantConfig(method="dllm_kvq", bits=4, policy_id=policy.id)


def test_a_prefix_policy_of_a_block_causal_model_serves_dual(tmp_path, specs):
    resolver, config = _resolver(tmp_path, specs["llada2"], "prefix")
    for mode in ("prefix", "dual"):
        snapshot = resolver.resolve(config, mode, "active")
        assert snapshot.cache_mode == mode and snapshot.artifact.cache_mode == "prefix"


def test_a_bidirectional_model_keeps_the_cache_mode_check(tmp_path, specs):
    resolver, config = _resolver(tmp_path, specs["llada"], "prefix")
    assert resolver.resolve(config, "prefix", "active").artifact.cache_mode == "prefix"
    with pytest.raises(ArtifactUnfit, match="cache_mode"):
        resolver.resolve(config, "dual", "active")
