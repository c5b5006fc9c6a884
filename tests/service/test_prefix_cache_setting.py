"""``--prefix-cache-bytes`` keeps a prefix cache only where the family reads one (a block-causal family, cache kind
``committed``); on a bidirectional model (their prompt's K/V depend on what follows) the server says in one warning
that it does nothing and publishes no capacity (a fresh user saw the gauge show the bytes on the embedded model)."""

from __future__ import annotations

import logging

import pytest

from service.config import Settings
from service.engine import Engine
from service.main import default_kv_store_factory, make_worker
from service.telemetry import Telemetry
from tests.support.llada2 import LLADA2_CKPT
from tests.support.paths import REPO

DGEMMA = REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"


@pytest.mark.parametrize(("model", "kept"), [(None, False), ("llada2", True), (DGEMMA, False)])
def test_the_prefix_cache_is_kept_only_where_the_family_reads_it(model, kept, tmp_path, caplog):
    """DiffusionGemma's cache kind is "committed" as LLaDA2's, but its decoder reads no prefix cache (its prompt
    K/V are not bit for bit the same when a leading part is encoded apart: benchmarks/diffusion_gemma_prefix_split.py):
    the decoder is asked (`Capabilities.prefix_cache`), the warning says why, and the series is not published."""
    engine = Engine.load(None if model is None else LLADA2_CKPT.get(model, model), threads=1)
    settings = Settings(store_url=str(tmp_path), prefix_cache_bytes=1 << 20, kv_budget_bytes=1 << 30)
    telemetry = Telemetry()
    with caplog.at_level(logging.WARNING, logger="service.main"):
        worker = make_worker(settings, engine, default_kv_store_factory(engine.spec), telemetry)
    assert ("dllm_prefix_cache_capacity_bytes" in telemetry.render().decode()) is kept
    assert (engine.prefix_cache is not None) is kept
    assert (worker.prefix_cache is not None) is kept
    said = [r.getMessage() for r in caplog.records if "prefix-cache-bytes" in r.getMessage()]
    assert (said == []) is kept, said
    if not kept:
        assert said[0].startswith(f"--prefix-cache-bytes / DLLM_PREFIX_CACHE_BYTES has no effect on "
                                  f"{engine.spec.arch} models")
        assert engine.capabilities.prefix_cache in said[0]
    if model == DGEMMA:
        assert "bit for bit" in said[0] and "pass of their own" in said[0]
