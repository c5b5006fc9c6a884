"""benchmarks/diffusion_gemma_iteration_cost.py's counts on a 3-layer model: one decoder pass per denoising step and
one encoder pass per commit, one host read per step and two per commit, whatever the rows."""

from __future__ import annotations

import torch

from benchmarks.diffusion_gemma_iteration_cost import a4b_layout, measure


def test_one_decoder_pass_per_step_and_one_encoder_pass_per_commit():
    torch.set_num_threads(1)
    model = a4b_layout(layers=3, vocab=512, canvas=16)
    for rows in (1, 3):
        counts = measure(model, rows)
        assert counts["step"][1:] == (1, 1, 0), (rows, counts)  # syncs, decoder passes, encoder passes
        assert counts["commit"][1:] == (2, 1, 1), (rows, counts)
