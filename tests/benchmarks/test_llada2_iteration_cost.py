"""benchmarks/llada2_iteration_cost.py's counts on a 3-layer model: one forward per iteration whatever the rows,
a MoE layer's ops independent of the rows, and one host read per iteration (issue 31's target: at most 2)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.llada2_iteration_cost import measure, mini_layout


@pytest.mark.parametrize("kv_quant", ["none", "kivi", "dllm_kvq"])
def test_one_forward_per_iteration_and_moe_ops_bounded_by_the_experts(kv_quant):
    torch.set_num_threads(1)
    model = mini_layout(3, 512)
    counts = {rows: measure(model, rows, kv_quant) for rows in (8, 16)}
    for rows, c in counts.items():
        for kind in ("block-initial", "later-step"):
            assert c[kind][2:] == (1, rows)  # forwards, rows in the one forward
    assert counts[8]["moe"][2] == counts[16]["moe"][2] == 256  # every expert active
    assert counts[8]["moe"][:2] == counts[16]["moe"][:2]  # same ops and syncs


@pytest.mark.parametrize("kv_quant", ["none", "kivi", "dllm_kvq"])
def test_one_host_read_per_iteration(kv_quant):
    # The rows' reveal, read once for every row, with the committing blocks' write checks (quantized) joined to
    # it; the MoE layers read nothing (grouped_mm). At 1 row as at 16, block-initial and later steps alike.
    torch.set_num_threads(1)
    model = mini_layout(3, 512)
    for rows in (1, 16):
        counts = measure(model, rows, kv_quant)
        assert counts["moe"][1] == 0, (rows, counts["moe"])
        for kind in ("block-initial", "later-step"):
            assert counts[kind][1] == 1, (rows, kind, counts[kind])
