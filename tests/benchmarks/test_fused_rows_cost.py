"""`benchmarks/fused_rows_cost.py` counts one layer of a later step on the fused kernel's path: the rows of many
requests take one kernel launch and a constant number of tensor ops, not one launch and a few ops per request."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks import fused_rows_cost


@pytest.mark.parametrize("method", ["kivi", "dllm_kvq"])
def test_the_rows_of_many_stores_take_one_launch_and_constant_ops(method, capsys):
    two, eight = fused_rows_cost.measure(method, 2, 4), fused_rows_cost.measure(method, 8, 4)
    assert eight["alone later"][2] == 8 and eight["together later"][2] == 1
    assert eight["together first"][2] == 1
    assert eight["together later"][0] == two["together later"][0]  # does not grow with the stores
    assert eight["together later"][0] < eight["alone later"][0]
    assert all(c[1] == 0 for c in eight.values())  # no host sync
    fused_rows_cost.main(["--stores", "2", "--methods", method])
    assert "together, later" in capsys.readouterr().out
