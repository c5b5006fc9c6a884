"""A failing row fails alone (issue 13): three requests co-batched by the continuous scheduler on the tiny LLaDA
checkpoint, one of them with a KV store that raises inside the decode step; the other two finish exactly as alone,
the failing one ends with `BatchFailed` (HTTP 500) naming the cause, and the worker goes on."""

from __future__ import annotations

import pytest
import torch

from service.engine import Engine
from service.engine.kv_store import FullPrecisionKVStore
from service.engine.params import DecodeParams, RowOptions
from service.quant.config import KVQuantConfig
from service.runtime.loop import BatchFailed, Job, Worker
from service.runtime.memory import MemoryModel
from service.store.active import ConfigSnapshot
from service.telemetry import Telemetry
from tests.support.fastdllm import CKPT, four_prompts

# The configuration whose store breaks (its k_group_size only tells it apart; method none is unquantized).
BROKEN = KVQuantConfig(k_group_size=16)


class LosingStore(FullPrecisionKVStore):
    """A full-precision store that loses its K/V after the first block: reading the reused cache raises (the
    shape of a real fault of one request's store, e.g. a quantizer refusing its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_block_start: int | None = None

    def write(self, layer, k, v, segments, scores=None) -> None:
        if self.first_block_start is None:
            self.first_block_start = segments.block_start
        if segments.block_start != self.first_block_start:
            raise RuntimeError(f"the KV store of this request lost layer {layer}")
        super().write(layer, k, v, segments, scores)

    def clear(self) -> None:
        super().clear()
        self.first_block_start = None

    @property
    def bytes_held(self) -> int:
        """What the admission probe measures (`service.runtime.memory.MemoryModel`)."""
        return sum(t.numel() * t.element_size() for kv in self._layers.values() for t in kv)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(CKPT["llada"])


def test_three_co_batched_requests_one_fails_two_succeed(engine):
    params = DecodeParams(gen_length=96, block_length=32, threshold=0.9, ignore_eos=True)
    prompts = four_prompts("llada")[:3]
    configs = [KVQuantConfig(), BROKEN, KVQuantConfig()]
    worker = Worker(
        engine, lambda snap: LosingStore() if snap.config == BROKEN else FullPrecisionKVStore(), Telemetry(),
        MemoryModel.for_engine(engine), 1 << 30, max_rows=8)
    jobs = [worker.submit(Job(p, params, RowOptions(), ConfigSnapshot(c, "dual", "request")))
            for p, c in zip(prompts, configs)]
    worker.start()
    ok = [jobs[0].future.result(timeout=300), jobs[2].future.result(timeout=300)]
    with pytest.raises(BatchFailed, match="RuntimeError: the KV store of this request lost layer 0"):
        jobs[1].future.result(timeout=300)
    for prompt, result in zip((prompts[0], prompts[2]), ok):
        alone = engine.generate([prompt], params).rows[0]
        assert result.row.generated_ids == alone.generated_ids and result.row.finish_reason == "length"
        assert result.batch_size == 3  # they ran together with the failing one
    # The worker lives on: a later request is served.
    later = worker.submit(Job(prompts[0], params, RowOptions(), ConfigSnapshot(KVQuantConfig(), "dual", "request")))
    assert later.future.result(timeout=300).row.generated_ids == ok[0].row.generated_ids
    assert worker.healthy
    worker.stop()
