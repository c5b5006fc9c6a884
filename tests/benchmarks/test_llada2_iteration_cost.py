"""benchmarks/llada2_iteration_cost.py's counts on a 3-layer model: one forward per iteration whatever the rows,
and a MoE layer's ops independent of the rows once every expert is active."""

from __future__ import annotations

import pytest
import torch

from benchmarks.llada2_iteration_cost import measure, mini_layout


@pytest.mark.parametrize("kv_quant", ["none", "kivi"])
def test_one_forward_per_iteration_and_moe_ops_bounded_by_the_experts(kv_quant):
    torch.set_num_threads(1)
    model = mini_layout(3, 512)
    counts = {rows: measure(model, rows, kv_quant) for rows in (8, 16)}
    for rows, c in counts.items():
        for kind in ("block-initial", "later-step"):
            assert c[kind][2:] == (1, rows)  # forwards, rows in the one forward
    assert counts[8]["moe"][2] == counts[16]["moe"][2] == 256  # every expert active
    assert counts[8]["moe"][:2] == counts[16]["moe"][:2]  # same ops and syncs
