"""benchmarks/llada2_iteration_cost.py's counts on a 3-layer model: one forward per iteration whatever the rows,
a MoE layer's ops independent of the rows once every expert is active, and one host read for every row's reveal."""

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


def test_one_host_read_for_every_rows_reveal():
    # 3 layers: 2 MoE layers, one expert-count read each; the rest is the reveal's one read, at 1 row as at 16.
    torch.set_num_threads(1)
    model = mini_layout(3, 512)
    for rows in (1, 16):
        counts = measure(model, rows)
        for kind in ("block-initial", "later-step"):
            assert counts[kind][1] - 2 * counts["moe"][1] == 1, (rows, kind, counts[kind])
