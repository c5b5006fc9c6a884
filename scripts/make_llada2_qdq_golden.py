"""Write tests/data/llada2/llada2_quant_qdq.json: the generated ids and forward counts of quantized LLaDA2 runs
(KIVI, dLLM-KVQ, KVQuant at 4 and 2 bits; 12 golden prompts per tiny checkpoint, one row each, plus 6 rows in one
batch at 4 bits) as the quantize-dequantize-in-place cache decoded them.

The file was made at commit 34219b2 (the last commit whose cache held committed blocks dequantized in place);
tests/engine/test_llada2_quant.py checks that the packed committed store (service/quant/committed.py) decodes the
same tokens. Run from the repository root: ``.venv/bin/python scripts/make_llada2_qdq_golden.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.engine.block_causal_batch import generate, generate_batch
from service.engine.loading import load_checkpoint
from tests.engine.test_llada2_generate import CASES, params_of
from tests.engine.test_llada2_quant import STORES
from tests.support.llada2 import LLADA2_CKPT, LLADA2_DATA

RUNS_PER_FAMILY, BATCH_ROWS = 12, 6


def main() -> None:
    torch.set_num_threads(1)
    out: dict[str, list] = {}
    for family in ("llada2", "llada21"):
        loaded = load_checkpoint(LLADA2_CKPT[family])
        runs = [run for f, run in CASES if f == family][:RUNS_PER_FAMILY]
        editing = family == "llada21"
        for method in STORES:
            for bits in (4, 2):
                out[f"{family}/{method}/{bits}"] = [
                    [run["id"], r.generated_ids, r.nfe] for run in runs
                    for r in [generate(loaded.model, run["prompt_ids"], params_of(run, "block", editing),
                                       loaded.spec.mask_id, loaded.spec.eos_ids,
                                       kv_store=STORES[method](loaded.spec, bits))]]
        settings = [params_of(run, "block", editing) for run in runs[:BATCH_ROWS]]
        for method in STORES:
            together = generate_batch(loaded.model, [run["prompt_ids"] for run in runs[:BATCH_ROWS]], settings,
                                      loaded.spec.mask_id, loaded.spec.eos_ids,
                                      kv_store=STORES[method](loaded.spec, 4))
            out[f"{family}/{method}/batch"] = [r.generated_ids for r in together]
    (LLADA2_DATA / "llada2_quant_qdq.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
