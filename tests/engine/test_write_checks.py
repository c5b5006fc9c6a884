"""A quantized store's block-initial write reads nothing inside the layers (issue 21): the verdict of its checks
(finite K/V and scores, ranges that fit the dtype) joins the running batch's one host read per iteration, and a row
whose write fails its checks fails alone, with the error the write raises when it reads its checks at once."""

from __future__ import annotations

import pytest
import torch

from benchmarks.iteration_cost import Counter
from service.quant.config import KVQuantConfig
from service.quant.errors import NonFiniteKVError
from service.quant.store import QuantizedKVStore, make_kv_store
from service.runtime.scheduler import forward_plan
from tests.engine.test_continuous_batch import _p
from tests.engine.test_decode_quantized import policy_for
from tests.support.fastdllm import four_prompts

#: Where the poisoned store's K turns NaN: a reused prefix column of its one row, at layer 1.
LAYER, COLUMN = 1, 3
MESSAGE = (f"layer {LAYER}: K holds NaN or inf at row 0, sequence column {COLUMN}; refusing to quantize it (it "
           "would poison its group's statistics)")


def _store(engine, kind: str | None):
    if kind is None:
        return None
    if kind == "dllm_kvq":
        table = policy_for(engine.spec, 4)
        return make_kv_store(KVQuantConfig(method="dllm_kvq", bits=4, k_group_size=8, policy_id=table.id),
                             engine.spec, artifact=table)
    return make_kv_store(KVQuantConfig(method=kind, bits=4, k_group_size=8), engine.spec)


class PoisonedStore(QuantizedKVStore):
    """A KIVI store whose layer-1 K holds a NaN from the block starting at ``from_column`` on (a copy of the
    layer's K is poisoned, as a model that overflowed would hand it over): the real quantizer refuses it."""

    def __init__(self, engine, from_column: int) -> None:
        store = _store(engine, "kivi")
        super().__init__(store.quantizer)
        self.from_column = from_column

    def write(self, layer, k, v, segments, scores=None) -> None:
        if layer == LAYER and segments.block_start >= self.from_column:
            k = k.clone()
            k[0, 0, COLUMN, 1] = float("nan")
        super().write(layer, k, v, segments, scores)


def test_a_block_initial_iteration_of_quantized_rows_reads_the_host_once(engines):
    """Every iteration, block-initial ones included, makes one host read for the whole batch, with KIVI and
    dLLM-KVQ stores as with the unquantized one (the writes' checks were one read per request and layer)."""
    engine = engines["llada"]
    prompts = four_prompts("llada")
    params = _p(gen_length=64, block_length=32, threshold=None, steps=8)
    syncs = {}
    for kind in (None, "kivi", "dllm_kvq"):
        batch = engine.batch(forward_plan())
        for prompt in prompts:
            batch.join(engine.cohort([prompt], params, None, _store(engine, kind)))
        counts = []
        with torch.inference_mode():
            while batch.cohorts:
                with Counter() as counter:
                    batch.step()
                counts.append(counter.syncs)
                assert not batch.failed
        syncs[kind] = counts
    assert len(syncs[None]) == 8  # 2 blocks of 4 steps (iterations 0 and 4 are block-initial)
    assert syncs["kivi"] == syncs["dllm_kvq"] == syncs[None] == [1] * 8, syncs


@pytest.mark.parametrize("split", [0, 8], ids=["whole", "split-by-layers"])
@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_a_row_whose_write_fails_its_checks_fails_alone_with_the_same_error(engines, arch, split):
    """Three requests in one merged forward; one store's second block-initial write meets a NaN K: that request
    fails with the error its write raises alone (layer, row and column named), the others decode as alone. With
    block-initial passes split by layers (one layer a piece), the checks of every piece are read with the last
    piece's iteration and the failing pass is run again whole."""
    engine = engines[arch]
    prompts = four_prompts(arch)[:3]
    params = _p(gen_length=64, block_length=32, threshold=None, steps=8)
    poisoned = PoisonedStore(engine, len(prompts[1]) + 32)  # one row, no padding: the response starts there
    stores = [_store(engine, "kivi"), poisoned, _store(engine, "dllm_kvq")]
    batch = engine.batch(forward_plan(split_tokens=split, num_layers=engine.spec.num_layers))
    cohorts = [engine.cohort([p], params, None, s) for p, s in zip(prompts, stores)]
    failed, merged = [], 0
    with torch.inference_mode():
        for cohort in cohorts:
            batch.join(cohort)
        while batch.cohorts:
            batch.step()
            if batch.failed:
                merged = batch.merged
            failed += batch.failed
    assert [c for c, _ in failed] == [cohorts[1]]
    assert merged == 3  # it failed inside a forward it shared with both others
    assert type(failed[0][1]) is NonFiniteKVError and str(failed[0][1]) == MESSAGE
    assert engine.report(cohorts[1]).rows[0].nfe == 4  # the first block, then nothing of the second
    for i in (0, 2):
        alone = engine.generate([prompts[i]], params, kv_store=_store(engine, ["kivi", None, "dllm_kvq"][i]))
        assert engine.report(cohorts[i]).rows[0].generated_ids == alone.rows[0].generated_ids, i
    # Alone the request raises the same (the only call of its iteration: nothing to isolate) ...
    with pytest.raises(NonFiniteKVError) as alone_error, torch.inference_mode():
        engine.generate([prompts[1]], params, kv_store=PoisonedStore(engine, len(prompts[1]) + 32))
    assert str(alone_error.value) == MESSAGE
    # ... and so does the write outside a batch, which reads its checks at once (what every write did before).
    k = torch.randn(1, engine.spec.num_kv_heads, 40, engine.spec.head_dim)
    from service.engine.kv_store import Segments

    with pytest.raises(NonFiniteKVError) as direct:
        PoisonedStore(engine, 0).write(LAYER, k, torch.randn_like(k), Segments((0,), 8, 16, 40, "dual"))
    assert str(direct.value) == MESSAGE
